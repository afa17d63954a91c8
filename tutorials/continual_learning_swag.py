# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Yesterday's posterior as today's prior, and MultiSWAG
#
# Two uses of a Gaussian posterior beyond predicting with it.
#
# **Continual learning.** A network trained on one task after another with plain SGD forgets the earlier tasks:
# nothing in the new task's loss says the old weights mattered. Bayes' rule says what to do: the posterior after
# episode 1 is the prior of episode 2, so that p(θ | D₁, D₂) ∝ p(D₂ | θ) p(θ | D₁). `posterior.as_prior()` hands a
# Laplace or SWAG posterior to the next episode's model as the joint prior of its weights; with a diagonal Laplace
# posterior this is the elastic-weight-consolidation (EWC) update, with the full one the correlations are kept.
# We train a small MLP on four episodes of the 8 × 8 digits, each with its pixels shuffled by a different fixed
# permutation, and record the accuracy on every past episode after each new one.
#
# **MultiSWAG.** SWAG (Maddox et al. 2019) fits a Gaussian to the iterates of constant-step SGD around a trained
# point; several SWAG runs from different starting points (MultiSWAG) form a mixture. We compare it with a deep
# ensemble and with parallel SG-MCMC on held-out accuracy, negative log-likelihood (NLL), calibration (ECE) and
# out-of-distribution (OOD) detection.

# %% [markdown] tags=["remove-cell"]
# Set `PYRO_SCALABLE_FAST=1` for the quick run CI does (fewer episodes, steps and members). Cells tagged `remove-cell`
# (this switch, the plotting backend and the warnings' format, the figure file, the tutorial's own checks) run but are
# left out of the documentation page.

# %% tags=["remove-cell"]
import os
import warnings

import matplotlib

matplotlib.use("Agg")  # the figures are files (docs/images), attached to the page by scripts/render_tutorials.py


def _warning_as_read(message, category, filename, lineno, line=None):
    return f"{category.__name__}: {message}\n"  # the category and message, not the kernel's temporary file name


warnings.formatwarning = _warning_as_read

# %%
import math
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from pyro.infer.autoguide.initialization import init_to_sample, init_to_value
from pyro.nn import PyroModule, PyroSample
from sklearn.datasets import load_digits
from sklearn.metrics import roc_auc_score
from torch import nn

from pyro_scalable.infer import SGHMC, SWAG, AutoLinearizedLaplace, StochasticMCMC, sghmc
from pyro_scalable.infer.swag.check import ApproximationWarning

EPISODES, MAP_STEPS, SWAG_EPOCHS = 4, 1_500, 20
MEMBERS, NUM_WARMUP = 16, 1_500

# %% tags=["remove-cell"]
FAST = os.environ.get("PYRO_SCALABLE_FAST") == "1"
IMAGES = os.environ.get("PYRO_SCALABLE_IMAGES", "docs/images")
if FAST:  # the quick run CI does
    EPISODES, MAP_STEPS, SWAG_EPOCHS = 3, 500, 8
    MEMBERS, NUM_WARMUP = 6, 400

# %%
torch.set_num_threads(1)  # tensors this small run fastest on one thread
start = time.perf_counter()

# %% [markdown]
# ## Part 1: continual learning on permuted digits
# scikit-learn ships the 1,797 digit images (no download). The first 1,200 (in a fixed random order) train, the
# other 597 test. Episode k shows every image with its 64 pixels in the k-th fixed order (episode 1: as they are);
# the labels stay the digits, so one 10-way output layer serves every episode.

# %%
digits = load_digits()
generator = torch.Generator().manual_seed(0)
order = torch.randperm(len(digits.data), generator=generator)
images = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
labels = torch.tensor(digits.target)[order]
permutations = [torch.arange(64)] + [torch.randperm(64, generator=generator) for _ in range(EPISODES - 1)]
TRAIN = 1_200
episodes = [
    {"x": images[:TRAIN, p], "y": labels[:TRAIN], "x_test": images[TRAIN:, p], "y_test": labels[TRAIN:]}
    for p in permutations
]
print(f"{EPISODES} episodes of {TRAIN} training and {len(images) - TRAIN} test images")


# %% [markdown]
# The model: a 64 → 32 → 10 tanh network with Normal(0, 1) priors on every weight and bias (2,410 parameters),
# and the likelihood in a subsampled plate of 100, as every model here is written. `pyro.deterministic` records the
# logits for `Predictive`.


# %%
class MLP(PyroModule):
    def __init__(self, widths=(64, 32, 10)):
        super().__init__()
        layers = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layer = PyroModule[nn.Linear](fan_in, fan_out)
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out, fan_in]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out]).to_event(1))
            layers.append(layer)
        self.layers = PyroModule[nn.ModuleList](layers)

    def forward(self, x, y=None, batch_size=100):
        data = pyro.plate("data", x.shape[0], subsample_size=min(batch_size, x.shape[0]))
        h = x[data.indices]
        for layer in self.layers[:-1]:
            h = torch.tanh(layer(h))
        logits = self.layers[-1](h)
        with data:
            pyro.deterministic("logits", logits)
            return pyro.sample("y", dist.Categorical(logits=logits), obs=None if y is None else y[data.indices])


net = MLP()


# %% [markdown]
# Each episode finds the MAP of its model (the first episode's model, or the previous posterior as the prior) by
# minibatch `SVI` with an `AutoDelta` guide, starting from the previous episode's weights. Then:
#
# * **SGD** keeps the model as it is: the next episode starts from these weights under the original prior;
# * **Laplace (diag)** fits `AutoLinearizedLaplace(model).laplace_approximation(..., structure="diag")` at the MAP,
#   and `as_prior(net)` makes N(MAP, diag(H)⁻¹) the next prior — EWC with the Laplace precision as its weights;
# * **Laplace (full)** the same with the dense 2,410 × 2,410 precision, correlations kept;
# * **SWAG** runs SWAG from the MAP and hands on its low-rank-plus-diagonal Gaussian.
#
# The second episode's Laplace fit reads the correlated prior itself (only `structure="full"` can hold a dense
# prior; `"diag"` reads the diagonal prior of a diagonal posterior).


# %%
def fit_map(model, x, y, init):
    pyro.clear_param_store()
    guide = AutoDelta(model, init_loc_fn=init_to_sample if init is None else init_to_value(values=init))
    optimizer = pyro.optim.ClippedAdam({"lr": 3e-3, "lrd": 0.1 ** (1 / MAP_STEPS)})
    svi = SVI(model, guide, optimizer, Trace_ELBO())
    for _ in range(MAP_STEPS):
        svi.step(x, y)
    return {name: value.detach() for name, value in guide.median(x, y).items()}


def accuracy(weights, x, y):
    predictive = Predictive(net, posterior_samples={k: v[None] for k, v in weights.items()}, return_sites=["logits"])
    logits = predictive(x, batch_size=x.shape[0])["logits"][0]
    return (logits.argmax(-1) == y).double().mean().item()


METHODS = ("SGD", "Laplace (diag)", "Laplace (full)", "SWAG")
history, seconds = {}, {}
for method in METHODS:
    pyro.set_rng_seed(0)
    began = time.perf_counter()
    model, weights, rows = net, None, []
    for number, episode in enumerate(episodes):
        weights = fit_map(model, episode["x"], episode["y"], weights)
        if method.startswith("Laplace"):
            structure = "full" if "full" in method else "diag"
            laplace = AutoLinearizedLaplace(model).laplace_approximation(
                episode["x"], episode["y"], structure=structure, map_latents=weights, check_map=False
            )
            model = laplace.as_prior(net)
        elif method == "SWAG":
            swag = SWAG(model, start=weights, num_epochs=SWAG_EPOCHS, rank=20, seed=number, progress_bar=False)
            # SWAG warns that its step is capped, and as_prior that the capped Gaussian is too narrow for a
            # prior: the steps are printed here and the consequence is discussed below the results instead
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="lr='auto'", category=UserWarning)
                warnings.filterwarnings("ignore", message="as_prior: SWAG ran at", category=UserWarning)
                warnings.filterwarnings("ignore", category=ApproximationWarning)  # its figures are printed below
                result = swag.run(episode["x"], episode["y"])
                model = result.as_prior(net)
            (check,) = result.stats["check"]
            spread = (
                f"sds {check.spread_low:.2g}-{check.spread_high:.2g} x the Laplace posterior's"
                if check.positive_definite
                else "curvature not definite there"
            )
            print(
                f"SWAG, episode {number + 1}: step {result.stats['lr']:.3g} (Mandt's {result.stats['lr_noise']:.3g}); "
                f"its check: {spread}"
            )
        rows.append([accuracy(weights, e["x_test"], e["y_test"]) for e in episodes[: number + 1]])
    history[method], seconds[method] = rows, time.perf_counter() - began
    print(f"{method:15s} {seconds[method]:5.0f} s   accuracy on episodes 1..k after episode k:")
    for number, row in enumerate(rows):
        print(f"{'':23s} after {number + 1}: " + "  ".join(f"{a:.3f}" for a in row))

# %% [markdown]
# With 597 test images an accuracy near 0.8 has a binomial standard error of about 0.016.
#
# SGD learns each new episode well and forgets the old ones: its accuracy on episode 1 falls towards chance-level
# guessing of the shuffled pixels. The Laplace priors keep much of it. The full posterior keeps more than the
# diagonal: the correlations say which *combinations* of weights episode 1 pinned down, where the diagonal can only
# pin weights one by one (so it both protects less and blocks more). SWAG's Gaussian is the spread of SGD's
# iterates, which is narrow wherever the minibatch gradient is quiet relative to the curvature — a much sharper
# prior than the posterior in those directions — so the next episodes can hardly move the weights, and SWAG's own
# step must shrink to stay stable on that sharp prior (SWAG warns when its step is capped), which narrows the next
# prior further: SWAG-as-prior protects the first episode at the expense of learning the later ones. (Scaling
# SWAG's covariance up by the ratio of Mandt's rate to the capped step does not cure it: we tried, and the
# directions the data does not inform stay narrow, because SWAG's spread comes from the gradient noise, and there is
# none there.) `as_prior` on a capped SWAG run warns of this: the Laplace posteriors are the priors to use.
# SWAG's own check after each run (an `ApproximationWarning`, printed above as "its check") compares its Gaussian
# with the Laplace posterior at SWAG's mean on 8 directions: far from it in every episode, narrower at first and far
# wider once the sharp SWAG priors make the Laplace posterior narrow.

# %% tags=["remove-cell"]
binomial = math.sqrt(0.25 / (len(images) - TRAIN))  # the largest binomial sd, at accuracy 1/2
first = {m: history[m][-1][0] for m in METHODS}
# forgetting: the full Laplace prior keeps episode 1 better than SGD by many binomial sds
assert first["Laplace (full)"] > first["SGD"] + 4 * binomial, first
assert first["Laplace (diag)"] > first["SGD"] + 2 * binomial, first
# and the full prior still learns the last episode
assert history["Laplace (full)"][-1][-1] > 0.6, history["Laplace (full)"][-1]

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, len(METHODS), figsize=(14, 3.4), sharey=True)
for ax, method in zip(axes, METHODS):
    rows = history[method]
    for episode in range(EPISODES):
        trained = list(range(episode + 1, EPISODES + 1))
        ax.plot(trained, [rows[k - 1][episode] for k in trained], "o-", label=f"episode {episode + 1}")
    average = [sum(row) / len(row) for row in rows]
    ax.plot(range(1, EPISODES + 1), average, "k--", lw=2, label="mean of seen")
    ax.set_title(f"{method} ({seconds[method]:.0f} s)")
    ax.set_xlabel("episodes trained")
    ax.set_xticks(range(1, EPISODES + 1))
axes[0].set_ylabel("test accuracy")
axes[0].set_ylim(0, 1)
axes[-1].legend(fontsize=7, loc="lower left")
fig.tight_layout()

# %% tags=["remove-cell"]
os.makedirs(IMAGES, exist_ok=True)
fig.savefig(os.path.join(IMAGES, "continual_learning.png"), dpi=72)
plt.close(fig)

# %% [markdown]
# ## Part 2: MultiSWAG, a deep ensemble and parallel SG-MCMC
# Digits 0–4 are in distribution (601 training, 300 held-out images), 300 images of digits 5–9 are OOD. The net is
# the same with 5 outputs. The three ensembles have the same number of members, each from its own random start:
#
# * **deep ensemble**: `MEMBERS` SGHMC chains at temperature 0 (SGD with momentum), one end point each;
# * **parallel SG-MCMC**: the same chains at temperature 1, a few draws from the end of each;
# * **MultiSWAG**: `SWAG(..., num_runs=MEMBERS)` — each run finds its own MAP from its own start, then fits its
#   SWAG Gaussian; 4 draws per run.

# %%
known = labels < 5
x_known, y_known = images[known], labels[known]
x_in, y_in, x_train, y_train = x_known[:300], y_known[:300], x_known[300:], y_known[300:]
x_ood = images[~known][:300]
N, CLASSES = len(x_train), 5
small = MLP((64, 32, CLASSES))


def member_probs(model, samples, x):
    """Class probabilities of every member (draw) on every input, ``(members, points, classes)`` in float64."""
    logits = Predictive(model, posterior_samples=samples, return_sites=["logits"])(x, batch_size=len(x))["logits"]
    return logits.reshape(-1, len(x), CLASSES).double().softmax(-1)


ensembles, cost = {}, {}
hyperparameters = sghmc.sgd_hyperparameters(lr=0.05 / N, momentum=0.9)
for name, temperature, kept in (("deep ensemble", 0.0, 1), ("parallel SG-MCMC", 1.0, 4)):
    began = time.perf_counter()
    mcmc = StochasticMCMC(
        SGHMC(small, **hyperparameters, temperature=temperature, init_strategy=init_to_sample),
        num_samples=kept,
        num_warmup=NUM_WARMUP,
        thin=25,
        num_chains=MEMBERS,
        seed=0,
        progress_bar=False,
    )
    with warnings.catch_warnings():  # r_hat across members is large by design: each sits in its own mode
        warnings.filterwarnings("ignore", message="the chains are not healthy")
        mcmc.run(x_train, y_train)
    cost[name] = time.perf_counter() - began
    samples = mcmc.get_samples()
    ensembles[name] = (member_probs(small, samples, x_in), member_probs(small, samples, x_ood))

began = time.perf_counter()
multiswag = SWAG(small, num_runs=MEMBERS, num_epochs=SWAG_EPOCHS, rank=20, seed=0, progress_bar=False)
with warnings.catch_warnings():  # the step is capped by the net's stiffest direction (printed below)
    warnings.filterwarnings("ignore", message="lr='auto'", category=UserWarning)
    posterior = multiswag.run(x_train, y_train)
cost["MultiSWAG"] = time.perf_counter() - began
samples = posterior.get_samples(4 * MEMBERS, seed=0)
ensembles["MultiSWAG"] = (member_probs(small, samples, x_in), member_probs(small, samples, x_ood))
stats = posterior.stats
print(
    f"MultiSWAG: {MEMBERS} runs, SGD step {stats['lr']:.3g} (Mandt's {stats['lr_noise']:.3g}, capped by the "
    f"stiffest direction), {stats['num_snapshots']} snapshots"
)

# %% [markdown]
# The metrics, on the ensemble's mean probabilities p̄(x):
#
# * **accuracy** and **NLL** = −mean log p̄(y | x) on the 300 held-out digits;
# * **ECE**: the held-out points binned by confidence max p̄ (10 bins), the weighted mean of |accuracy − confidence|;
# * **AUROC** of the predictive entropy H[p̄] for telling the OOD digits from the held-out ones (0.5 is chance;
#   its null standard error is √((n₀ + n₁ + 1)/(12 n₀ n₁)) = 0.024).


# %%
def expected_calibration_error(p, y, bins=10):
    confidence, guess = p.max(-1)
    edges = torch.linspace(0, 1, bins + 1, dtype=p.dtype)
    error = torch.zeros((), dtype=p.dtype)
    for low, high in zip(edges[:-1], edges[1:]):
        inside = (confidence > low) & (confidence <= high)
        if inside.any():
            gap = (guess[inside] == y[inside]).double().mean() - confidence[inside].mean()
            error = error + inside.double().mean() * gap.abs()
    return error.item()


def entropy(p):
    return -(p * p.clamp_min(1e-300).log()).sum(-1)


is_ood = torch.cat([torch.zeros(len(x_in)), torch.ones(len(x_ood))]).numpy()
metrics = {}
print(f"{'':18s} {'seconds':>8s} {'accuracy':>9s} {'NLL':>7s} {'ECE':>7s} {'AUROC':>7s}")
for name, (p_in, p_ood) in ensembles.items():
    mean_in, mean_ood = p_in.mean(0), p_ood.mean(0)
    metrics[name] = {
        "accuracy": (mean_in.argmax(-1) == y_in).double().mean().item(),
        "nll": -mean_in[torch.arange(len(y_in)), y_in].log().mean().item(),
        "ece": expected_calibration_error(mean_in, y_in),
        "auroc": roc_auc_score(is_ood, torch.cat([entropy(mean_in), entropy(mean_ood)]).numpy()),
    }
    m = metrics[name]
    print(f"{name:18s} {cost[name]:8.0f} {m['accuracy']:9.3f} {m['nll']:7.3f} {m['ece']:7.3f} {m['auroc']:7.3f}")

# %% [markdown]
# All three separate the OOD digits far above chance. MultiSWAG's members start at MAPs (each run's own mode
# search), so its accuracy and NLL are those of an ensemble of well-trained nets, with the SWAG spread around each
# adding disagreement on inputs unlike the training set. Its cost is the mode searches plus `num_epochs` epochs of
# SGD per run, all runs in one vectorised computation.

# %% tags=["remove-cell"]
null_se = math.sqrt((len(x_in) + len(x_ood) + 1) / (12 * len(x_in) * len(x_ood)))
for name, m in metrics.items():
    assert m["auroc"] > 0.5 + 5 * null_se, (name, m)
    assert m["accuracy"] > 0.8, (name, m)
    assert math.isfinite(m["nll"]) and 0 <= m["ece"] <= 1, (name, m)

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
names = list(ensembles)
for ax, key, label in zip(axes, ("nll", "ece", "auroc"), ("NLL (held-out)", "ECE (held-out)", "OOD AUROC")):
    ax.bar(range(len(names)), [metrics[n][key] for n in names], color=["C0", "C1", "C2"])
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_title(label)
axes[2].set_ylim(0.5, 1)
fig.tight_layout()

# %% tags=["remove-cell"]
fig.savefig(os.path.join(IMAGES, "multiswag_ensembles.png"), dpi=72)
plt.close(fig)

# %%
print(f"total {time.perf_counter() - start:.0f} s")
