"""Why the hierarchies mixed badly: warm-up's metric against the exact posterior covariance, two rules side by side.

    python benchmarks/studies/diagnose_metric.py          # about 8 minutes on 2 CPU cores (two NUTS references first)

For the partial-pooling and the non-centred hierarchical logistic regressions of the ``hierarchies`` suite: a
reference covariance Σ of the unconstrained latents from Pyro's NUTS (1,000 warm-up, 2,000 draws, full batch), then
``StochasticMCMC(SGHMC(model, control_variate=None), metric="dense")``, 4 chains × (1,000 + 1,000), with warm-up's
dense metric chosen by

* ``hessian`` — the package's rule: the inverse Hessian at every stage's window mean, floored by the chains' spread;
* ``pooled`` — the rule before 2026-11-26: the inverse Hessian at the first stage (floored by the spread, as now;
  then it was clamped at 10⁻⁸ of its largest eigenvalue), the chains' pooled positions (shrunk towards the
  diagonal) at the later ones;
* ``oracle`` — Σ itself at every stage (what no run has: the limit of a metric's help).

It prints, per model and rule, the range of the eigenvalues of L⁻¹ΣL⁻ᵀ for the final metric L (1 everywhere: a
perfect metric; 100 along a direction: the metric 100 times too narrow in variance there), and the run's split
r_hat and smallest ESS over the unconstrained coordinates. The control variate is off so that the metric alone is
compared. Writes ``benchmarks/results/metric.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness and the bench_* scripts

import argparse
import warnings

import pyro
import torch
from harness import log, machine, write_report
from pyro.infer import MCMC, NUTS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.metrics import diagnose  # noqa: E402
from benchmarks.problems import hierarchical_logistic, partial_pooling, unconstrained  # noqa: E402
from pyro_scalable.infer import SGHMC, StochasticMCMC  # noqa: E402
from pyro_scalable.infer.sgmcmc import metric  # noqa: E402

RULES = ("hessian", "pooled", "oracle")


def reference(model, data) -> dict[str, torch.Tensor]:
    """NUTS draws of every latent site, unconstrained and flattened: (draws, size) each."""

    def full(*args):
        return model(*args, batch=None)

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(full), num_samples=2000, warmup_steps=1000, disable_progbar=True)
    mcmc.run(*data)
    return {name: unconstrained(full, data, {name: value}, 1)[0] for name, value in mcmc.get_samples().items()}


def pooled_rule(self, like, hessian=None):
    """The rule before 2026-11-26: the Hessian at the first stage only (floored as now), the pooled positions after."""
    if self.stage == 0:
        return original(self, like, hessian)
    return original(self, like, None)


def oracle_rule(covariance):
    def rule(self, like, hessian=None):
        original(self, like, None)  # the window's mean and the stage's bookkeeping; the scale is replaced
        self.affine = metric.AffineMap(self.window_mean, torch.linalg.cholesky(covariance).to(like))
        return self.affine

    return rule


original = metric.MetricSchedule.next_map


def run(model, data, rule: str, refs: dict[str, torch.Tensor]) -> dict:
    def covariance_in(names):
        return torch.cov(torch.cat([refs[name] for name in names], -1).T)

    if rule == "pooled":
        metric.MetricSchedule.next_map = pooled_rule
    elif rule == "oracle":

        def oracle(self, like, hessian=None):
            return oracle_rule(covariance_in(self.layout.shapes))(self, like, hessian)

        metric.MetricSchedule.next_map = oracle
    try:
        mcmc = StochasticMCMC(
            SGHMC(model, control_variate=None),
            num_samples=1000,
            num_warmup=1000,
            num_chains=4,
            seed=0,
            progress_bar=False,
            metric="dense",
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcmc.run(*data)
    finally:
        metric.MetricSchedule.next_map = original
    order = list(mcmc._schedule.layout.shapes)
    scale = mcmc.metric_map.scale.double()
    sigma = covariance_in(order)
    whitened = torch.linalg.solve_triangular(
        scale, torch.linalg.solve_triangular(scale, sigma, upper=False).T, upper=False
    )
    eig = torch.linalg.eigvalsh(0.5 * (whitened + whitened.T))
    samples = mcmc.get_samples(group_by_chain=True)
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in samples.items()}
    ess, r_hat = diagnose(torch.cat([unconstrained(model, data, {k: flat[k]}, 4) for k in order], -1))
    return {"low": float(eig.min()), "high": float(eig.max()), "ess": ess, "r_hat": r_hat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "metric.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = [
        "# Warm-up's dense metric against the exact posterior covariance",
        "",
        "Command: `python benchmarks/studies/diagnose_metric.py`",
        "",
        *machine(args.threads),
        "",
        "| model | rule | eigenvalues of L⁻¹ΣL⁻ᵀ (1: exact) | r_hat | min ESS |",
        "|---|---|---|---:|---:|",
    ]
    for build in (partial_pooling, hierarchical_logistic):
        name, model, data = build()
        log(f"{name}: NUTS reference")
        refs = reference(model, data)
        for rule in RULES:
            out = run(model, data, rule, refs)
            log(f"  {rule}: {out}")
            report.append(
                f"| {name} | {rule} | {out['low']:.3g} – {out['high']:,.3g} | {out['r_hat']:.3f} | {out['ess']:.0f} |"
            )
    write_report("\n".join(report) + "\n", args.out)


if __name__ == "__main__":
    main()
