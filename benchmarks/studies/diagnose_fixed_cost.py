"""A run's fixed cost: what one ``StochasticMCMC(SGHMC(model))`` run spends outside its steps, and the ArviZ export.

    python benchmarks/studies/diagnose_fixed_cost.py    # N = 1e6, 4 chains x (500 + 500) steps; export at 2e5
    python benchmarks/studies/diagnose_fixed_cost.py --n 1e5 --out /tmp/fixed.md

Part 1 times the fixed parts of one run on logistic regression (d = 10, B = 1,000, every default) by wrapping the
functions that do them, each timed on its own (a part nested in another is reported within it): binding the model
(tracing it, its checks, the support check of the observed values over the full data), the chains' initial values
(a trace of the model each), recording the log joint as a graph (first call of each signature), the control variate
(the mode search and its full-data gradient), the post-run health checks (repeated draws, r_hat, ESS), the noise
probe, and torch's one-time import of ``torch._dynamo``, which ``torch.func.grad`` triggers on its first call in a
process (within the part that triggered it; counted as fixed also where a step triggered it). The
rest is the steps. A second run in the same process shows what a repeat costs; ``--processes K`` repeats part 1 in
K fresh processes and gives each figure's median and range. The table also gives the mode search's exact Hessian
(where L-BFGS stopped, a pass over the data confirming the stop), torch's one-time import of the forward-mode
rules (none since the Hessian is plain autograd, d backward passes over the gradient: forward over reverse loaded
them), and the mode search's full-data and subsample passes (``mcmc.mode_search``).

Where ``torch._dynamo`` would come from (torch 2.13): torch imports it at the first gradient of any ``torch.func``
transform (``grad``, ``vjp``, ``jacrev``: its ``_autograd_grad`` enters ``torch._dynamo.compiled_autograd._disable()``),
and ``make_fx`` imports it (through ``torch._inductor.config``). A default run takes every gradient by plain autograd
outside the user's transforms (warm-up's noise and curvature for every chain at once, ``infer/gradients/batched.py``;
the metric's Hessian; the control probe) and records the log joint without ``make_fx`` (``bridge/recording.py``), so
its row reads 0 unless a change brings a transform back (``tests/test_imports.py`` checks a default run).

Part 2 times ``to_inference_data`` on a run of 4 chains x ``--export-draws`` draws at ``--export-n`` data points:
its wall time and the peak resident memory above what the process held before (``VmHWM`` reset), with the size of
the log-likelihood group it returns. Run without part 2, the report keeps the part-2 section (from its heading
``## to_inference_data``) of the file it replaces.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness and the bench_* scripts
from bench_accuracy import make  # noqa: E402
from harness import load_average, log, machine, peak_mb, release_free_memory, reset_peak, rss_mb, write_report  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pyro_scalable.bridge.model as bridge_model  # noqa: E402
import pyro_scalable.bridge.traced as traced  # noqa: E402
import pyro_scalable.infer.mode_search as mode_search  # noqa: E402
import pyro_scalable.infer.sgmcmc.phases as phases  # noqa: E402
from pyro_scalable import to_inference_data  # noqa: E402
from pyro_scalable.infer import SGHMC, StochasticMCMC  # noqa: E402

IMPORTED_AT_START = "torch._dynamo" in sys.modules  # before the first run: what the package's imports did

PARTS = {  # (module, attribute): what it is
    (phases, "bind"): "binding the model: tracing, checks (the support check below included)",
    (bridge_model, "check_observed_values"): "  support check of the observed values over the full data",
    (bridge_model.ModelBridge, "init_latents"): "chains' initial values (one trace of the model through Pyro each)",
    (traced.TracedLogDensity, "_record"): "recording the log joint as a graph (each call signature once)",
    (phases, "attach"): "control variate: mode search and its full-data gradient",
    (mode_search, "full_data_hessian"): "  of which the exact Hessian at the mode (d backward passes, plain autograd)",
    (phases, "repeated_draws"): "health: repeated draws",
    (phases, "warn_unhealthy"): "health: r_hat, ESS, divergences",
    (phases, "probe_gradient_noise"): "noise probe",
}


UNION = "union"  # the wall time of the outermost parts: a part nested in another counts once
FIRST = "  of which the process's first recording"
DYNAMO = (
    "torch's one-time import of torch._dynamo (at a process's first torch.func gradient, which a default run no "
    "longer takes; counted in the part that triggers it, as fixed also where a step triggers it)"
)
JVP_RULES = (
    "torch's one-time import of its forward-mode rules (torch._decomp.decompositions_for_jvp, compiled by "
    "TorchScript: the process's first torch.func.jvp or hessian)"
)
IMPORTS = {"torch._dynamo": DYNAMO, "torch._decomp.decompositions_for_jvp": JVP_RULES}


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

    def imported(label: str, elapsed: float) -> None:
        seconds[label] += elapsed
        if depth[0] == 0:  # outside every timed part (a step): a fixed cost all the same
            seconds[UNION] += elapsed

    for module, label in IMPORTS.items():
        if module not in sys.modules:
            sys.meta_path.insert(0, _TimedImport(module, lambda elapsed, _label=label: imported(_label, elapsed)))


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


def measure(args, seconds: dict[str, float]) -> list[dict]:
    """``args.runs`` runs in this process: each one's wall time, its parts' seconds and the mode search's passes."""
    problem = make("logistic", int(args.n), 10, 1000)
    runs = []
    for seed in range(args.runs):
        seconds.clear()
        mcmc, total = one_run(problem, 500, seed)  # 500 warm-up + 500 kept steps
        s = mcmc.mode_search
        passes = "" if s is None else f"{s.full_passes} (+ {getattr(s, 'subsample_passes', 0)})"
        runs.append({"total": total, "parts": dict(seconds), "passes": passes})
        log(f"run {seed}: {total:.1f} s, {dict(seconds)}, {s} (load {load_average()})")
    return runs


def spawn(args) -> list[dict]:
    """:func:`measure` in a fresh process (its first run pays the process's one-time costs again)."""
    command = [sys.executable, __file__, "--child", "--parts", "1", "--n", str(args.n), "--runs", str(args.runs)]
    command += ["--threads", str(args.threads)]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(values: list[float], shares: list[float]) -> str:
    """One figure, or over processes the median with the range."""
    if len(values) == 1 or min(shares) == max(shares):
        return f"{statistics.median(values):.2f}{_range(values)} | {shares[0]:.1%}"
    share = f"{statistics.median(shares):.1%} ({min(shares):.1%}-{max(shares):.1%})"
    return f"{statistics.median(values):.2f}{_range(values)} | {share}"


def _range(values: list[float]) -> str:
    return "" if len(values) == 1 else f" ({min(values):.2f}-{max(values):.2f})"


def table(processes: list[list[dict]], runs: int) -> list[str]:
    """The parts' table: a column pair per run in the process, each cell over the processes."""
    over = "" if len(processes) == 1 else f", median (range) over {len(processes)} fresh processes"
    rows = ["| part | " + " | ".join(f"run {i + 1} (s{over}) | share" for i in range(runs)) + " |"]
    rows += ["|---|" + "---:|---:|" * runs]
    labels = list(PARTS.values())
    labels.insert(labels.index(PARTS[(traced.TracedLogDensity, "_record")]) + 1, FIRST)
    labels[:0] = [DYNAMO, JVP_RULES]

    def row(label: str, pick) -> str:
        cells = []
        for i in range(runs):
            values = [pick(p[i]) for p in processes]
            cells.append(_cell(values, [v / p[i]["total"] for v, p in zip(values, processes, strict=True)]))
        return f"| {label} | {' | '.join(cells)} |"

    rows += [row(label, lambda r, _label=label: r["parts"].get(_label, 0.0)) for label in labels]
    together = "fixed parts together** (a part nested in another, e.g. recording in the mode search, counted once)"
    rows.append(row(f"**{together}", lambda r: r["parts"].get(UNION, 0.0)))
    rows.append(row("the whole run", lambda r: r["total"]))
    passes = [" / ".join(sorted({p[i]["passes"] for p in processes})) for i in range(runs)]
    rows.append(
        "| mode search: full-data passes (+ subsample passes) | " + " | ".join(f"{x} | " for x in passes) + " |"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=float, default=1e6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=2, help="runs in one process (the second: what a repeat costs)")
    parser.add_argument("--processes", type=int, default=1, help="part 1 in this many fresh processes (median, range)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="1,2", help="1: the run's fixed parts, 2: to_inference_data")
    parser.add_argument("--export-n", type=float, default=2e5)
    parser.add_argument("--export-draws", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "results" / "fixed_cost.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seconds: dict[str, float] = defaultdict(float)
    instrument(seconds)
    report = [
        f"# A run's fixed cost: SGHMC(model) at the defaults, logistic regression d = 10, N = {args.n:.0e}, "
        "4 chains x (500 warm-up + 500) steps; to_inference_data's log-likelihood",
        "",
        f"Command: `python {' '.join(['benchmarks/studies/diagnose_fixed_cost.py', *sys.argv[1:]])}`",
        "",
        *machine(args.threads),
        "",
        f"`import pyro_scalable` (every public name) imported torch._dynamo: {'yes' if IMPORTED_AT_START else 'no'}.",
        "",
    ]
    wanted = args.parts.split(",")
    if "1" in wanted:
        processes = [measure(args, seconds)] if args.processes == 1 else [spawn(args) for _ in range(args.processes)]
        if args.child:
            print(json.dumps(processes[0]))
            return
        report += table(processes, args.runs)
        report += ["", f"Load average after part 1: {load_average()}.", ""]

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
