"""A run's fixed cost: what one ``StochasticMCMC(SGHMC(model))`` run spends outside its steps, and the ArviZ export.

    python benchmarks/diagnose_fixed_cost.py                  # N = 1e6, 4 chains x (500 + 500) steps; export at 2e5
    python benchmarks/diagnose_fixed_cost.py --n 1e5 --out /tmp/fixed.md

Part 1 times the fixed parts of one run on logistic regression (d = 10, B = 1,000, every default) by wrapping the
functions that do them, each timed on its own (a part nested in another is reported within it): binding the model
(tracing it, its checks, the support check of the observed values over the full data), the chains' initial values
(a trace of the model each), recording the log joint as a graph (first call of each signature), the control variate
(the mode search and its full-data gradient), the post-run health checks (repeated draws, r_hat, ESS), the noise
probe, and torch's one-time import of ``torch._dynamo``, which ``torch.func.grad`` and ``make_fx`` trigger on their
first call in a process (within the part that triggered it; counted as fixed also where a step triggered it). The
rest is the steps. A second run in the same process shows what a repeat costs. The table also gives the mode
search's full-data and subsample passes (``mcmc.mode_search``).

Part 2 times ``to_inference_data`` on a run of 4 chains x ``--export-draws`` draws at ``--export-n`` data points:
its wall time and the peak resident memory above what the process held before (``VmHWM`` reset), with the size of
the log-likelihood group it returns. Run without part 2, the report keeps the part-2 section (from its heading
``## to_inference_data``) of the file it replaces.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from bench_accuracy import make  # benchmarks/ is on sys.path
from harness import load_average, log, machine, peak_mb, release_free_memory, reset_peak, rss_mb, write_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pyro_scalable.bridge.model as bridge_model  # noqa: E402
import pyro_scalable.bridge.traced as traced  # noqa: E402
import pyro_scalable.infer.sgmcmc.phases as phases  # noqa: E402
from pyro_scalable import to_inference_data  # noqa: E402
from pyro_scalable.infer import SGHMC, StochasticMCMC  # noqa: E402

PARTS = {  # (module, attribute): what it is
    (phases, "bind"): "binding the model: tracing, checks (the support check below included)",
    (bridge_model, "check_observed_values"): "  support check of the observed values over the full data",
    (bridge_model.ModelBridge, "init_latents"): "chains' initial values (one trace of the model through Pyro each)",
    (traced.TracedLogDensity, "_record"): "recording the log joint as a graph (each call signature once)",
    (phases, "attach"): "control variate: mode search and its full-data gradient",
    (phases, "repeated_draws"): "health: repeated draws",
    (phases, "warn_unhealthy"): "health: r_hat, ESS, divergences",
    (phases, "probe_gradient_noise"): "noise probe",
}


UNION = "union"  # the wall time of the outermost parts: a part nested in another counts once
FIRST = "  of which the process's first recording (one-time: torch's make_fx imports and warms up)"
DYNAMO = (
    "torch's one-time import of torch._dynamo (the process's first torch.func gradient or make_fx; "
    "counted in the part that triggers it)"
)


class _TimedImport(importlib.abc.MetaPathFinder):
    """Times the one import of ``name`` in this process (its module's execution, the modules it imports included)."""

    def __init__(self, name: str, done):
        self.name, self.done = name, done

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        execute = spec.loader.exec_module

        def timed(module):
            start = time.perf_counter()
            try:
                execute(module)
            finally:
                self.done(time.perf_counter() - start)

        spec.loader.exec_module = timed
        return spec


def instrument(seconds: dict[str, float]) -> None:
    depth, first = [0], [False]
    for (owner, name), label in PARTS.items():
        original = getattr(owner, name)

        def timed(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
                elapsed = time.perf_counter() - start
                seconds[_label] += elapsed
                if _label == PARTS[(traced.TracedLogDensity, "_record")] and not first[0]:
                    first[0] = True
                    seconds[FIRST] += elapsed
                if depth[0] == 0:
                    seconds[UNION] += elapsed

        setattr(owner, name, timed)

    def imported(elapsed: float) -> None:
        seconds[DYNAMO] += elapsed
        if depth[0] == 0:  # outside every timed part (a step): a fixed cost all the same
            seconds[UNION] += elapsed

    if "torch._dynamo" not in sys.modules:
        sys.meta_path.insert(0, _TimedImport("torch._dynamo", imported))


def one_run(problem, num_samples: int, seed: int) -> tuple[StochasticMCMC, float]:
    start = time.perf_counter()
    mcmc = StochasticMCMC(
        SGHMC(problem.model(subsample=True)),
        num_samples=num_samples,
        num_warmup=500,
        num_chains=4,
        seed=seed,
        progress_bar=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(problem.x, problem.y)
    return mcmc, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=float, default=1e6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=2, help="runs in one process (the second: what a repeat costs)")
    parser.add_argument("--parts", default="1,2", help="1: the run's fixed parts, 2: to_inference_data")
    parser.add_argument("--export-n", type=float, default=2e5)
    parser.add_argument("--export-draws", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fixed_cost.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seconds: dict[str, float] = defaultdict(float)
    instrument(seconds)
    report = [
        f"# A run's fixed cost: SGHMC(model) at the defaults, logistic regression d = 10, N = {args.n:.0e}, "
        "4 chains x (500 warm-up + 500) steps; to_inference_data's log-likelihood",
        "",
        f"Command: `python {' '.join(['benchmarks/diagnose_fixed_cost.py', *sys.argv[1:]])}`",
        "",
        *machine(args.threads),
        "",
    ]
    wanted = args.parts.split(",")
    if "1" in wanted:
        problem = make("logistic", int(args.n), 10, 1000)
        report += ["| part | " + " | ".join(f"run {i + 1} (s) | share" for i in range(args.runs)) + " |"]
        report += ["|---|" + "---:|---:|" * args.runs]
        runs, searches = [], []
        for seed in range(args.runs):
            seconds.clear()
            mcmc, total = one_run(problem, 500, seed)  # 500 warm-up + 500 kept steps
            runs.append((total, dict(seconds)))
            searches.append(mcmc.mode_search)
            log(f"run {seed}: {total:.1f} s, {dict(seconds)}, {mcmc.mode_search} (load {load_average()})")
        labels = list(PARTS.values())
        labels.insert(labels.index(PARTS[(traced.TracedLogDensity, "_record")]) + 1, FIRST)
        labels.insert(0, DYNAMO)
        for label in labels:
            cells = [f"{parts.get(label, 0.0):.2f} | {parts.get(label, 0.0) / total:.1%}" for total, parts in runs]
            report.append(f"| {label} | {' | '.join(cells)} |")
        fixed = [parts.get(UNION, 0.0) for _, parts in runs]
        report.append(
            "| **fixed parts together** (a part nested in another, e.g. recording in the mode search, counted once) | "
            + " | ".join(f"**{f:.2f}** | **{f / t:.1%}**" for f, (t, _) in zip(fixed, runs, strict=True))
            + " |"
        )
        report.append("| the whole run | " + " | ".join(f"{t:.2f} | 100% " for t, _ in runs) + " |")
        report.append(
            "| mode search: full-data passes (+ subsample passes) | "
            + " | ".join(
                " | " if s is None else f"{s.full_passes} (+ {getattr(s, 'subsample_passes', 0)}) | " for s in searches
            )
            + " |"
        )
        report += ["", f"Load average after part 1: {load_average()}.", ""]
        del problem

    if "2" in wanted:
        problem = make("logistic", int(args.export_n), 10, 1000)
        mcmc, _ = one_run(problem, args.export_draws, 2)
        release_free_memory()
        before = rss_mb()
        reset_peak()
        start = time.perf_counter()
        idata = to_inference_data(mcmc)
        took = time.perf_counter() - start
        peak = peak_mb() - before
        values = idata["log_likelihood"]["obs"].values
        report += [
            "## to_inference_data's log-likelihood",
            "",
            f"to_inference_data on 4 x {args.export_draws} draws at N = {args.export_n:.0e}: {took:.2f} s, "
            f"peak resident memory +{peak:.0f} MB above the {before:.0f} MB held before; "
            f"the log_likelihood group is {values.dtype}, {values.nbytes / 2**20:.0f} MB "
            f"(load average {load_average()}).",
            "",
        ]
    elif args.out.exists() and "\n## to_inference_data" in args.out.read_text():
        report += ["## to_inference_data" + args.out.read_text().split("\n## to_inference_data", 1)[1]]
    write_report("\n".join(report), args.out)


if __name__ == "__main__":
    main()
