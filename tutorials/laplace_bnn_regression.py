# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Linearised Laplace for a Bayesian neural network
#
# A PyroModule MLP with Normal priors on its weights, trained to its MAP with `SVI` from minibatches, then turned
# into a Gaussian posterior by `AutoLinearizedLaplace`: the GGN curvature in Kronecker-factored (K-FAC) form, a
# prior precision and a noise scale tuned on the Laplace evidence, and predictive bands from the linearised model
# next to those of the network with sampled weights. Then the other curvature structures on the same MAP.

# %% [markdown] tags=["remove-cell"]
# Set `PYRO_SCALABLE_FAST=1` for the quick run CI does (fewer training steps, no MAP check). Cells tagged `remove-cell`
# (this switch, the plotting backend and the warnings' format, the figure file, the tutorial's own checks) run but are
# left out of the documentation page.

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
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_scalable import FullDataModel
from pyro_scalable.infer import AutoLinearizedLaplace

STEPS = 1_500  # SVI steps of the MAP search
CHECK_MAP = True  # the Laplace fit checks that the gradient at the MAP is small
NUM_SAMPLES = 400  # draws of the sampled predictives

# %% tags=["remove-cell"]
FAST = os.environ.get("PYRO_SCALABLE_FAST") == "1"
IMAGES = os.environ.get("PYRO_SCALABLE_IMAGES", "docs/images")
if FAST:  # the quick run CI does
    STEPS, CHECK_MAP, NUM_SAMPLES = 300, False, 100

# %%
torch.set_num_threads(1)  # tensors this small run fastest on one thread (and much slower on a busy machine with more)
start = time.perf_counter()

# %% [markdown]
# ## Data: a sine with a gap
# N = 200 noisy points of sin(3x), none between -0.4 and 0.4; the predictive grid runs well past both ends. A
# well-calibrated posterior is sure where the data are and unsure in the gap and beyond them.

# %%
torch.manual_seed(0)
N, NOISE = 200, 0.15
x = torch.cat([torch.empty(N // 2).uniform_(-1.5, -0.4), torch.empty(N // 2).uniform_(0.4, 1.5)]).unsqueeze(-1)
y = torch.sin(3 * x.squeeze(-1)) + NOISE * torch.randn(N)
grid = torch.linspace(-3, 3, 241).unsqueeze(-1)

# %% [markdown]
# ## The model
# `PyroSample` puts a Normal(0, 1) prior on every weight and bias of a 1 → 50 → 50 → 1 tanh network (2,701
# parameters); the noise scale σ is a latent site too. The likelihood sits in a subsampled plate, so `SVI`
# sees minibatches scaled by N/B. `pyro.deterministic("f", ...)` records the network's output for the
# sampled-weights predictive below; it is not an observed site.


# %%
class BNN(PyroModule):
    def __init__(self, widths=(1, 50, 50, 1)):
        super().__init__()
        layers = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layer = PyroModule[nn.Linear](fan_in, fan_out)
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out, fan_in]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out]).to_event(1))
            layers.append(layer)
        self.layers = PyroModule[nn.ModuleList](layers)

    def forward(self, x, y=None, batch_size=50):
        h = x
        for layer in self.layers[:-1]:
            h = torch.tanh(layer(h))
        f = pyro.deterministic("f", self.layers[-1](h).squeeze(-1))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            return pyro.sample("y", dist.Normal(f[idx], sigma), obs=None if y is None else y[idx])


# %% [markdown]
# ## The MAP
# `AutoLinearizedLaplace` trains exactly like Pyro's `AutoLaplaceApproximation`: a point mass fitted by `SVI`.
# Laplace needs a *precise* maximum, though, for the curvature is taken there: minibatch Adam gets close, and its
# gradient noise then keeps it from settling in the flat directions of an over-parametrised network. So: Adam on
# minibatches first, then full-batch steps (`batch_size=None`; N is small here), ending at a lower learning rate.
# `laplace_approximation` warns when the result is still not a maximum (by the Newton decrement ½ bᵀH⁻¹b in nats,
# b the gradient of the log joint).

# %%
pyro.clear_param_store()
pyro.set_rng_seed(0)
model = BNN()
guide = AutoLinearizedLaplace(model)


def train(steps, lr, batch_size):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    for _ in range(steps):
        loss = svi.step(x, y, batch_size=batch_size)
    return loss


train(STEPS, 1e-2, batch_size=50)
train(2 * STEPS, 1e-2, batch_size=None)
loss = train(STEPS // 4, 1e-3, batch_size=None)
print(f"final loss {loss:.1f}  ({time.perf_counter() - start:.0f} s so far)")

# %% [markdown]
# ## Laplace with K-FAC curvature
# One pass over the full data at the MAP builds the posterior precision H = G + P: G = Σᵢ JᵢᵀΛᵢJᵢ, the GGN, in
# Kronecker-factored form (one block per linear layer, its bias folded in), and P the prior precision read from
# the model's priors. σ is not a network parameter: it is held at its MAP value, and the evidence can fit it.

# %%
posterior = guide.laplace_approximation(x, y, structure="kron", check_map=CHECK_MAP)
print("Laplace sites:", posterior.sites, f"({posterior.num_params} parameters)")
evidence_before = posterior.log_marginal_likelihood().item()
sigma_map = posterior.observation_noise.item()

# %% [markdown]
# ## Tuning the prior precision and σ on the evidence
# `optimize_prior_precision` maximises the Laplace log evidence over one prior precision for every weight (or one
# per site, `"site"`) and over σ, by L-BFGS. No retraining: the evidence is the linearised model's at any prior
# precision and σ (a ½ bᵀH⁻¹b term accounts for the MAP moving), and the posterior mean moves from θ* to
# θ* + H⁻¹b, the MAP of the linearised model under the new prior.

# %%
posterior.optimize_prior_precision("scalar")
evidence_after = posterior.log_marginal_likelihood().item()
print(f"log evidence: {evidence_before:.1f} at the model's prior (precision 1, σ = {sigma_map:.3f})")
print(
    f"              {evidence_after:.1f} at precision {posterior.prior_precision[0].item():.3g}, "
    f"σ = {posterior.observation_noise.item():.3f}   (data simulated with σ = {NOISE})"
)

# %% tags=["remove-cell"]
assert evidence_after >= evidence_before - 1e-3
assert abs(posterior.observation_noise.item() - NOISE) < 0.05

# %% [markdown]
# ## The linearised predictive
# f(x) ~ N(f(x, θ̄), J(x) H⁻¹ J(x)ᵀ) in closed form, with no Jacobian over all weights formed. `pred.covariance`
# is the variance of f, the band of the mean function; the band of y adds σ², the fitted noise.

# %%
pred = posterior.predict(grid)
mean = pred.mean.squeeze(-1)
f_std = pred.covariance[:, 0, 0].sqrt()
y_std = pred.distribution.stddev  # the law of y: σ², the evidence-fitted noise, added to the variance of f

g = grid.squeeze(-1)
inside = (g.abs() > 0.5) & (g.abs() < 1.4)
gap = g.abs() < 0.2
outside = g.abs() > 2.5
print(
    f"sd of f: {f_std[inside].mean():.3f} near the data, {f_std[gap].mean():.3f} in the gap, "
    f"{f_std[outside].mean():.3f} beyond ±2.5;  sd of y near the data: {y_std[inside].mean():.3f}"
)

# %% tags=["remove-cell"]
assert torch.allclose(y_std, (f_std**2 + posterior.observation_noise**2).sqrt())
assert f_std[gap].mean() > 2 * f_std[inside].mean() and f_std[outside].mean() > 2 * f_std[inside].mean()

# %% [markdown]
# The same predictive by sampling, through Pyro: `posterior.linearized_model` is the model with f(x, θ) replaced
# by f(x, θ*) + J(x)(θ − θ*), and `posterior` is a Pyro guide. Its draws of y agree with the closed form
# `pred.distribution` up to Monte Carlo error.

# %%
num_samples = NUM_SAMPLES
lin_draws = Predictive(posterior.linearized_model, guide=posterior, num_samples=num_samples)(grid)["y"]
z = (lin_draws.mean(0) - pred.distribution.loc) / (pred.distribution.scale / num_samples**0.5)
ratio = lin_draws.std(0) / pred.distribution.scale
print(f"linearised draws vs closed form: |z| of the mean ≤ {z.abs().max():.2f}, sd ratio {ratio.mean():.3f} on average")

# %% tags=["remove-cell"]
assert z.abs().max() < 5 and (ratio.mean() - 1).abs() < 0.05

# %% [markdown]
# ## The sampled-weights ("nn") predictive
# Draw θ from the Laplace posterior and run the network itself: `Predictive` with the model and the posterior as
# guide, the model wrapped in `FullDataModel` so the subsampled plate covers every grid point. The posterior
# covariance was built for the *linearised* network: in the many directions the data do not constrain, it is
# the prior's, and such draws of a 50 × 50 tanh layer scramble the function. The nn predictive then underfits
# badly — the known reason to prefer the linearised one (Immer et al., 2021).

# %%
nn_draws = Predictive(FullDataModel(model), guide=posterior, num_samples=num_samples)(grid)["f"]
nn_draws = nn_draws.reshape(num_samples, -1)  # Predictive pads a site outside the plate to (samples, 1, ...)
nn_mean, nn_std = nn_draws.mean(0), nn_draws.std(0)
print(f"sd of f near the data: nn {nn_std[inside].mean():.3f}, linearised {f_std[inside].mean():.3f}")

# %% tags=["remove-cell"]
assert nn_std[inside].mean() > 2 * f_std[inside].mean()

# %% [markdown]
# ## Other structures on the same MAP
# * `"diag"`: the exact diagonal of the GGN — cheap, and blind to every correlation between weights.
# * `"full"` on `sites="last_layer"`: the exact GGN over the 51 output-layer parameters, the hidden layers held at
#   their MAP values.
# * `"low_rank"`: the top 50 eigenpairs of the GGN from matrix-free GGN-vector products (N = 200 points give
#   the GGN a rank of at most 200).
#
# Each gets its own evidence-tuned prior precision and σ.

# %%
structures = {
    "kron": posterior,
    "diag": guide.laplace_approximation(x, y, structure="diag", check_map=False),
    "full, last layer": guide.laplace_approximation(x, y, structure="full", sites="last_layer", check_map=False),
    "low_rank": guide.laplace_approximation(x, y, structure="low_rank", rank=50, check_map=False),
}
sds = {}
print(f"{'structure':17s} {'params':>6s} {'log Z':>7s} {'precision':>9s} {'sigma':>6s}   sd of f: data    gap  beyond")
for name, laplace in structures.items():
    if laplace is not posterior:
        laplace.optimize_prior_precision("scalar")
    sds[name] = sd = laplace.predict(grid).covariance[:, 0, 0].sqrt()
    print(
        f"{name:17s} {laplace.num_params:6d} {laplace.log_marginal_likelihood().item():7.1f} "
        f"{laplace.prior_precision[0].item():9.3g} {laplace.observation_noise.item():6.3f}   "
        f"{sd[inside].mean():13.3f} {sd[gap].mean():6.3f} {sd[outside].mean():7.3f}"
    )

# %% tags=["remove-cell"]
assert structures["diag"].observation_noise > 2 * NOISE  # see below
assert sds["full, last layer"][gap].mean() < sds["low_rank"][gap].mean() / 2

# %% [markdown]
# What the table says (run it to see the numbers):
# * **diag** has by far the lowest evidence, and its evidence-tuned σ is far above the noise the data were made
#   with. The determinant of H is at most the product of its diagonal (Hadamard's inequality), so dropping the
#   correlations overstates log det H, and the evidence pays for that by shrinking the GGN with a larger σ. Do not
#   tune hyper-parameters on the diagonal's evidence. The warning above the table says so in numbers: the diagonal
#   counts so many effective parameters γ that fewer than a tenth of the 200 points are left to measure σ.
# * **last layer** is confident in the gap: the hidden features are fixed at the MAP, and only the output
#   weights are uncertain.
# * **low rank** with rank 50 is close to the full GGN. The full one is a 2,701² matrix, affordable here;
#   evaluated at the same prior precision and σ, the two evidences agree:

# %%
low_rank = structures["low_rank"]
full = guide.laplace_approximation(x, y, structure="full", check_map=False)
evidence_full = full.log_marginal_likelihood(low_rank.prior_precision, low_rank.observation_noise).item()
evidence_low_rank = low_rank.log_marginal_likelihood().item()
print(f"log evidence at the same (P, σ): full {evidence_full:.2f}, low_rank {evidence_low_rank:.2f}")

# %% tags=["remove-cell"]
# The full GGN's evidence also credits the Newton step ½ bᵀH⁻¹b still to be gained from a θ* short of the MAP,
# which the approximate structures leave out (newton_gain: ~0 after the full training, nats in the quick run).
gain = full.newton_gain(low_rank.prior_precision, low_rank.observation_noise)
print(f"Newton gain {gain:.3f}, difference {evidence_full - evidence_low_rank:.3f}")
assert abs(evidence_full - gain - evidence_low_rank) < 1.0

# %% [markdown]
# With `sites="last_layer"`, f is *linear* in the Laplace parameters (the features before the output layer are
# fixed), so the sampled-weights predictive and the linearised one are the same distribution:

# %%
last = structures["full, last layer"]
# The sd of S Gaussian draws is known to a relative 1/√(2S) (7% at S = 100: too coarse to check 5%), so this check
# takes 4,000 draws of the cheap last-layer guide and allows 4 such errors (4.5%).
check_draws = 4_000
last_draws = Predictive(FullDataModel(model), guide=last, num_samples=check_draws)(grid)["f"].reshape(check_draws, -1)
ratio = last_draws.std(0) / sds["full, last layer"]
print(f"last layer, nn sd / linearised sd: {ratio.mean():.3f} on average")

# %% tags=["remove-cell"]
assert (ratio.mean() - 1).abs() < 4 / (2 * check_draws) ** 0.5

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
ax = axes[0]
ax.fill_between(g, mean - 2 * y_std, mean + 2 * y_std, color="C0", alpha=0.15, label="± 2 sd of y")
ax.fill_between(g, mean - 2 * f_std, mean + 2 * f_std, color="C0", alpha=0.35, label="± 2 sd of f")
ax.plot(g, mean, color="C0", label="mean")
ax.set_title("linearised (GLM) predictive, K-FAC")
ax = axes[1]
ax.fill_between(g, nn_mean - 2 * nn_std, nn_mean + 2 * nn_std, color="C1", alpha=0.25, label="± 2 sd of f")
ax.plot(g, nn_draws[:5].T, color="C1", lw=0.6, alpha=0.8)
ax.plot(g, nn_mean, color="C1", lw=2, label="mean")
ax.set_title("sampled-weights (nn) predictive, K-FAC")
for ax in axes[:2]:
    ax.scatter(x.squeeze(-1), y, s=4, color="k", alpha=0.5, zorder=3)
    ax.plot(g, torch.sin(3 * g), color="k", lw=0.8, ls="--")
    ax.set_ylim(-4, 4)
    ax.set_xlabel("x")
    ax.legend(loc="lower left", fontsize=8)
ax = axes[2]
for name, sd in sds.items():
    ax.plot(g, sd, label=name)
ax.axvspan(-1.5, -0.4, color="k", alpha=0.07, label="data")
ax.axvspan(0.4, 1.5, color="k", alpha=0.07)
ax.set_yscale("log")
ax.set_ylim(bottom=min(float(sd.min()) for sd in sds.values()) / 10)
ax.set_xlabel("x")
ax.set_title("sd of f by structure (linearised)")
ax.legend(loc="lower center", ncol=3, fontsize=8)
fig.tight_layout()

# %% tags=["remove-cell"]
os.makedirs(IMAGES, exist_ok=True)
fig.savefig(os.path.join(IMAGES, "laplace_bnn_bands.png"), dpi=72)
plt.close(fig)

# %% [markdown]
# ## ArviZ
# Draws of every latent site (σ repeated at its fitted value) with the full-data pointwise log-likelihood, as one
# chain.

# %%
idata = posterior.to_inference_data(num_samples=500, seed=0)
print(az.summary(idata, var_names=["layers.2.bias", "sigma"], kind="stats"))
print(f"total {time.perf_counter() - start:.0f} s")
