# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Parallel SG-MCMC as a Bayesian deep ensemble
#
# Many short SGHMC chains, keeping only the last few draws of each, are *parallel SG-MCMC*: at temperature T = 1
# each chain ends near a draw of the posterior; at T = 0 each chain is SGD with momentum from its own random
# initial point, and the set of end points is a plain **deep ensemble**. One `StochasticMCMC` call runs all the
# chains as one vectorised computation, so switching between the two is one argument.
#
# On a small Bayesian MLP trained on five of the ten digit classes we compare the two ensembles on
#
# * accuracy on held-out digits of the same five classes (against a logistic-regression baseline);
# * the decomposition of the predictive entropy into an *aleatoric* part (the members' mean entropy: noise each
#   member sees in the data) and an *epistemic* part (the mutual information between the prediction and the
#   weights: disagreement between members);
# * out-of-distribution detection: the epistemic part should be larger on the five digit classes never seen in
#   training, and its AUROC says how well it separates them.

# %% [markdown] tags=["remove-cell"]
# Set `PYRO_SCALABLE_FAST=1` for the quick run CI does (fewer chains, fewer steps). Cells tagged `remove-cell` (this
# switch, the plotting backend and the warnings' format, the figure file, the tutorial's own checks) run but are left
# out of the documentation page.

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

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.nn import PyroModule, PyroSample
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score, roc_curve
from torch import nn

from pyro_scalable.infer import SGHMC, StochasticMCMC, sghmc

NUM_CHAINS, NUM_WARMUP, NUM_SAMPLES, THIN = 32, 1_500, 4, 50

# %% tags=["remove-cell"]
FAST = os.environ.get("PYRO_SCALABLE_FAST") == "1"
IMAGES = os.environ.get("PYRO_SCALABLE_IMAGES", "docs/images")
if FAST:  # the quick run CI does
    NUM_CHAINS, NUM_WARMUP, NUM_SAMPLES, THIN = 16, 500, 2, 25

# %%
torch.set_num_threads(1)  # tensors this small run fastest on one thread
start = time.perf_counter()

# %% [markdown]
# ## Data: digits 0–4 in distribution, 5–9 out of it
# scikit-learn ships the 1,797 8 × 8 digit images (no download). The 901 images of digits 0–4 are split into 601
# for training and 300 held out; 300 images of digits 5–9 are the out-of-distribution (OOD) inputs.

# %%
digits = load_digits()
images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
labels = torch.tensor(digits.target)
order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
images, labels = images[order], labels[order]
known = labels < 5
x_known, y_known = images[known], labels[known]
x_test, y_test, x_train, y_train = x_known[:300], y_known[:300], x_known[300:], y_known[300:]
x_ood = images[~known][:300]
N, CLASSES = len(x_train), 5
print(f"train {N}, test {len(x_test)} (digits 0–4), OOD {len(x_ood)} (digits 5–9)")

# %% [markdown]
# ## The model
# A 64 → 32 → 5 ReLU network with Normal(0, 1) priors on every weight and bias (2,245 parameters) and a
# Categorical likelihood in a subsampled plate of 64. As in every model here, the plate is created first, its
# `indices` pick the minibatch, the network runs outside the plate (its weights are global), and only the
# likelihood goes inside. `pyro.deterministic("probs", ...)` records the class probabilities for `Predictive`.


# %%
class MLP(PyroModule):
    def __init__(self, widths=(64, 32, CLASSES)):
        super().__init__()
        layers = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layer = PyroModule[nn.Linear](fan_in, fan_out)
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out, fan_in]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out]).to_event(1))
            layers.append(layer)
        self.layers = PyroModule[nn.ModuleList](layers)

    def forward(self, x, y=None, batch_size=64):
        data = pyro.plate("data", x.shape[0], subsample_size=batch_size)
        h = x[data.indices]
        for layer in self.layers[:-1]:
            h = torch.relu(layer(h))
        logits = self.layers[-1](h)
        with data:
            pyro.deterministic("probs", logits.softmax(-1))
            return pyro.sample("y", dist.Categorical(logits=logits), obs=None if y is None else y[data.indices])


# %% [markdown]
# ## Many chains, a few draws each
# The step size and friction come from an SGD recipe: SGD with momentum 0.9 and a learning rate of 0.05 on the
# *mean* loss is a learning rate of 0.05 / N on the sum the model's plate estimates; `sghmc.sgd_hyperparameters`
# converts it (at T = 0 the SGHMC trajectory is exactly that SGD's). Every chain starts from its own draw of the
# prior (`init_to_sample`), warms up, and keeps `NUM_SAMPLES` draws `THIN` steps apart. The same settings run at
# T = 1 (parallel SG-MCMC) and T = 0 (the deep ensemble).

# %%
hyperparameters = sghmc.sgd_hyperparameters(lr=0.05 / N, momentum=0.9)
print("SGHMC hyperparameters:", {k: round(v, 4) for k, v in hyperparameters.items()})
ensembles = {}
for temperature in (1.0, 0.0):
    mcmc = StochasticMCMC(
        SGHMC(MLP(), **hyperparameters, temperature=temperature, init_strategy=init_to_sample),
        num_samples=NUM_SAMPLES,
        num_warmup=NUM_WARMUP,
        thin=THIN,
        num_chains=NUM_CHAINS,
        seed=0,
        progress_bar=False,
    )
    run_start = time.perf_counter()
    mcmc.run(x_train, y_train)
    print(
        f"T = {temperature:g}: {NUM_CHAINS} chains × {NUM_WARMUP + NUM_SAMPLES * THIN} steps in "
        f"{time.perf_counter() - run_start:.0f} s, {int(mcmc.sample_stats['diverging'].sum())} divergent steps"
    )
    ensembles[temperature] = mcmc

# %% [markdown]
# Each chain sits in its own mode of a multimodal posterior, so r_hat across chains is large by design, and the
# T = 1 run says so in a `HealthWarning` (with the advice for a posterior that should have one mode): here the chains
# are members of an ensemble, not replicas to be checked against each other.
#
# ## Predictions of every member
# `mcmc.kernel.model` is the model with the subsampled plate switched to all the points, so `Predictive` with the
# draws as `posterior_samples` gives every member's class probabilities on every input.


# %%
def member_probs(mcmc, x):
    """Class probabilities of every member (draw) on every input: ``(members, points, classes)``, float64."""
    samples = mcmc.get_samples()
    probs = Predictive(mcmc.kernel.model, posterior_samples=samples, return_sites=["probs"])(x)["probs"]
    return probs.reshape(-1, x.shape[0], CLASSES).double()


def entropy(p):
    return -(p * p.clamp_min(1e-300).log()).sum(-1)


baseline = LogisticRegression(max_iter=2_000).fit(x_train.numpy(), y_train.numpy())
baseline_accuracy = baseline.score(x_test.numpy(), y_test.numpy())
standard_error = math.sqrt(baseline_accuracy * (1 - baseline_accuracy) / len(x_test))
print(f"logistic regression: test accuracy {baseline_accuracy:.3f} (binomial sd {standard_error:.3f})")

results = {}
for temperature, mcmc in ensembles.items():
    p_test, p_ood = member_probs(mcmc, x_test), member_probs(mcmc, x_ood)
    accuracy = (p_test.mean(0).argmax(-1) == y_test).double().mean().item()
    member_accuracy = (p_test.argmax(-1) == y_test).double().mean().item()
    results[temperature] = {"test": p_test, "ood": p_ood, "accuracy": accuracy}
    print(
        f"T = {temperature:g}: {p_test.shape[0]} members; ensemble accuracy {accuracy:.3f}, "
        f"a member's {member_accuracy:.3f}"
    )

# %% tags=["remove-cell"]
# the baseline is linear in the pixels; any reasonable net should do no worse, up to the binomial noise of a
# 300-image test set (3 sds)
for result in results.values():
    assert result["accuracy"] > baseline_accuracy - 3 * standard_error

# %% [markdown]
# ## Aleatoric and epistemic uncertainty
# With member probabilities p_k(x), k = 1..K, and their mean p̄(x):
#
# * **total** = H[p̄] — the entropy of the ensemble's prediction;
# * **aleatoric** = (1/K) Σ_k H[p_k] — the entropy each member already predicts: ambiguity in the input itself;
# * **epistemic** = total − aleatoric = (1/K) Σ_k KL(p_k ‖ p̄) — the mutual information between the label and the
#   member, zero exactly when all members agree (Jensen's inequality makes it ≥ 0).
#
# The last equality is an identity, not an approximation; the tutorial computes the KL form separately and checks
# it against the difference, in float64.

# %%
for temperature, result in results.items():
    for split in ("test", "ood"):
        p = result[split]
        mean = p.mean(0)
        total, aleatoric = entropy(mean), entropy(p).mean(0)
        epistemic = total - aleatoric
        kl_form = (p * (p.clamp_min(1e-300).log() - mean.clamp_min(1e-300).log())).sum(-1).mean(0)
        result[split + " parts"] = (total, aleatoric, epistemic)
        result[split + " kl form"] = kl_form
    print(f"T = {temperature:g}:  mean over points of      total  aleatoric  epistemic")
    for split, name in (("test", "held-out digits 0–4"), ("ood", "digits 5–9 (OOD)")):
        total, aleatoric, epistemic = result[split + " parts"]
        print(f"        {name:26s} {total.mean():7.3f} {aleatoric.mean():10.3f} {epistemic.mean():10.3f}")

# %% tags=["remove-cell"]
for result in results.values():
    for split in ("test", "ood"):
        total, aleatoric, epistemic = result[split + " parts"]
        assert torch.allclose(epistemic, result[split + " kl form"], atol=1e-9)
        assert bool((epistemic > -1e-12).all()) and bool((total <= math.log(CLASSES) + 1e-12).all())

# %% [markdown]
# ## Out-of-distribution detection
# Score every input by its epistemic uncertainty and ask how well the score ranks OOD inputs above in-distribution
# ones: the AUROC (1 = perfect, 0.5 = chance). Under the null hypothesis of no separation, the AUROC of
# n₀ and n₁ scores has standard error √((n₀ + n₁ + 1) / (12 n₀ n₁)) (the Mann–Whitney statistic), 0.024 here;
# the assertion asks for an AUROC at least 5 of those above 0.5.

# %%
is_ood = torch.cat([torch.zeros(len(x_test)), torch.ones(len(x_ood))]).numpy()
null_se = math.sqrt((len(x_test) + len(x_ood) + 1) / (12 * len(x_test) * len(x_ood)))
for temperature, result in results.items():
    for part, index in (("epistemic", 2), ("total", 0)):
        score = torch.cat([result["test parts"][index], result["ood parts"][index]]).numpy()
        result[f"auroc {part}"] = roc_auc_score(is_ood, score)
        if part == "epistemic":
            result["roc"] = roc_curve(is_ood, score)
    print(
        f"T = {temperature:g}: AUROC from the epistemic part {result['auroc epistemic']:.3f}, "
        f"from the total entropy {result['auroc total']:.3f}   (chance 0.5 ± {null_se:.3f})"
    )

# %% tags=["remove-cell"]
for result in results.values():
    assert result["auroc epistemic"] > 0.5 + 5 * null_se

# %% [markdown]
# Temperature 1 against temperature 0: the noise SGHMC injects at T = 1 keeps each chain moving within its mode
# (and the kept draws of one chain differ), where at T = 0 the members differ only by their initial points and the
# minibatch noise. The T = 1 ensemble therefore disagrees more, on OOD inputs above all. A paired comparison over
# the 300 OOD points (its standard error from the spread of the per-point differences) checks that its mean
# epistemic uncertainty is larger by more than 3 standard errors.

# %%
difference = results[1.0]["ood parts"][2] - results[0.0]["ood parts"][2]
paired_se = difference.std() / len(difference) ** 0.5
print(
    f"mean epistemic uncertainty on OOD inputs: T = 1 {results[1.0]['ood parts'][2].mean():.3f}, "
    f"T = 0 {results[0.0]['ood parts'][2].mean():.3f}; difference {difference.mean():.3f} ± {paired_se:.3f}"
)

# %% tags=["remove-cell"]
assert difference.mean() > 3 * paired_se

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
bins = torch.linspace(0, max(float(r["ood parts"][2].max()) for r in results.values()), 31).numpy()
for ax, temperature in zip(axes[:2], (1.0, 0.0)):
    result = results[temperature]
    ax.hist(result["test parts"][2].numpy(), bins=bins, alpha=0.6, label="held-out digits 0–4", density=True)
    ax.hist(result["ood parts"][2].numpy(), bins=bins, alpha=0.6, label="digits 5–9 (OOD)", density=True)
    kind = "parallel SG-MCMC" if temperature == 1.0 else "deep ensemble"
    ax.set_title(f"T = {temperature:g} ({kind}): AUROC {result['auroc epistemic']:.3f}")
    ax.set_xlabel("epistemic uncertainty (mutual information, nats)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
ax = axes[2]
width = 0.35
for offset, temperature in ((-width / 2, 1.0), (width / 2, 0.0)):
    result = results[temperature]
    aleatoric = [float(result[s + " parts"][1].mean()) for s in ("test", "ood")]
    epistemic = [float(result[s + " parts"][2].mean()) for s in ("test", "ood")]
    positions = [offset, 1 + offset]
    ax.bar(positions, aleatoric, width, color="C0" if temperature else "C2", label=f"aleatoric, T = {temperature:g}")
    ax.bar(
        positions,
        epistemic,
        width,
        bottom=aleatoric,
        color="C1" if temperature else "C3",
        label=f"epistemic, T = {temperature:g}",
    )
ax.set_xticks([0, 1], ["held-out 0–4", "OOD 5–9"])
ax.set_ylabel("mean predictive entropy (nats)")
ax.set_title("total entropy = aleatoric + epistemic")
ax.legend(fontsize=7)
fig.tight_layout()

# %% tags=["remove-cell"]
os.makedirs(IMAGES, exist_ok=True)
fig.savefig(os.path.join(IMAGES, "sgmcmc_deep_ensembles.png"), dpi=72)
plt.close(fig)

# %%
print(f"total {time.perf_counter() - start:.0f} s")
