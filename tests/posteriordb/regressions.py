"""The 26 linear regressions of the suite: Gelman and Hill's ARM examples (earnings, kidiq, mesquite, nes) and sblrc.

Every Stan model here is ``y ~ normal(X * beta, sigma)`` with ``beta`` a vector and ``sigma > 0``; they differ in
the design ``X`` (Stan's ``transformed data`` block: logs, centring, interactions, dummies) and the priors. Each port
builds the same ``X`` (float64, the intercept column first, columns in ``beta``'s order) and samples::

    beta ~ Normal(0, coefficient_scale)          # Stan: flat, except sblrc's normal(0, 10)
    sigma ~ HalfCauchy(2.5) or HalfNormal(s)     # Stan: cauchy(0, 2.5) for kidiq, normal(0, 10) for sblrc, else flat
    y[i] ~ Normal(X[i] @ beta, sigma)            # in pyro.plate("data", N, subsample_size=B)

A flat coefficient prior becomes Normal(0, 1000) and a flat scale prior HalfNormal(1000), except where the data's
units make 1,000 narrow: mesquite's weights in grams (10⁴) and earnings in dollars (10⁶). Every such scale is at
least 45 reference sds of each coefficient (the closest: mesquite's ``beta[4]``, sd 221, against 10⁴), and a Normal
prior of scale s moves a posterior mean m of sd v by about v² m / s², at most 0.0011 v here (mesquite's ``beta[1]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from tests.posteriordb.entry import Posterior, batch_size, vector

__all__ = ["NUM_DATA", "PORTS", "Design", "LinearRegression"]

ScalePrior = Literal["half-normal", "half-cauchy"]
NUM_DATA = {"earnings": 1192, "kidiq": 434, "kidiq_with_mom_work": 434, "mesquite": 46, "sblrc": 100}
NUM_DATA |= {"nes1972": 1330, "nes1976": 1184, "nes1980": 701, "nes1984": 1226, "nes1988": 1113, "nes1992": 1350}
NUM_DATA |= {"nes1996": 1043}


@dataclass(frozen=True)
class LinearRegression:
    """``y ~ Normal(x @ beta, sigma)`` in a subsampled data plate, with the priors of one Stan model."""

    coefficient_scale: float
    sigma_prior: ScalePrior
    sigma_scale: float
    batch_size: int

    def __call__(self, x: Tensor, y: Tensor) -> None:
        beta = pyro.sample("beta", dist.Normal(x.new_zeros(x.shape[-1]), self.coefficient_scale).to_event(1))
        scale = x.new_tensor(self.sigma_scale)
        sigma = pyro.sample(
            "sigma", dist.HalfCauchy(scale) if self.sigma_prior == "half-cauchy" else dist.HalfNormal(scale)
        )
        with pyro.plate("data", len(y), subsample_size=self.batch_size) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ beta, sigma), obs=y[idx])


@dataclass(frozen=True)
class Design:
    """Stan's ``transformed data``: the response and the columns of ``X``, by name, from the data's variables."""

    variables: Callable[[Mapping[str, Any]], dict[str, Tensor]]  # Stan's data -> named float64 vectors
    response: str
    columns: tuple[str, ...]
    intercept: bool = True  # a column of ones first (beta[1])

    @property
    def num_coefficients(self) -> int:
        return len(self.columns) + self.intercept

    def __call__(self, data: Mapping[str, Any], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        named = self.variables(data)
        y = named[self.response]
        columns = [torch.ones_like(y)] * self.intercept + [named[column] for column in self.columns]
        return torch.stack(columns, -1).to(dtype), y.to(dtype)


def _real(values: list) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _level(values: list, level: int) -> Tensor:
    return (torch.tensor(values) == level).to(torch.float64)


def _earnings(data: Mapping[str, Any]) -> dict[str, Tensor]:
    earn, height, male = _real(data["earn"]), _real(data["height"]), _real(data["male"])
    named = {"earn": earn, "log_earn": earn.log(), "log10_earn": earn.log10(), "height": height, "male": male}
    return named | {"log_height": height.log(), "inter": height * male}


def _kidiq(data: Mapping[str, Any]) -> dict[str, Tensor]:
    hs, iq = _real(data["mom_hs"]), _real(data["mom_iq"])
    c_hs, c_iq, c2_hs, c2_iq = hs - hs.mean(), iq - iq.mean(), hs - 0.5, iq - 100.0
    named = {"kid_score": _real(data["kid_score"]), "mom_hs": hs, "mom_iq": iq, "inter": hs * iq}
    named |= {"c_mom_hs": c_hs, "c_mom_iq": c_iq, "c_inter": c_hs * c_iq}
    named |= {"c2_mom_hs": c2_hs, "c2_mom_iq": c2_iq, "c2_inter": c2_hs * c2_iq}
    if "mom_work" in data:
        named |= {f"work{level}": _level(data["mom_work"], level) for level in (2, 3, 4)}
    return named


def _mesquite(data: Mapping[str, Any]) -> dict[str, Tensor]:
    keys = ("weight", "diam1", "diam2", "canopy_height", "total_height", "density")
    named = {key: _real(data[key]) for key in keys}
    named |= {f"log_{key}": value.log() for key, value in list(named.items())}
    d1, d2, canopy = named["diam1"], named["diam2"], named["canopy_height"]
    named |= {"log_canopy_volume": (d1 * d2 * canopy).log(), "log_canopy_area": (d1 * d2).log()}
    return named | {"log_canopy_shape": (d1 / d2).log(), "group": _real(data["group"])}


def _nes(data: Mapping[str, Any]) -> dict[str, Tensor]:
    named = {key: _real(data[key]) for key in ("partyid7", "real_ideo", "race_adj", "educ1", "gender", "income")}
    ages = {"age30_44": 2, "age45_64": 3, "age65up": 4}
    return named | {name: _level(data["age_discrete"], level) for name, level in ages.items()}


def _blr(data: Mapping[str, Any]) -> dict[str, Tensor]:
    x = _real(data["X"])
    return {"y": _real(data["y"])} | {f"X[, {j + 1}]": x[:, j] for j in range(x.shape[1])}


MESQUITE_ALL = ("log_diam1", "log_diam2", "log_canopy_height", "log_total_height", "log_density", "group")
MESQUITE_LOGVAS = ("log_canopy_volume", "log_canopy_area", "log_canopy_shape", *MESQUITE_ALL[3:])
MESQUITE_RAW = ("diam1", "diam2", "canopy_height", "total_height", "density", "group")
NES = ("real_ideo", "race_adj", "age30_44", "age45_64", "age65up", "educ1", "gender", "income")
BLR = tuple(f"X[, {j}]" for j in range(1, 6))


def _flat(design: Design, scale: float = 1e3) -> tuple[Design, float, ScalePrior, float, str]:
    """Stan's flat priors on beta and on sigma > 0: Normal(0, scale) and HalfNormal(scale) stand in."""
    return (
        design,
        scale,
        "half-normal",
        scale,
        f"beta: flat -> Normal(0, {scale:g}); sigma: flat -> HalfNormal({scale:g})",
    )


def _cauchy(design: Design) -> tuple[Design, float, ScalePrior, float, str]:
    """kidiq's: beta flat (Normal(0, 1000) stands in), Stan's own cauchy(0, 2.5) on sigma > 0."""
    return (
        design,
        1e3,
        "half-cauchy",
        2.5,
        "beta: flat -> Normal(0, 1000); sigma: Stan's cauchy(0, 2.5) = HalfCauchy(2.5)",
    )


# name: (design, coefficient prior scale, sigma's prior and its scale, the priors stated)
_SPECS: dict[str, tuple[Design, float, ScalePrior, float, str]] = {
    "earnings-earn_height": _flat(Design(_earnings, "earn", ("height",)), 1e6),
    "earnings-log10earn_height": _flat(Design(_earnings, "log10_earn", ("height",))),
    "earnings-logearn_height": _flat(Design(_earnings, "log_earn", ("height",))),
    "earnings-logearn_height_male": _flat(Design(_earnings, "log_earn", ("height", "male"))),
    "earnings-logearn_interaction": _flat(Design(_earnings, "log_earn", ("height", "male", "inter"))),
    "earnings-logearn_logheight_male": _flat(Design(_earnings, "log_earn", ("log_height", "male"))),
    "kidiq-kidscore_interaction": _cauchy(Design(_kidiq, "kid_score", ("mom_hs", "mom_iq", "inter"))),
    "kidiq-kidscore_momhs": _cauchy(Design(_kidiq, "kid_score", ("mom_hs",))),
    "kidiq-kidscore_momhsiq": _cauchy(Design(_kidiq, "kid_score", ("mom_hs", "mom_iq"))),
    "kidiq-kidscore_momiq": _cauchy(Design(_kidiq, "kid_score", ("mom_iq",))),
    "kidiq_with_mom_work-kidscore_interaction_c": _flat(
        Design(_kidiq, "kid_score", ("c_mom_hs", "c_mom_iq", "c_inter"))
    ),
    "kidiq_with_mom_work-kidscore_interaction_c2": _flat(
        Design(_kidiq, "kid_score", ("c2_mom_hs", "c2_mom_iq", "c2_inter"))
    ),
    "kidiq_with_mom_work-kidscore_mom_work": _flat(Design(_kidiq, "kid_score", ("work2", "work3", "work4"))),
    "mesquite-logmesquite": _flat(Design(_mesquite, "log_weight", MESQUITE_ALL)),
    "mesquite-logmesquite_logva": _flat(Design(_mesquite, "log_weight", MESQUITE_LOGVAS[:2] + ("group",))),
    "mesquite-logmesquite_logvas": _flat(Design(_mesquite, "log_weight", MESQUITE_LOGVAS)),
    "mesquite-logmesquite_logvolume": _flat(Design(_mesquite, "log_weight", ("log_canopy_volume",))),
    "mesquite-mesquite": _flat(Design(_mesquite, "weight", MESQUITE_RAW), 1e4),
    **{f"nes{year}-nes": _flat(Design(_nes, "partyid7", NES)) for year in range(1972, 1997, 4)},
    "sblrc-blr": (
        Design(_blr, "y", BLR, intercept=False),
        10.0,
        "half-normal",
        10.0,
        "none flat: Stan's normal(0, 10) on beta, and on sigma > 0 = HalfNormal(10)",
    ),
}


def _port(name: str, design: Design, scale: float, sigma_prior: ScalePrior, sigma_scale: float, priors: str):
    batch = batch_size(NUM_DATA[name.split("-", 1)[0]])
    return Posterior(
        name=name,
        kind="regression",
        model=LinearRegression(scale, sigma_prior, sigma_scale, batch),
        make_args=design,
        stan_names={"beta": vector("beta", design.num_coefficients), "sigma": ("sigma",)},
        priors=priors,
        batch_size=batch,
    )


PORTS = {name: _port(name, *spec) for name, spec in _SPECS.items()}
