"""The posteriors paper's cold-posterior comparison (§5.1) and uncertainty split (§5.3), on scikit-learn's digits.

One Pyro model (a 64-32-10 tanh MLP, Normal(0, 1) priors on every weight and bias, 2,410 parameters, a
Categorical likelihood in a subsampled plate) and every engine: MAP (SVI + AutoDelta), SGHMC serial (one chain,
many draws) and parallel (many chains, the last draw of each), SGLD, linearised Laplace (kron; predictive through
the linearised network) and plain Laplace (the same Gaussian, weights sampled and pushed through the network),
linearised Laplace with ``structure="sampled"`` (the full-GGN posterior by sample-then-optimise draws, its
linearised predictive), SWAG, MultiSWAG (``num_runs`` SWAG runs, each from its own MAP, an equal-weight mixture),
sample-then-optimise (its linearised predictive) and Pyro's SVI with AutoNormal, at temperatures
T in {1, 0.3, 0.1, 0.03, 0.01}. Every engine targets the tempered posterior p(theta | D)^(1/T):

* SG-MCMC: the kernel's ``temperature`` (the injected noise scaled by T);
* Gaussian approximations (Laplace, SWAG, sample-then-optimise): the T = 1 Gaussian with its covariance scaled by T,
  which is exactly N(mean, Sigma)^(1/T) up to normalisation (draws theta* + sqrt(T) (theta - theta*));
  MultiSWAG: each run's Gaussian's covariance scaled by T about that run's SWA mean (the mixture of the tempered
  components, not the tempered mixture);
* SVI: the whole log joint scaled by 1/T (``poutine.scale``) against the guide's unscaled entropy, whose optimum
  over all distributions is p^(1/T).

Metrics on 450 held-out digits: NLL of the averaged predictive, accuracy, ECE (15 bins); out of distribution: the
same test digits rotated by 90 degrees, scored by total uncertainty (entropy of the averaged predictive) and by its
epistemic part (mutual information), AUROC of each (:mod:`pyro_scalable.infer.uncertainty`). Each cell is the mean
over seeds +- its standard error (sd / sqrt(seeds)). ``--fast`` scales steps and draws down for a run of minutes.

    python benchmarks/bench_cold_posterior.py [--fast] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.nn import PyroModule, PyroSample
from sklearn.datasets import load_digits
from sklearn.metrics import roc_auc_score
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from pyro_scalable.infer import (  # noqa: E402
    SGHMC,
    SGLD,
    SWAG,
    AutoLinearizedLaplace,
    SampleThenOptimize,
    StochasticMCMC,
    sghmc,
)
from pyro_scalable.infer.uncertainty import decompose_probabilities  # noqa: E402

TEMPERATURES = (1.0, 0.3, 0.1, 0.03, 0.01)
BATCH, CLASSES, DRAWS = 128, 10, 100  # minibatch; classes; weight draws per Gaussian predictive
# three seeds: 8.4 min on two shared CPU cores at load average 3, 30.6 at 8-9; --fast for a few minutes
FULL = dict(map_steps=(1000, 500), warmup=1500, serial=(50, 30), chains=10, svi_steps=1500, swag=30, sto=(16, 30),
            swag_runs=4)  # fmt: skip
FAST = dict(map_steps=(400, 200), warmup=400, serial=(10, 20), chains=6, svi_steps=400, swag=10, sto=(8, 10),
            swag_runs=2)  # fmt: skip


class MLP(PyroModule):
    """64 -> 32 -> 10, tanh, Normal(0, 1) priors; the likelihood in a plate of ``batch_size``."""

    def __init__(self, widths=(64, 32, CLASSES)):
        super().__init__()
        layers = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layer = PyroModule[nn.Linear](fan_in, fan_out)
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out, fan_in]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out]).to_event(1))
            layers.append(layer)
        self.layers = PyroModule[nn.ModuleList](layers)

    def forward(self, x, y=None, batch_size=BATCH):
        data = pyro.plate("data", x.shape[0], subsample_size=batch_size)
        h = x[data.indices]
        for layer in self.layers[:-1]:
            h = torch.tanh(layer(h))
        logits = self.layers[-1](h)
        with data:
            return pyro.sample("y", dist.Categorical(logits=logits), obs=None if y is None else y[data.indices])


def data(device):
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    test, train = order[:450], order[450:]
    x_test = images[test]
    x_ood = torch.rot90(x_test.reshape(-1, 8, 8), 1, (1, 2)).reshape(-1, 64)  # the same digits, turned 90 degrees
    return [t.to(device) for t in (images[train], labels[train], x_test, labels[test], x_ood)]


def member_probs(samples, x):
    """Class probabilities of every draw: ``(S, points, classes)``, float64, by the network's own forward."""
    h = x.double()
    names = sorted({name.rsplit(".", 1)[0] for name in samples})
    for i, name in enumerate(names):
        w, b = samples[f"{name}.weight"].double(), samples[f"{name}.bias"].double()
        h = torch.einsum("pi,soi->spo" if h.dim() == 2 else "spi,soi->spo", h, w) + b[:, None]
        if i < len(names) - 1:
            h = torch.tanh(h)
    return torch.softmax(h, -1)


def scaled(samples, centre, temperature):
    """Draws of N(centre, T Sigma) from draws of N(centre, Sigma)."""
    root = math.sqrt(temperature)
    return {k: centre[k].to(v) + root * (v - centre[k].to(v)) for k, v in samples.items()}


def glm_probs(prediction, temperature, seed):
    """Draws of softmax(f), f ~ N(mean, T cov) per point: the linearised predictive's members ``(S, points, C)``."""
    mean, cov = prediction.mean.double(), temperature * prediction.covariance.double()
    values, vectors = torch.linalg.eigh(cov)  # the draws' covariance (sample-then-optimise) can be singular
    root = vectors * values.clamp_min(0.0).sqrt().unsqueeze(-2)
    g = torch.Generator(mean.device).manual_seed(seed)
    noise = torch.randn((DRAWS, *mean.shape), generator=g, dtype=mean.dtype, device=mean.device)
    return torch.softmax(mean + torch.einsum("nij,snj->sni", root, noise), -1)


def metrics(p_test, y_test, p_ood):
    mean = p_test.mean(0)
    nll = -mean[torch.arange(len(y_test)), y_test].clamp_min(1e-300).log().mean().item()
    confidence, guess = mean.max(-1)
    correct = (guess == y_test).double()
    bins = torch.clamp((confidence * 15).long(), max=14)
    ece = sum(
        (bins == b).double().mean().item() * abs(correct[bins == b].mean() - confidence[bins == b].mean()).item()
        for b in range(15)
        if (bins == b).any()
    )
    u_in, u_out = decompose_probabilities(p_test), decompose_probabilities(p_ood)
    truth = [0] * len(y_test) + [1] * p_ood.shape[1]
    auroc = {}
    for part in ("total", "epistemic"):
        scores = torch.cat([getattr(u_in, part), getattr(u_out, part)]).cpu().numpy()
        auroc[part] = float("nan") if p_test.shape[0] == 1 else roc_auc_score(truth, scores)
    return {"nll": nll, "accuracy": correct.mean().item(), "ece": ece, "auroc_total": auroc["total"],
            "auroc_epistemic": auroc["epistemic"]}  # fmt: skip


def find_map(x, y, seed, steps):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    mlp = MLP()
    guide = AutoDelta(mlp)
    for lr, count, batch in ((1e-2, steps[0], BATCH), (3e-3, steps[1], None)):
        svi = SVI(mlp, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
        for _ in range(count):
            svi.step(x, y, batch_size=batch)
    return {k: v.detach() for k, v in guide.median(x, y).items()}


def run_seed(seed, x, y, x_test, y_test, x_ood, cfg, log):
    """Every engine at every temperature, on one seed: ``{(engine, T): metrics}``."""
    out = {}

    def record(engine, temperature, samples=None, probs=None):
        p_test = member_probs(samples, x_test) if probs is None else probs[0]
        p_ood = member_probs(samples, x_ood) if probs is None else probs[1]
        out[(engine, temperature)] = metrics(p_test, y_test, p_ood)

    clock = time.perf_counter()
    latents = find_map(x, y, seed, cfg["map_steps"])
    record("MAP", None, {k: v[None] for k, v in latents.items()})
    log(f"seed {seed}: MAP {time.perf_counter() - clock:.0f} s")

    clock = time.perf_counter()
    laplace = AutoLinearizedLaplace(MLP()).laplace_approximation(
        x, y, structure="kron", map_latents=latents, check_map=False
    )
    glm_test, glm_ood = laplace.predict(x_test), laplace.predict(x_ood)
    weights = laplace.get_samples(DRAWS, seed=seed)
    for t in TEMPERATURES:
        record("Laplace kron (linearised)", t, probs=(glm_probs(glm_test, t, seed), glm_probs(glm_ood, t, seed)))
        record("Laplace kron (weights)", t, scaled(weights, latents, t))
    log(f"seed {seed}: Laplace {time.perf_counter() - clock:.0f} s")

    clock = time.perf_counter()
    num, epochs = cfg["sto"]  # the same draws and epochs as sample-then-optimise below
    laplace = AutoLinearizedLaplace(MLP()).laplace_approximation(
        x, y, structure="sampled", num_samples=num, sampler_options={"num_epochs": epochs},
        seed=seed, map_latents=latents, check_map=False,
    )  # fmt: skip
    glm_test, glm_ood = laplace.predict(x_test), laplace.predict(x_ood)
    for t in TEMPERATURES:
        record("Laplace sampled (linearised)", t, probs=(glm_probs(glm_test, t, seed), glm_probs(glm_ood, t, seed)))
    log(f"seed {seed}: Laplace sampled {time.perf_counter() - clock:.0f} s")

    clock = time.perf_counter()
    swag = SWAG(MLP(), num_epochs=cfg["swag"], rank=20, seed=seed, progress_bar=False).run(x, y)
    weights, centre = swag.get_samples(DRAWS, seed=seed), swag.median()
    for t in TEMPERATURES:
        record("SWAG", t, scaled(weights, centre, t))
    log(f"seed {seed}: SWAG {time.perf_counter() - clock:.0f} s")

    clock = time.perf_counter()
    runs = cfg["swag_runs"]
    multi = SWAG(MLP(), num_runs=runs, num_epochs=cfg["swag"], rank=20, seed=seed, progress_bar=False).run(x, y)
    weights = multi.get_samples(DRAWS, seed=seed)  # draw s is from run s mod runs
    centre = multi.bridge.constrain(multi.layout.unflatten(multi.mean[torch.arange(DRAWS) % runs]))
    for t in TEMPERATURES:
        record("MultiSWAG", t, scaled(weights, centre, t))
    log(f"seed {seed}: MultiSWAG {time.perf_counter() - clock:.0f} s")

    clock = time.perf_counter()
    sto = SampleThenOptimize(MLP(), num_samples=num, num_epochs=epochs, seed=seed, progress_bar=False)
    sto.run(x, y)
    glm_test, glm_ood = sto.predict(x_test), sto.predict(x_ood)
    for t in TEMPERATURES:
        record("sample-then-optimise", t, probs=(glm_probs(glm_test, t, seed), glm_probs(glm_ood, t, seed)))
    log(f"seed {seed}: sample-then-optimise {time.perf_counter() - clock:.0f} s")

    hyper = sghmc.sgd_hyperparameters(lr=0.05 / len(x), momentum=0.9)
    draws, thin = cfg["serial"]
    for t in TEMPERATURES:
        clock = time.perf_counter()
        for engine, kernel, chains, kept, gap in (
            ("SGHMC serial", SGHMC(MLP(), **hyper, temperature=t, init_strategy=init_to_sample), 1, draws, thin),
            ("SGHMC parallel", SGHMC(MLP(), **hyper, temperature=t, init_strategy=init_to_sample), cfg["chains"], 1, 1),
            ("SGLD", SGLD(MLP(), temperature=t, init_strategy=init_to_sample), 1, draws, thin),
        ):
            mcmc = StochasticMCMC(
                kernel, num_samples=kept, num_warmup=cfg["warmup"], thin=gap, num_chains=chains, seed=seed,
                progress_bar=False,
            )  # fmt: skip
            mcmc.run(x, y)
            record(engine, t, mcmc.get_samples())
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        mlp = MLP()
        guide = AutoNormal(mlp, init_scale=1e-2)
        svi = SVI(poutine.scale(mlp, 1 / t), guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
        for _ in range(cfg["svi_steps"]):
            svi.step(x, y)
        with torch.no_grad():
            record("SVI AutoNormal", t, {k: v.detach() for k, v in _guide_draws(guide, x, y).items()})
        log(f"seed {seed}: T = {t:g} SG-MCMC and SVI {time.perf_counter() - clock:.0f} s")
    return out


def _key(text):
    engine, t = text.split("|")
    return engine, None if t == "None" else float(t)


def _guide_draws(guide, x, y):
    return pyro.infer.Predictive(guide, num_samples=DRAWS)(x, y)


ENGINES = (
    "MAP", "SGHMC serial", "SGHMC parallel", "SGLD", "Laplace kron (linearised)", "Laplace kron (weights)",
    "Laplace sampled (linearised)", "SWAG", "MultiSWAG", "sample-then-optimise", "SVI AutoNormal",
)  # fmt: skip


def summarise(runs):
    """``{(engine, T): {metric: (mean, standard error)}}`` over the seeds."""
    table = {}
    for key in runs[0]:
        values = {m: torch.tensor([run[key][m] for run in runs], dtype=torch.float64) for m in runs[0][key]}
        table[key] = {m: (v.mean().item(), (v.std() / math.sqrt(len(v))).item() if len(v) > 1 else float("nan"))
                      for m, v in values.items()}  # fmt: skip
    return table


def cell(value):
    mean, error = value
    return "—" if math.isnan(mean) else f"{mean:.3f} ± {error:.3f}"


def figure(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric in zip(axes, ("nll", "accuracy", "ece")):
        for engine in ENGINES[1:]:
            m = [table[(engine, t)][metric] for t in TEMPERATURES]
            ax.errorbar(TEMPERATURES, [v[0] for v in m], yerr=[v[1] for v in m], marker="o", capsize=3, label=engine)
        ax.axhline(table[("MAP", None)][metric][0], color="black", ls="--", label="MAP")
        ax.set_xscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("temperature T")
        ax.set_title({"nll": "test NLL", "accuracy": "test accuracy", "ece": "test ECE"}[metric])
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def paired(runs):
    """The comparisons the paper makes, as per-seed differences: ``[(label, mean, standard error)]``."""

    def diff(a, b, metric):
        values = torch.tensor([run[a][metric] - run[b][metric] for run in runs], dtype=torch.float64)
        error = (values.std() / math.sqrt(len(values))).item() if len(values) > 1 else float("nan")
        return values.mean().item(), error

    rows = []
    for t in TEMPERATURES:
        par, ser = ("SGHMC parallel", t), ("SGHMC serial", t)
        rows.append((f"T = {t:g}: parallel SGHMC NLL − serial SGHMC NLL", *diff(par, ser, "nll")))
        rows.append((f"T = {t:g}: parallel SGHMC AUROC, epistemic − total", *_self(runs, par)))
        rows.append((f"T = {t:g}: AUROC epistemic, parallel − serial SGHMC", *diff(par, ser, "auroc_epistemic")))
        lin, plain = ("Laplace kron (linearised)", t), ("Laplace kron (weights)", t)
        rows.append((f"T = {t:g}: linearised Laplace NLL − plain Laplace NLL", *diff(lin, plain, "nll")))
        sampled = ("Laplace sampled (linearised)", t)
        rows.append((f"T = {t:g}: linearised Laplace NLL, sampled − kron", *diff(sampled, lin, "nll")))
        rows.append((f"T = {t:g}: MultiSWAG NLL − SWAG NLL", *diff(("MultiSWAG", t), ("SWAG", t), "nll")))
    for engine in ENGINES[1:]:
        rows.append((f"{engine}: NLL at T = 1 − NLL at T = 0.01", *diff((engine, 1.0), (engine, 0.01), "nll")))
        rows.append((f"{engine}: NLL at T = 0.01 − MAP NLL", *diff((engine, 0.01), ("MAP", None), "nll")))
    return rows


def _self(runs, key):
    values = torch.tensor([run[key]["auroc_epistemic"] - run[key]["auroc_total"] for run in runs], dtype=torch.float64)
    return values.mean().item(), (values.std() / math.sqrt(len(values))).item() if len(values) > 1 else float("nan")


def report(table, args, seconds, path, runs=()):
    lines = [
        "# Cold posterior on the digits: test NLL, accuracy, ECE and OOD AUROC of every engine across temperatures",
        "",
        f"Command: `python benchmarks/bench_cold_posterior.py{' --fast' if args.fast else ''} --seeds {args.seeds}`"
        f" ({seconds / 60:.1f} min).",
        "",
        *harness.machine(1),
        "",
        "Temperature: SG-MCMC through the kernel's `temperature`; the Gaussian engines (both Laplace structures,",
        "SWAG, sample-then-optimise) through their covariance scaled by T, MultiSWAG through each run's covariance",
        f"scaled by T about that run's mean ({(FAST if args.fast else FULL)['swag_runs']} runs); SVI through the log",
        "joint scaled by 1/T. Laplace sampled: the full-GGN posterior from sample-then-optimise draws (as many, and",
        "as many epochs, as sample-then-optimise's), its linearised predictive.",
        "",
        "Mean ± standard error over seeds. OOD: the 450 test digits rotated by 90°; AUROC of the predictive's total",
        "entropy and of its epistemic part (mutual information) for telling the rotated digits from the originals.",
        "",
        "| engine | T | test NLL | accuracy | ECE | AUROC total | AUROC epistemic |",
        "|---|---|---|---|---|---|---|",
    ]
    for engine in ENGINES:
        for t in (None,) if engine == "MAP" else TEMPERATURES:
            row = table[(engine, t)]
            lines.append(
                f"| {engine} | {'—' if t is None else f'{t:g}'} | {cell(row['nll'])} | {cell(row['accuracy'])} | "
                f"{cell(row['ece'])} | {cell(row['auroc_total'])} | {cell(row['auroc_epistemic'])} |"
            )
    lines += ["", "Paired differences (each seed's difference, then mean ± standard error over seeds):", ""]
    lines += ["| comparison | difference |", "|---|---|"]
    lines += [f"| {label} | {mean:+.3f} ± {error:.3f} |" for label, mean, error in paired(runs)]
    path.write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer steps and draws: a run of minutes")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/cold_posterior.md")
    parser.add_argument("--figure", default="docs/images/cold_posterior.png")
    parser.add_argument("--from-json", help="write the report and figure from a finished run's per-seed .json")
    parser.add_argument("--minutes", type=float, help="with --from-json: the run's wall time, for the report")
    args = parser.parse_args()
    if args.from_json:
        runs = [{_key(k): row for k, row in run.items()} for run in json.loads(Path(args.from_json).read_text())]
        report(summarise(runs), args, 60 * (args.minutes or float("nan")), Path(args.out), runs)
        figure(summarise(runs), Path(args.figure))
        return
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    cfg = FAST if args.fast else FULL
    x, y, x_test, y_test, x_ood = data(torch.device("cpu"))  # CPU only: no GPU path yet
    start = time.perf_counter()
    runs = []
    raw = Path(args.out).with_suffix(".json")
    for seed in range(args.seeds):
        runs.append(run_seed(seed, x, y, x_test, y_test, x_ood, cfg, harness.log))
        # every seed's metrics as they finish (the per-seed values behind the table's paired comparisons)
        raw.write_text(json.dumps([{f"{e}|{t}": row for (e, t), row in run.items()} for run in runs], indent=1))
    table = summarise(runs)
    seconds = time.perf_counter() - start
    report(table, args, seconds, Path(args.out), runs)
    figure(table, Path(args.figure))
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
