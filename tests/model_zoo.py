"""The zoo: the Pyro models users write, with their data, shared by the zoo's tests, reference and benchmark.

Float32 or float64 data; constrained scales (HalfNormal, Gamma, LogNormal), simplex and correlation-matrix sites;
Normal, StudentT, Bernoulli, Poisson and Categorical likelihoods; centred and non-centred hierarchies (a few
groups, a 300-group varying intercept, a firm panel with varying slopes, a 100-cluster mixed logit); a
``PyroModule`` network; both plate styles; nested plates. ``tests/test_model_zoo.py`` runs every engine on each;
``tests/test_zoo_accuracy.py`` checks the default kernels' draws against ``tests/zoo_reference.json`` (written by
``scripts/zoo_reference.py``); ``python -m benchmarks zoo-seeds`` does so over many seeds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample

__all__ = ["B", "D", "G", "HIERARCHIES", "N", "ZOO", "accuracy", "data", "loader_style", "reference", "zoo_model"]

N, B, D, G = 120, 12, 3, 4
MANY_GROUPS, MANY_BATCH = 300, 100  # the varying-intercept models: 300 groups, 1,500 rows
FIRMS, YEARS, PANEL_BATCH = 10, 20, 20  # the partial-pooling panel (Grunfeld's shape): 10 firms x 20 years
CLUSTERS, CLUSTER_ROWS, LOGIT_BATCH = 100, 20, 100  # the mixed logit: 100 clusters x 20 rows


def data(dtype, likelihood="normal"):
    """The zoo's data: drawn in float32 whatever ``dtype`` (torch draws other numbers in float64), then cast."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    f = x @ torch.tensor([1.0, -0.5, 0.25])
    group = torch.arange(N) % G
    if likelihood == "bernoulli":
        y = torch.bernoulli(torch.sigmoid(f), generator=g)
    elif likelihood == "poisson":
        y = torch.poisson(f.exp(), generator=g)
    elif likelihood == "categorical":
        y = (f > 0).to(torch.long) + (f > 1).to(torch.long)
    else:
        y = f + 0.5 * torch.randn(N, generator=g)
    return x.to(dtype), (y if likelihood == "categorical" else y.to(dtype)), group


def many_groups_data(dtype):
    """A radon-like panel: 300 groups of 1 to 9 rows (1,500 in all), one covariate, a group intercept each."""
    g = torch.Generator().manual_seed(1)
    sizes = 1 + (torch.arange(MANY_GROUPS) * 7919) % 9  # 1..9 rows per group, mean 5
    group = torch.repeat_interleave(torch.arange(MANY_GROUPS), sizes)
    x = torch.randn(len(group), generator=g)
    intercept = 1.0 + 0.5 * torch.randn(MANY_GROUPS, generator=g)
    y = intercept[group] - 0.7 * x + 0.8 * torch.randn(len(group), generator=g)
    return x.to(dtype), y.to(dtype), group


def panel_data(dtype):
    """A firm panel shaped like Grunfeld's: 10 firms x 20 years, a firm intercept and slope each (200 rows)."""
    g = torch.Generator().manual_seed(2)
    firm = torch.arange(FIRMS).repeat_interleave(YEARS)
    x = torch.randn(FIRMS * YEARS, generator=g)
    intercept = 1.0 + 0.7 * torch.randn(FIRMS, generator=g)
    slope = 0.5 + 0.3 * torch.randn(FIRMS, generator=g)
    y = intercept[firm] + slope[firm] * x + 0.5 * torch.randn(FIRMS * YEARS, generator=g)
    return x.to(dtype), y.to(dtype), firm


def mixed_logit_data(dtype):
    """Survey-like binary outcomes: 100 clusters x 20 rows, two covariates, a cluster intercept each (2,000 rows)."""
    g = torch.Generator().manual_seed(3)
    cluster = torch.arange(CLUSTERS).repeat_interleave(CLUSTER_ROWS)
    x = torch.randn(CLUSTERS * CLUSTER_ROWS, 2, generator=g)
    intercept = -0.5 + torch.randn(CLUSTERS, generator=g)
    y = torch.bernoulli(torch.sigmoid(intercept[cluster] + x @ torch.tensor([1.0, -0.5])), generator=g)
    return x.to(dtype), y.to(dtype), cluster


def linear_halfnormal_scale(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, sigma), obs=y[idx])


def linear_gamma_precision(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    precision = pyro.sample("precision", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, precision.rsqrt()), obs=y[idx])


def student_t_lognormal_scale(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.StudentT(4.0, x[idx] @ w, scale), obs=y[idx])


def logistic(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 5.0))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w + b), obs=y[idx])


def poisson(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 0.5).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Poisson((x[idx] @ w).exp()), obs=y[idx])


def categorical(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D, 3), 1.0).to_event(2))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Categorical(logits=x[idx] @ w), obs=y[idx])


def hierarchical_non_centred(x, y, group):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    raw = pyro.sample("raw", dist.Normal(x.new_zeros(G), 1.0).to_event(1))
    effect = mu + tau * raw
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(effect[group[idx]], sigma), obs=y[idx])


def hierarchical_centred(x, y, group):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    effect = pyro.sample("effect", dist.Normal(mu, tau).expand([G]).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(effect[group[idx]], 1.0), obs=y[idx])


def mixture_simplex(x, y, group):
    weights = pyro.sample("weights", dist.Dirichlet(x.new_ones(2)))
    locs = pyro.sample("locs", dist.Normal(x.new_tensor([-1.0, 1.0]), 1.0).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        mixture = dist.MixtureSameFamily(dist.Categorical(weights), dist.Normal(locs, 1.0))
        pyro.sample("obs", mixture, obs=y[idx])


def correlated_normal(x, y, group):
    corr = pyro.sample("corr", dist.LKJCholesky(D, x.new_tensor(2.0)))
    scales = pyro.sample("scales", dist.HalfNormal(x.new_ones(D)).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.MultivariateNormal(x.new_zeros(D), scale_tril=scales[..., None] * corr), obs=x[idx])


class _Net(PyroModule):
    def __init__(self, dtype):
        super().__init__()
        self.hidden = PyroModule[torch.nn.Linear](D, 8).to(dtype)
        self.hidden.weight = PyroSample(dist.Normal(torch.zeros(8, D, dtype=dtype), 1.0).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(torch.zeros(8, dtype=dtype), 1.0).to_event(1))
        self.out = PyroModule[torch.nn.Linear](8, 1).to(dtype)
        self.out.weight = PyroSample(dist.Normal(torch.zeros(1, 8, dtype=dtype), 1.0).to_event(2))
        self.out.bias = PyroSample(dist.Normal(torch.zeros(1, dtype=dtype), 1.0).to_event(1))

    def forward(self, x, y, group):
        data = pyro.plate("data", N, subsample_size=B)
        f = self.out(torch.tanh(self.hidden(x[data.indices]))).squeeze(-1)  # the net runs outside the plate
        with data as idx:
            pyro.sample("obs", dist.Normal(f, 0.5), obs=y[idx])


def loader_style(x, y, idx=None):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", N, subsample=idx):
        pyro.sample("obs", dist.Normal(x @ w, sigma), obs=y)


def nested_plates(x, y, group):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(D, 1), 1.0).to_event(2))
    with pyro.plate("features", D, dim=-2), pyro.plate("data", N, subsample_size=B, dim=-1) as idx:
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=x[idx].T)


def varying_intercept_centred(x, y, group):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("groups", MANY_GROUPS):
        intercept = pyro.sample("intercept", dist.Normal(mu, tau))
    beta = pyro.sample("beta", dist.Normal(x.new_zeros(()), 1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("data", len(y), subsample_size=MANY_BATCH) as idx:
        pyro.sample("obs", dist.Normal(intercept[group[idx]] + beta * x[idx], sigma), obs=y[idx])


def varying_intercept_non_centred(x, y, group):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("groups", MANY_GROUPS):
        raw = pyro.sample("raw", dist.Normal(x.new_zeros(()), 1.0))
    beta = pyro.sample("beta", dist.Normal(x.new_zeros(()), 1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("data", len(y), subsample_size=MANY_BATCH) as idx:
        pyro.sample("obs", dist.Normal(mu + tau * raw[group[idx]] + beta * x[idx], sigma), obs=y[idx])


def panel_centred(x, y, firm):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(2), 5.0).to_event(1))  # mean intercept and slope
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(2)).to_event(1))
    with pyro.plate("firms", FIRMS):
        intercept = pyro.sample("intercept", dist.Normal(mu[0], tau[0]))
        slope = pyro.sample("slope", dist.Normal(mu[1], tau[1]))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("data", len(y), subsample_size=PANEL_BATCH) as idx:
        f = firm[idx]
        pyro.sample("obs", dist.Normal(intercept[f] + slope[f] * x[idx], sigma), obs=y[idx])


def panel_non_centred(x, y, firm):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(2), 5.0).to_event(1))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(2)).to_event(1))
    with pyro.plate("firms", FIRMS):
        raw_intercept = pyro.sample("raw_intercept", dist.Normal(x.new_zeros(()), 1.0))
        raw_slope = pyro.sample("raw_slope", dist.Normal(x.new_zeros(()), 1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("data", len(y), subsample_size=PANEL_BATCH) as idx:
        f = firm[idx]
        intercept, slope = mu[0] + tau[0] * raw_intercept[f], mu[1] + tau[1] * raw_slope[f]
        pyro.sample("obs", dist.Normal(intercept + slope * x[idx], sigma), obs=y[idx])


def mixed_logit_centred(x, y, cluster):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("clusters", CLUSTERS):
        intercept = pyro.sample("intercept", dist.Normal(mu, tau))
    beta = pyro.sample("beta", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(y), subsample_size=LOGIT_BATCH) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=intercept[cluster[idx]] + x[idx] @ beta), obs=y[idx])


def mixed_logit_non_centred(x, y, cluster):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("clusters", CLUSTERS):
        raw = pyro.sample("raw", dist.Normal(x.new_zeros(()), 1.0))
    beta = pyro.sample("beta", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(y), subsample_size=LOGIT_BATCH) as idx:
        logits = mu + tau * raw[cluster[idx]] + x[idx] @ beta
        pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y[idx])


ZOO = {
    "linear-halfnormal-scale": (linear_halfnormal_scale, "normal"),
    "linear-gamma-precision": (linear_gamma_precision, "normal"),
    "student-t-lognormal-scale": (student_t_lognormal_scale, "normal"),
    "logistic": (logistic, "bernoulli"),
    "poisson": (poisson, "poisson"),
    "categorical": (categorical, "categorical"),
    "hierarchical-non-centred": (hierarchical_non_centred, "normal"),
    "hierarchical-centred": (hierarchical_centred, "normal"),
    "mixture-simplex": (mixture_simplex, "normal"),
    "correlated-normal-lkj": (correlated_normal, "normal"),
    "pyromodule-net": (None, "normal"),
    "dataloader-plate": (loader_style, "normal"),
    "nested-plates": (nested_plates, "normal"),
    "varying-intercept-centred": (varying_intercept_centred, "many-groups"),
    "varying-intercept-non-centred": (varying_intercept_non_centred, "many-groups"),
    "panel-centred": (panel_centred, "panel"),
    "panel-non-centred": (panel_non_centred, "panel"),
    "mixed-logit-centred": (mixed_logit_centred, "mixed-logit"),
    "mixed-logit-non-centred": (mixed_logit_non_centred, "mixed-logit"),
}
HIERARCHIES = (
    "hierarchical-non-centred",
    "hierarchical-centred",
    "varying-intercept-centred",
    "varying-intercept-non-centred",
    "panel-centred",
    "panel-non-centred",
    "mixed-logit-centred",
    "mixed-logit-non-centred",
)
DATASETS = {"many-groups": many_groups_data, "panel": panel_data, "mixed-logit": mixed_logit_data}


def zoo_model(name: str, dtype: torch.dtype = torch.float32):
    """The zoo's model ``name`` and its arguments (a ``PyroModule`` is built afresh; the loader's model: ``(x, y)``)."""
    model, likelihood = ZOO[name]
    x, y, group = DATASETS[likelihood](dtype) if likelihood in DATASETS else data(dtype, likelihood)
    if model is None:
        model = _Net(dtype)
    return model, ((x, y) if model is loader_style else (x, y, group))


# ----------------------------------------------------------------------------------- accuracy against a reference

REFERENCE = Path(__file__).with_name("zoo_reference.json")
MEAN_TOLERANCE = 0.2  # |mean - reference mean| in reference sds
SD_BIAS = 0.05  # the stationary-variance bias warm-up's step bounds allow (docs/sgmcmc.md: at most about 5%)
R_HAT_LIMIT = 1.01


def reference() -> dict:
    """The reference posteriors ``scripts/zoo_reference.py`` wrote."""
    return json.loads(REFERENCE.read_text())


def accuracy(samples: dict[str, torch.Tensor], entry: dict) -> dict[str, float]:
    """The draws (``group_by_chain=True``) against a model's reference ``entry``: the worst element of every site.

    Returns the largest ``|mean error| / reference sd``, the largest ``|sd / reference sd - 1|`` and its tolerance
    (:data:`SD_BIAS` plus three Monte-Carlo standard errors of the ratio), the largest rank-normalised r_hat and the
    least bulk ESS (ArviZ's, as ``az.summary`` shows them), and ``passed``.

    The sd's Monte-Carlo error follows from the delta method: a variance estimated from ``ESS`` effective draws of
    the centred squares has relative variance ``(kappa - 1) / ESS`` for a marginal of kurtosis ``kappa``, so the
    ratio's relative error is ``sqrt(r + (kappa_ref - 1) / (4 ESS_ref))``. For the draws judged, ``r`` is ArviZ's
    ``mcse(method="sd")`` over their sd, squared: it reads the squares' ESS and the draws' own kurtosis. Both
    matter: a sampler whose moves are antithetic for the mean (HMC's, MALA's: a bulk ESS above the number of
    draws) need not be for the squares, so the bulk ESS would overstate what the sd rests on; and a heavy-tailed
    scale (the eight schools' ``tau``, kurtosis near 9) has twice a Gaussian's sd error. The reference's term takes
    its ``kurtosis`` where the entry gives one (else a Gaussian's 3) and its ESS (a closed form's: exact).
    """
    import arviz as az

    worst = {"mean_error": 0.0, "sd_error": 0.0, "sd_excess": -math.inf, "r_hat": 0.0, "ess": math.inf}
    for site, summary in entry["sites"].items():
        draws = samples[site].detach().double()
        flat = draws.reshape(draws.shape[0], draws.shape[1], -1)
        ref_mean = torch.tensor(summary["mean"], dtype=flat.dtype)
        ref_sd = torch.tensor(summary["sd"], dtype=flat.dtype)
        varying = ref_sd > 1e-9  # a correlation matrix's diagonal is constant
        flat, ref_mean, ref_sd = flat[..., varying], ref_mean[varying], ref_sd[varying]
        ref_ess = entry.get("diagnostics", {}).get(site, {}).get("ess", math.inf)  # a closed form's: exact
        kurtosis = torch.tensor(summary.get("kurtosis", [3.0] * len(summary["sd"])), dtype=flat.dtype)[varying]
        array = flat.numpy()
        elements = range(array.shape[-1])
        ess = torch.tensor([float(az.ess(array[..., k], method="bulk")) for k in elements])
        r_hat = torch.tensor([float(az.rhat(array[..., k])) for k in elements])
        mcse_sd = torch.tensor([float(az.mcse(array[..., k], method="sd")) for k in elements], dtype=flat.dtype)
        mean_error = ((flat.mean((0, 1)) - ref_mean).abs() / ref_sd).max()
        sd = flat.reshape(-1, flat.shape[-1]).std(0)
        sd_error = (sd / ref_sd - 1.0).abs()
        variance = (mcse_sd / sd) ** 2 + (kurtosis - 1.0) / (4.0 * ref_ess)  # the ratio's relative variance
        tolerance = SD_BIAS + 3.0 * variance.sqrt()
        worst["mean_error"] = max(worst["mean_error"], float(mean_error))
        worst["sd_error"] = max(worst["sd_error"], float(sd_error.max()))
        worst["sd_excess"] = max(worst["sd_excess"], float((sd_error - tolerance).max()))
        worst["r_hat"] = max(worst["r_hat"], float(r_hat.max()))
        worst["ess"] = min(worst["ess"], float(ess.min()))
    worst["passed"] = (
        worst["mean_error"] <= MEAN_TOLERANCE and worst["sd_excess"] <= 0.0 and worst["r_hat"] <= R_HAT_LIMIT
    )
    return worst
