"""The EKF's accuracy and cost: four GLMs against their exact posteriors, a larger logistic regression, a network.

    python benchmarks/bench_ekf.py      # about 4 minutes on 2 CPU cores

Prints a markdown report and writes it to ``benchmarks/results/ekf.md`` (``--out`` to change).

1. **Four GLMs** (N = 2,000, three standard-Normal features, prior N(0, I); the cases and exact references of
   ``tests/infer/ekf/glms.py``: the linear-Gaussian closed form, importance sampling for the logistic, Poisson and
   categorical ones): for minibatches of 1,000, 100 and 10, the largest mean error in posterior sds, the range of the
   sd ratios, the seconds and whether the run warned, for the defaults (``EKF(model)``: dense, GGN, iterated),
   ``DiagonalEKF(model)``, and the previous defaults (diagonal, empirical Fisher, one iteration, no check).
2. **Ten coefficients** (N = 100,000 logistic regression, float32): against the exact mode (Newton's method in
   float64) and the Laplace covariance there (at this N, the posterior's to about 0.01 sd); the largest mean error,
   the sd ratios and the seconds for B = 1,000 and 100, and for the Laplace guide at a MAP found by 2,000 SVI steps.
3. **A network** (the 8 x 8 digits, 1,200 training and 597 test images, a 64-32-10 tanh MLP with Normal(0, 1)
   priors, B = 100, so 12 minibatches): one pass from a prior draw (``start="sample"``), test accuracy and NLL of
   the linearised predictive; against the MAP (1,500 SVI steps) and its diagonal Laplace with the evidence-tuned
   prior precision.
4. **The dense filter's cost** against d (logistic regression, N = 2,000, B = 100): seconds per evaluation of a
   minibatch, dense and diagonal (what ``covariance="auto"``'s :data:`~pyro_scalable.infer.ekf.engine.DENSE_UP_TO`
   rests on).

One torch thread; one run each (the ratios, not the absolute times, carry over).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from harness import log, machine, warm_up_torch, write_report  # benchmarks/ is on sys.path when a script runs
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_scalable.infer import EKF, AutoLinearizedLaplace, DiagonalEKF

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.infer.ekf import glms  # noqa: E402  (the cases and references the tests use)

RUNNERS = {
    "defaults": lambda model, **kw: EKF(model, **kw),
    "DiagonalEKF": lambda model, **kw: DiagonalEKF(model, **kw),
    "before (diag, ef, 1 it.)": lambda model, **kw: EKF(
        model, covariance="diagonal", curvature="ef", iterations=1, check_posterior=False, **kw
    ),
}


def timed(engine, *args) -> tuple[object, float, int]:
    """The engine's posterior on ``args``, the seconds, and how many warnings the run gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        began = time.perf_counter()
        posterior = engine.run(*args)
        seconds = time.perf_counter() - began
    return posterior, seconds, len(caught)


def logistic(d: int, batch: int, dtype):
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(d, dtype=dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=batch) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])

    return model


def part_one(lines: list[str]) -> None:
    lines += [
        "## 1. Four GLMs (N = 2,000, three features), against their exact posteriors",
        "",
        "| model | B | filter | largest mean error (sd) | sd / exact sd | seconds | warned |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for family in glms.FAMILIES:
        x, y = glms.data(family)
        mean, sd = glms.exact(family, x, y)
        for batch in (1000, 100, 10):
            for name, runner in RUNNERS.items():
                engine = runner(glms.model(family, batch), seed=0, progress_bar=False)
                posterior, seconds, warned = timed(engine, x, y)
                error = float(((posterior.mean[0] - mean) / sd).abs().max())
                ratio = posterior.variance[0].sqrt() / sd
                lines.append(
                    f"| {family} | {batch:,} | {name} | {error:.2f} | {float(ratio.min()):.2f}–"
                    f"{float(ratio.max()):.2f} | {seconds:.2f} | {'yes' if warned else 'no'} |"
                )
                log(f"part 1: {family} B={batch} {name}: {error:.2f} sd")
    lines.append("")


def part_two(lines: list[str]) -> None:
    g = torch.Generator().manual_seed(0)
    n, d = 100_000, 10
    x = torch.randn(n, d, generator=g)
    y = torch.bernoulli(torch.sigmoid(x @ torch.linspace(-1, 1, d)), generator=g)
    # the exact mode by Newton's method in float64, and the Laplace covariance there (N = 10⁵: the posterior)
    xd, yd, mean = x.double(), y.double(), torch.zeros(d, dtype=torch.float64)
    for _ in range(30):
        p = torch.sigmoid(xd @ mean)
        precision = (xd.T * (p * (1 - p))) @ xd + torch.eye(d, dtype=torch.float64)
        mean = mean + torch.linalg.solve(precision, xd.T @ (yd - p) - mean)
    sd = torch.linalg.inv(precision).diagonal().sqrt()
    lines += [
        "## 2. Ten coefficients (N = 100,000, float32), against the exact mode and the Laplace covariance there",
        "",
        "| B | method | largest mean error (sd) | sd / reference sd | seconds | warned |",
        "|---:|---|---:|---:|---:|---|",
    ]

    def row(batch: str, name: str, posterior_mean, variance, seconds: float, warned) -> None:
        error = float(((posterior_mean.double() - mean) / sd).abs().max())
        ratio = variance.double().sqrt() / sd
        lines.append(
            f"| {batch} | {name} | {error:.2f} | {float(ratio.min()):.3f}–{float(ratio.max()):.3f} | {seconds:.2f} | "
            f"{warned} |"
        )
        log(f"part 2: B={batch} {name}: {error:.2f} sd")

    model = logistic(d, 1000, torch.float32)
    began = time.perf_counter()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDelta(model)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.01 ** (1 / 2000)}), Trace_ELBO())
    for _ in range(2000):
        svi.step(x, y)
    point = {k: v.detach() for k, v in guide.median(x, y).items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        laplace = AutoLinearizedLaplace(model).laplace_approximation(x, y, structure="full", map_latents=point)
    variance = laplace.precision.to_dense().double().inverse().diagonal()
    name = "MAP by 2,000 SVI steps, then the full Laplace"
    row("1,000", name, laplace.mean, variance, time.perf_counter() - began, "yes" if caught else "no")
    for batch in (1000, 100):
        for name in ("defaults", "DiagonalEKF"):
            engine = RUNNERS[name](logistic(d, batch, torch.float32), seed=0, progress_bar=False)
            posterior, seconds, warned = timed(engine, x, y)
            row(f"{batch:,}", name, posterior.mean[0], posterior.variance[0], seconds, "yes" if warned else "no")
    lines.append("")


def part_three(lines: list[str]) -> None:
    from pyro.nn import PyroModule, PyroSample
    from sklearn.datasets import load_digits
    from torch import nn

    class MLP(PyroModule):
        def __init__(self):
            super().__init__()
            self.hidden = PyroModule[nn.Linear](64, 32)
            self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([32, 64]).to_event(2))
            self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([32]).to_event(1))
            self.out = PyroModule[nn.Linear](32, 10)
            self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([10, 32]).to_event(2))
            self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([10]).to_event(1))

        def forward(self, x, y=None):
            data = pyro.plate("data", x.shape[0], subsample_size=min(100, x.shape[0]))
            logits = self.out(torch.tanh(self.hidden(x[data.indices])))
            with data:
                return pyro.sample("y", dist.Categorical(logits=logits), obs=None if y is None else y[data.indices])

    digits = load_digits()
    order = torch.randperm(len(digits.data), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(digits.target)[order]
    x_train, y_train, x_test, y_test = x[:1200], y[:1200], x[1200:], y[1200:]
    net = MLP()

    def scores(probs):
        probs = probs.double()
        nll = float(-probs[torch.arange(len(y_test)), y_test].clamp_min(1e-300).log().mean())
        return float((probs.argmax(-1) == y_test).double().mean()), nll

    lines += [
        "## 3. A network: the digits MLP (2,410 weights, 12 minibatches per pass)",
        "",
        "| method | seconds | test accuracy | test NLL | warned |",
        "|---|---:|---:|---:|---|",
    ]
    engines = {
        "EKF defaults (d > 2,048: diagonal)": EKF(net, start="sample", seed=0, progress_bar=False),
        "EKF covariance='dense'": EKF(net, covariance="dense", start="sample", seed=0, progress_bar=False),
        "before (diag, ef, 1 it.)": RUNNERS["before (diag, ef, 1 it.)"](
            net, start="sample", seed=0, progress_bar=False
        ),
    }
    for name, engine in engines.items():
        posterior, seconds, warned = timed(engine, x_train, y_train)
        accuracy, nll = scores(posterior.predict(x_test).distribution.probs)
        lines.append(
            f"| {name}, one pass from a prior draw | {seconds:.1f} | {accuracy:.3f} | {nll:.3f} | "
            f"{'yes' if warned else 'no'} |"
        )
        log(f"part 3: {name}: {accuracy:.3f}")
    began = time.perf_counter()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDelta(net)
    svi = SVI(net, guide, pyro.optim.ClippedAdam({"lr": 3e-3, "lrd": 0.1 ** (1 / 1500)}), Trace_ELBO())
    for _ in range(1500):
        svi.step(x_train, y_train)
    point = {k: v.detach() for k, v in guide.median(x_train, y_train).items()}
    laplace = AutoLinearizedLaplace(net).laplace_approximation(
        x_train, y_train, structure="diag", map_latents=point, check_map=False
    )
    laplace.optimize_prior_precision()
    seconds = time.perf_counter() - began
    accuracy, nll = scores(laplace.predict(x_test).distribution.probs)
    lines.append(
        f"| MAP (1,500 SVI steps) + diagonal Laplace, evidence-tuned | {seconds:.1f} | {accuracy:.3f} | {nll:.3f} | |"
    )
    lines.append("")


def part_four(lines: list[str]) -> None:
    lines += [
        "## 4. The dense filter's cost against d (logistic regression, N = 2,000, B = 100)",
        "",
        "| d | dense: ms per evaluation | diagonal: ms per evaluation | dense / diagonal |",
        "|---:|---:|---:|---:|",
    ]
    for d in (256, 1024, 2048):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2000, d, generator=g) / d**0.5
        y = torch.bernoulli(torch.sigmoid(x @ torch.randn(d, generator=g)), generator=g)
        per = {}
        for covariance in ("dense", "diagonal"):
            engine = EKF(logistic(d, 100, torch.float32), covariance=covariance, seed=0, progress_bar=False)
            timed(engine, x, y)
            per[covariance] = 1000 * engine.stats["filter_seconds"] / engine.stats["evaluations"]
        lines.append(f"| {d:,} | {per['dense']:.1f} | {per['diagonal']:.1f} | {per['dense'] / per['diagonal']:.0f} |")
        log(f"part 4: d={d}: {per}")
    lines.append("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ekf.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warm_up_torch()
    lines = ["# The EKF: accuracy and cost", "", "`python benchmarks/bench_ekf.py`", "", *machine(1), ""]
    part_one(lines)
    part_two(lines)
    part_three(lines)
    part_four(lines)
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
