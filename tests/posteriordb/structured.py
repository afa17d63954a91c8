r"""The six posteriors of the suite whose likelihood is no sum over exchangeable data: ARMA, GARCH, HMMs, a GP.

None has a data plate, each for its own reason (``Posterior.no_data_plate``); all are full-batch Pyro models that
NUTS and the full-batch engines can be judged on. The observed site is ``obs`` in every one.

* ``arma-arma11``: ARMA(1, 1), :math:`y_t = \mu + \phi y_{t-1} + \theta \epsilon_{t-1} + \epsilon_t`, with Stan's
  start :math:`\nu_1 = \mu + \phi\mu` (:math:`\epsilon_0 = 0`). Stan loops over t; the port uses the loop's closed
  form :math:`\epsilon = L a`, :math:`a_t = y_t - \mu - \phi y_{t-1}`, :math:`L_{ts} = (-\theta)^{t-s}` for
  :math:`s \le t`, and observes :math:`y \sim \mathcal N(y - \epsilon, \sigma)` (the one-step predictions).
* ``garch-garch11``: GARCH(1, 1), :math:`\sigma_t^2 = \alpha_0 + \alpha_1 (y_{t-1} - \mu)^2 + \beta_1
  \sigma_{t-1}^2` from the data's :math:`\sigma_1`, again in closed form. Stan's ``beta1`` has the bound
  ``upper = 1 - alpha1`` and no prior, so (``alpha1``, ``beta1``) is uniform on the triangle
  :math:`\alpha_1 + \beta_1 < 1`. A support that moves with another site is one Pyro's HMC cannot follow, so the port
  samples ``alpha1 ~ Beta(1, 2)`` (the triangle's marginal) and ``beta1_share ~ Uniform(0, 1)``, and
  ``beta1 = (1 - alpha1) * beta1_share``: exactly the same uniform law, and ``beta1`` a derived Stan parameter.
* three HMMs (``hmm_example``, the basketball drives): the observations' law is Stan's forward algorithm
  (:class:`~tests.posteriordb.distributions.StanHMM`), ordered emission parameters (``positive_ordered``,
  ``ordered``) with Stan's Normal priors are :class:`~tests.posteriordb.distributions.OrderedNormal`, and a
  transition row without a prior is ``Dirichlet(1, 1)`` (flat on the simplex).
* ``gp_pois_regr-gp_regr``: a squared-exponential GP, :math:`y \sim \mathcal N(0, K)`, :math:`K_{ij} = \alpha^2
  \exp(-(x_i - x_j)^2 / 2\rho^2) + \sigma \delta_{ij}` (Stan adds ``sigma``, not its square, to the diagonal).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from tests.posteriordb.distributions import OrderedNormal, StanHMM
from tests.posteriordb.entry import Posterior, vector

__all__ = ["PORTS", "arma11", "garch11", "gp_regr", "hmm_drive_exponential", "hmm_drive_normal", "hmm_example"]


def _powers(base: Tensor, size: int) -> Tensor:
    """``[1, base, base², ..., base^(size - 1)]`` (a cumulative product: its gradient is finite at 0)."""
    return torch.cat([base.new_ones(1), torch.cumprod(base.expand(size - 1), 0)])


def _toeplitz(base: Tensor, size: int) -> Tensor:
    """The lower-triangular ``L[t, s] = base^(t - s)``: ``L @ a`` solves ``e[t] = a[t] + base * e[t - 1]``."""
    lags = torch.arange(size)[:, None] - torch.arange(size)
    return torch.where(lags >= 0, _powers(base, size)[lags.clamp(min=0)], base.new_zeros(()))


def arma11(y: Tensor) -> None:
    """Stan's ``arma11``: the errors by the closed form of its recursion."""
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 10.0))
    phi = pyro.sample("phi", dist.Normal(y.new_zeros(()), 2.0))
    theta = pyro.sample("theta", dist.Normal(y.new_zeros(()), 2.0))
    sigma = pyro.sample("sigma", dist.HalfCauchy(y.new_tensor(2.5)))
    previous = torch.cat([mu[None], y[:-1]])  # Stan's nu[1] = mu + phi * mu
    errors = _toeplitz(-theta, len(y)) @ (y - mu - phi * previous)
    pyro.sample("obs", dist.Normal(y - errors, sigma).to_event(1), obs=y)


def garch11(y: Tensor, sigma1: Tensor) -> None:
    """Stan's ``garch11``: the variances by the closed form of its recursion."""
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 1000.0))
    alpha0 = pyro.sample("alpha0", dist.HalfNormal(y.new_tensor(1000.0)))
    alpha1 = pyro.sample("alpha1", dist.Beta(y.new_tensor(1.0), y.new_tensor(2.0)))
    share = pyro.sample("beta1_share", dist.Uniform(y.new_zeros(()), y.new_ones(())))
    beta1 = pyro.deterministic("beta1", (1.0 - alpha1) * share)
    shocks = alpha0 + alpha1 * (y[:-1] - mu) ** 2  # the part of sigma[t]^2 that does not carry over, t = 2..T
    variances = _toeplitz(beta1, len(y) - 1) @ shocks + _powers(beta1, len(y))[1:] * sigma1**2
    sigma = torch.cat([sigma1.reshape(1), variances.sqrt()])
    pyro.sample("obs", dist.Normal(mu, sigma).to_event(1), obs=y)


def _hmm(emission: dist.Distribution, transition: Tensor, values: Tensor) -> None:
    pyro.sample("obs", StanHMM(transition, emission, len(values)), obs=values)


def _transitions(prior: Tensor) -> Tensor:
    theta1 = pyro.sample("theta1", dist.Dirichlet(prior[0]))
    theta2 = pyro.sample("theta2", dist.Dirichlet(prior[1]))
    return torch.stack([theta1, theta2])


def hmm_example(y: Tensor) -> None:
    """Stan's ``hmm_example``: two states, ``y[t] ~ normal(mu[state], 1)``."""
    transition = _transitions(y.new_ones(2, 2))  # no prior in Stan: flat on each simplex
    mu = pyro.sample("mu", OrderedNormal(y.new_tensor([3.0, 10.0]), y.new_ones(2), positive=True))
    _hmm(dist.Normal(mu, 1.0), transition, y)


def hmm_drive_exponential(uv: Tensor, alpha: Tensor) -> None:
    """Stan's ``hmm_drive_0``: ``u ~ exponential(phi[state])``, ``v ~ exponential(lambda[state])``."""
    transition = _transitions(alpha)
    phi = pyro.sample("phi", OrderedNormal(uv.new_tensor([0.0, 3.0]), uv.new_ones(2), positive=True))
    lam = pyro.sample("lambda", OrderedNormal(uv.new_tensor([0.0, 3.0]), uv.new_ones(2), positive=True))
    _hmm(dist.Exponential(torch.stack([phi, lam], -1)).to_event(1), transition, uv)


def hmm_drive_normal(uv: Tensor, alpha: Tensor, tau: Tensor, rho: Tensor) -> None:
    """Stan's ``hmm_drive_1``: ``u ~ normal(phi[state], tau)``, ``v ~ normal(lambda[state], rho)``."""
    transition = _transitions(alpha)
    phi = pyro.sample("phi", OrderedNormal(uv.new_tensor([0.0, 3.0]), uv.new_ones(2)))
    lam = pyro.sample("lambda", OrderedNormal(uv.new_tensor([0.0, 3.0]), uv.new_ones(2)))
    scale = torch.stack([tau, rho])
    _hmm(dist.Normal(torch.stack([phi, lam], -1), scale).to_event(1), transition, uv)


def gp_regr(x: Tensor, y: Tensor) -> None:
    """Stan's ``gp_regr``: a squared-exponential GP with ``sigma`` on the diagonal."""
    rho = pyro.sample("rho", dist.Gamma(x.new_tensor(25.0), x.new_tensor(4.0)))
    alpha = pyro.sample("alpha", dist.HalfNormal(x.new_tensor(2.0)))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
    distances = (x[:, None] - x) ** 2
    covariance = alpha**2 * torch.exp(-0.5 * distances / rho**2) + sigma * torch.eye(len(x), dtype=x.dtype)
    pyro.sample("obs", dist.MultivariateNormal(x.new_zeros(len(x)), covariance_matrix=covariance), obs=y)


def _real(data: Mapping[str, Any], key: str, dtype: torch.dtype) -> Tensor:
    return torch.tensor(data[key], dtype=torch.float64).to(dtype)


def _drive_args(data: Mapping[str, Any], dtype: torch.dtype) -> tuple[Tensor, ...]:
    uv = torch.stack([_real(data, "u", dtype), _real(data, "v", dtype)], -1)
    extra = (_real(data, "tau", dtype), _real(data, "rho", dtype)) if "tau" in data else ()
    return (uv, _real(data, "alpha", dtype), *extra)


SEQUENTIAL = "a sequential likelihood: each term needs the recursion over every earlier observation"
ONE_SEQUENCE = "the forward algorithm over one sequence: its terms are not exchangeable"
DRIVE = (
    "none flat: Stan's own; dirichlet(alpha[k]) on each transition row, normal(0, 1) and normal(3, 1) on phi and lambda"
)
HMM_NAMES = {"theta1": vector("theta1", 2), "theta2": vector("theta2", 2)}

PORTS = {
    "arma-arma11": Posterior(
        name="arma-arma11",
        kind="time-series",
        model=arma11,
        make_args=lambda data, dtype: (_real(data, "y", dtype),),
        stan_names={"mu": ("mu",), "phi": ("phi",), "theta": ("theta",), "sigma": ("sigma",)},
        priors="none flat: Stan's own; cauchy(0, 2.5) on sigma > 0 = HalfCauchy(2.5)",
        no_data_plate=SEQUENTIAL,
    ),
    "garch-garch11": Posterior(
        name="garch-garch11",
        kind="time-series",
        model=garch11,
        make_args=lambda data, dtype: (_real(data, "y", dtype), _real(data, "sigma1", dtype)),
        stan_names={"mu": ("mu",), "alpha0": ("alpha0",), "alpha1": ("alpha1",)},
        derived={"beta1": (("alpha1", "beta1_share"), lambda alpha1, share: (1.0 - alpha1) * share)},
        priors="mu: flat -> Normal(0, 1000); alpha0: flat on (0, inf) -> HalfNormal(1000); (alpha1, beta1): Stan's "
        "flat on alpha1 + beta1 < 1, exactly, as alpha1 ~ Beta(1, 2), beta1 = (1 - alpha1) * Uniform(0, 1)",
        no_data_plate=SEQUENTIAL,
    ),
    "hmm_example-hmm_example": Posterior(
        name="hmm_example-hmm_example",
        kind="hmm",
        model=hmm_example,
        make_args=lambda data, dtype: (_real(data, "y", dtype),),
        stan_names={**HMM_NAMES, "mu": vector("mu", 2)},
        priors="none substituted: theta1, theta2 flat on the simplex = Dirichlet(1, 1) exactly; Stan's normal(3, 1) "
        "and normal(10, 1) on the positive ordered mu",
        no_data_plate=ONE_SEQUENCE,
    ),
    "bball_drive_event_0-hmm_drive_0": Posterior(
        name="bball_drive_event_0-hmm_drive_0",
        kind="hmm",
        model=hmm_drive_exponential,
        make_args=_drive_args,
        stan_names={**HMM_NAMES, "phi": vector("phi", 2), "lambda": vector("lambda", 2)},
        priors=DRIVE,
        no_data_plate=ONE_SEQUENCE,
    ),
    "bball_drive_event_1-hmm_drive_1": Posterior(
        name="bball_drive_event_1-hmm_drive_1",
        kind="hmm",
        model=hmm_drive_normal,
        make_args=_drive_args,
        stan_names={**HMM_NAMES, "phi": vector("phi", 2), "lambda": vector("lambda", 2)},
        priors=DRIVE,
        no_data_plate=ONE_SEQUENCE,
    ),
    "gp_pois_regr-gp_regr": Posterior(
        name="gp_pois_regr-gp_regr",
        kind="gp",
        model=gp_regr,
        make_args=lambda data, dtype: (_real(data, "x", dtype), _real(data, "y", dtype)),
        stan_names={"rho": ("rho",), "alpha": ("alpha",), "sigma": ("sigma",)},
        priors="none flat: Stan's own; gamma(25, 4) on rho, normal(0, 2) on alpha > 0 = HalfNormal(2), normal(0, 1) on "
        "sigma > 0 = HalfNormal(1)",
        no_data_plate="one multivariate Normal over all 11 points: no sum over data points",
    ),
}
