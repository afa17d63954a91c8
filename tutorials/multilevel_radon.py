# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # A multilevel model of radon-like data, checked against NUTS
#
# Homes in counties, a level per county, shared parameters above them: the shape of the Minnesota radon survey, with
# county sizes as skewed as the real ones (1 to about 120 homes). `MultilevelMCMC` samples the model as it is written
# (centred), at its defaults; ArviZ diagnoses the chains; Pyro's NUTS on the same posterior is the reference, and the
# two are compared county by county, with the time each took.

# %% [markdown] tags=["remove-cell"]
# Set `PYRO_SCALABLE_FAST=1` for the quick run CI does (fewer counties, fewer draws). Cells tagged `remove-cell` (this
# switch, the plotting backend and the warnings' format, the figure files, the tutorial's own checks) run but are left
# out of the documentation page.

# %% tags=["remove-cell"]
import os
import warnings

import matplotlib

matplotlib.use("Agg")  # the figures are files (docs/images), attached to the page by scripts/render_tutorials.py
warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing", category=FutureWarning)


def _warning_as_read(message, category, filename, lineno, line=None):
    return f"{category.__name__}: {message}\n"  # the category and message, not the kernel's temporary file name


warnings.formatwarning = _warning_as_read

# %%
import time

import arviz as az
import matplotlib.pyplot as plt
import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.infer import MultilevelMCMC

COUNTIES = 85
DRAWS = 1_000  # MultilevelMCMC's defaults: 1,000 warm-up sweeps and 1,000 draws per chain, 4 chains
NUTS_DRAWS, NUTS_CHAINS = 1_000, 2

# %% tags=["remove-cell"]
FAST = os.environ.get("PYRO_SCALABLE_FAST") == "1"
IMAGES = os.environ.get("PYRO_SCALABLE_IMAGES", "docs/images")
os.makedirs(IMAGES, exist_ok=True)
if FAST:  # the quick run CI does: 20 counties, 200 draws
    COUNTIES, DRAWS, NUTS_DRAWS = 20, 200, 200

# %%
torch.set_num_threads(1)  # a small model: one thread is fastest, and a second only contends with other work


def radon_like(num_counties, seed=0):
    """Homes in counties whose sizes are as skewed as Minnesota's radon survey (1 to about 120 homes)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (torch.exp(1.5 + 1.1 * torch.randn(num_counties, generator=gen))).ceil().clamp(1, 120).long()
    county = torch.repeat_interleave(torch.arange(num_counties), sizes)
    floor = (torch.rand(len(county), generator=gen) < 0.2).float()  # measured in the basement (0) or above (1)
    level = 1.3 + 0.35 * torch.randn(num_counties, generator=gen)
    log_radon = level[county] - 0.6 * floor + 0.75 * torch.randn(len(county), generator=gen)
    return county, floor, log_radon


county, floor, log_radon = radon_like(COUNTIES)
sizes = torch.bincount(county, minlength=COUNTIES)
print(
    f"{len(county)} homes in {COUNTIES} counties; homes per county: median {int(sizes.median())}, "
    f"from {int(sizes.min())} to {int(sizes.max())}"
)

# %% [markdown]
# ## The model, as a user writes it
# A **group plate** (`counties`, not subsampled) holds each county's level; the **data plate** (`homes`, with a
# `subsample_size`) holds the rows, each reading its county through `level[county[idx]]`. `MultilevelMCMC` reads from
# the model which rows belong to which county; NUTS needs the plate without subsampling (`subsample_size=None`).


# %%
def model(county, floor, log_radon, num_counties, subsample_size=100):
    """Log radon of each home: its county's level, lower by ``beta`` above the basement."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    beta = pyro.sample("beta", dist.Normal(0.0, 2.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("counties", num_counties):
        level = pyro.sample("level", dist.Normal(mu, tau))
    with pyro.plate("homes", len(log_radon), subsample_size=subsample_size) as idx:
        pyro.sample("obs", dist.Normal(level[county[idx]] + beta * floor[idx], sigma), obs=log_radon[idx])


# %% [markdown]
# ## `MultilevelMCMC` at its defaults
# Each sweep moves every county's level by one MALA step on that county's homes alone, then the shared parameters
# by a short HMC trajectory with every county carried along its conditional centre and spread (docs/multilevel.md).
# Both moves are Metropolis-Hastings: the draws are exact MCMC draws, and the usual diagnostics apply.

# %%
start = time.perf_counter()
mcmc = MultilevelMCMC(model, num_samples=DRAWS, num_warmup=DRAWS, seed=0, progress_bar=False)
mcmc.run(county, floor, log_radon, COUNTIES)
ours_seconds = time.perf_counter() - start
idata = mcmc.to_inference_data()
summary = az.summary(idata, var_names=["mu", "tau", "beta", "sigma"])
print(summary)
levels = az.summary(idata, var_names=["level"])
print(
    f"the {COUNTIES} county levels: r_hat at most {levels['r_hat'].max():.3f}, "
    f"bulk ESS at least {levels['ess_bulk'].min():.0f} of {4 * DRAWS} draws; {ours_seconds:.0f} s"
)

# %%
# ArviZ 0.x draws traces and densities with plot_trace, ArviZ 1.x with plot_trace_dist
getattr(az, "plot_trace_dist", az.plot_trace)(idata, var_names=["mu", "tau", "beta", "sigma"])
plt.tight_layout()

# %% tags=["remove-cell"]
plt.savefig(os.path.join(IMAGES, "multilevel_trace.png"), dpi=72)
plt.close("all")
R_HAT = 1.05 if FAST else 1.02  # 200 draws per chain leave r_hat a few hundredths of noise
assert summary["r_hat"].max() < R_HAT and levels["r_hat"].max() < R_HAT, (summary, levels)
assert summary["ess_bulk"].min() > 100 and levels["ess_bulk"].min() > 100, (summary, levels)

# %% [markdown]
# ## The reference: NUTS on the full data
# Pyro's NUTS on the same posterior. NUTS meets the centred model's funnel (a county with one home, given the
# scale `tau`) with a step size small enough for its neck; the usual remedy is to write the model non-centred, which
# Pyro's `LocScaleReparam` does without rewriting it: the same posterior, the levels drawn as `mu + tau * z`. (Here
# `MultilevelMCMC` needed no such rewrite: it carries each county along its own conditional.)

# %%
from pyro.infer import MCMC, NUTS
from pyro.infer.reparam import LocScaleReparam


def full_data(county, floor, log_radon, num_counties):
    model(county, floor, log_radon, num_counties, subsample_size=None)


non_centred = pyro.poutine.reparam(full_data, config={"level": LocScaleReparam(centered=0.0)})
start = time.perf_counter()
chains = []
for chain in range(NUTS_CHAINS):  # in sequence, one process (Pyro runs parallel chains in subprocesses)
    pyro.set_rng_seed(chain)
    nuts = MCMC(
        NUTS(non_centred, jit_compile=True, ignore_jit_warnings=True),
        num_samples=NUTS_DRAWS,
        warmup_steps=NUTS_DRAWS,
        disable_progbar=True,
    )
    nuts.run(county, floor, log_radon, COUNTIES)
    chains.append(nuts.get_samples())
nuts_seconds = time.perf_counter() - start
reference = {name: torch.stack([c[name] for c in chains]) for name in chains[0]}  # (chains, draws, ...)
# the reparametrised model's latents are the standardised levels z: level = mu + tau * z
reference["level"] = reference["mu"][..., None] + reference["tau"][..., None] * reference["level_decentered"]
print(
    f"NUTS: {NUTS_CHAINS} chains x ({NUTS_DRAWS} + {NUTS_DRAWS}) in {nuts_seconds:.0f} s; "
    f"MultilevelMCMC: 4 chains x ({DRAWS} + {DRAWS}) in {ours_seconds:.0f} s"
)

# %% [markdown]
# ## County by county
# Each county's posterior mean and sd from both samplers. The differences are judged against the Monte-Carlo error
# of both (a mean is known to sd/√ESS), with ArviZ's bulk ESS for each: four standard errors.

# %%
from pyro.ops.stats import effective_sample_size

ours = mcmc.get_samples(group_by_chain=True)["level"]
theirs = reference["level"]
mean_ours, mean_theirs = ours.mean((0, 1)), theirs.mean((0, 1))
sd_ours, sd_theirs = ours.std((0, 1)), theirs.std((0, 1))
ess_ours, ess_theirs = effective_sample_size(ours.double()), effective_sample_size(theirs.double())
standard_error = (sd_ours**2 / ess_ours + sd_theirs**2 / ess_theirs).sqrt()
z = (mean_ours - mean_theirs) / standard_error
print(
    f"county means: largest difference {(mean_ours - mean_theirs).abs().max():.3f} "
    f"({(mean_ours - mean_theirs).abs().max() / sd_theirs.mean():.2f} posterior sd), largest |z| {z.abs().max():.1f}"
)
print(f"county sds: ratio ours / NUTS from {(sd_ours / sd_theirs).min():.2f} to {(sd_ours / sd_theirs).max():.2f}")

fig, axes = plt.subplots(1, 2, figsize=(10, 4))
axes[0].errorbar(mean_theirs, mean_ours, xerr=sd_theirs, fmt="o", ms=3, alpha=0.5)
low, high = float(mean_theirs.min()) - 0.5, float(mean_theirs.max()) + 0.5
axes[0].plot([low, high], [low, high], "k--", lw=1)
axes[0].set(xlabel="NUTS: posterior mean (± sd)", ylabel="MultilevelMCMC: posterior mean", title="county levels")
axes[1].scatter(sizes, sd_ours / sd_theirs, s=10)
axes[1].axhline(1.0, color="k", ls="--", lw=1)
axes[1].set(xscale="log", xlabel="homes in the county", ylabel="sd ratio: ours / NUTS", title="county sds")
plt.tight_layout()

# %% tags=["remove-cell"]
plt.savefig(os.path.join(IMAGES, "multilevel_counties.png"), dpi=72)
plt.close("all")
assert z.abs().max() < 4.5, z
for name in ("mu", "tau", "beta", "sigma"):
    a, b = mcmc.get_samples(group_by_chain=True)[name].double(), reference[name].double()
    ess_a, ess_b = effective_sample_size(a), effective_sample_size(b)
    # an sd read from ESS draws is off by about 1/sqrt(2 ESS) of itself: five of both runs' errors
    sd_error = float((1 / (2 * ess_a) + 1 / (2 * ess_b)).sqrt())
    assert abs(a.mean() - b.mean()) < 0.25 * b.std(), name
    assert abs(a.std() / b.std() - 1) < 5 * sd_error, (name, float(a.std() / b.std()), sd_error)

# %% [markdown]
# ## What to read from it
# - The chains mixed (r_hat ≤ 1.01 at the full run's lengths, a bulk ESS in the thousands), on the model as written,
#   with no step size or reparametrisation chosen by hand, and the county levels agree with NUTS's within Monte-Carlo
#   error, from the counties with one home to those with a hundred.
# - On a model this small NUTS is a fine choice; `MultilevelMCMC` is for the same shape at scale: thousands of groups
#   and millions of rows, where each sweep's cost is one pass per kind of move and no trajectory has to resolve the
#   narrowest group ([benchmarks](../benchmarks.md#multilevel-models)).
