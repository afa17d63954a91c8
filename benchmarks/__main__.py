"""``python -m benchmarks run <suite> | render [--check] | list | posteriordb ... | zoo-seeds ...``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

import torch

from benchmarks import engines, harness, posteriordb, problems, records, render, zoo
from benchmarks.suites import SUITES

DEVICE_SUITES = ("sgmcmc-step", "step-blackjax")  # the suites whose engines run on --device


def _run_cell(engine: engines.Engine, cell: engines.Cell, base: dict) -> dict:
    record = {**base, "problem": cell.problem.name if cell.problem else None, "n": cell.n, "engine": engine.name}
    record.update(seed=cell.seed, budget=cell.budget, date=records.now())
    absent = engines.missing(engine)
    if absent:
        return {**record, "status": "skipped", "reason": f"not installed: {', '.join(absent)}"}
    cell.prepare(engine.family)
    for name in ("pyro_scalable.infer", *engine.needs):  # a one-time import is no part of the cell's time or memory
        importlib.import_module(name)
    harness.release_free_memory()
    before = harness.rss_mb()
    harness.reset_peak()
    probe = harness.ForeignLoad(children=True)  # an engine's own worker processes are not other processes
    start_load = [round(v, 2) for v in os.getloadavg()]
    try:
        found = engine.run(cell)
        record.update(status="ok", metrics=found)
    except Exception as error:  # a failed cell is a result: the page shows it with its reason
        traceback.print_exc(file=sys.stderr)
        record.update(status="failed", reason=f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")
    foreign = probe.cores()
    record.update(
        peak_mb=round(harness.peak_mb() - before, 1),
        load={"start": start_load, "end": [round(v, 2) for v in os.getloadavg()]},
        foreign_cores=None if foreign is None else round(foreign, 2),
    )
    return record


def run(args: argparse.Namespace) -> None:
    suite = SUITES[args.suite]
    torch.set_num_threads(args.threads)
    only = set(args.only.split(",")) if args.only else None
    if args.device != "cpu":  # the step-cost engines put their problems on it; the others run on the CPU only
        assert suite.name in DEVICE_SUITES, f"--device {args.device}: only the suites {', '.join(DEVICE_SUITES)}"
        problems.DEVICE = torch.device(args.device)
    base = records.stamp(args.threads, args.device)
    shared: dict = {}
    for problem_name, n, engine_name in suite.cells(args.size):
        if only and engine_name not in only and str(problem_name) not in only:
            continue
        problem = problems.PROBLEMS[problem_name] if problem_name else None
        cell = engines.Cell(problem, n, args.seed, args.budget or suite.budget, shared, args.size)
        start = time.perf_counter()
        harness.log(f"{suite.name}: {problem_name} n={n} {engine_name} ...")
        record = _run_cell(engines.ENGINES[engine_name], cell, base)
        records.append(suite.name, record)
        keys = ("seconds", "accurate", "mean_error_sd", "nll")
        summary = record.get("reason") or {k: record["metrics"][k] for k in keys if k in record["metrics"]}
        harness.log(f"    {record['status']} in {time.perf_counter() - start:.1f} s: {summary}")
    harness.log(f"written to {records.path(suite.name).relative_to(records.ROOT)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    go = commands.add_parser("run", help="run a suite's cells and append one record per cell")
    go.add_argument("suite", choices=sorted(SUITES))
    go.add_argument("--size", choices=("smoke", "full"), default="smoke")
    go.add_argument("--budget", type=float, default=None, help="seconds per cell for ours' doubling runs")
    go.add_argument("--only", default="", help="comma-separated engines or problems")
    go.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--device", default="cpu", help=f"where {' and '.join(DEVICE_SUITES)} run, e.g. cuda")
    show = commands.add_parser("render", help="rewrite docs/benchmarks.md's tables from the latest records")
    show.add_argument("--check", action="store_true", help="only say whether the page is current (exit 1 if not)")
    commands.add_parser("list", help="the suites and their cells")
    posteriordb.add_commands(commands.add_parser("posteriordb", help="every engine on posteriordb's posteriors"))
    zoo.add_arguments(commands.add_parser("zoo-seeds", help="the default kernels on the test zoo over many seeds"))
    worker = commands.add_parser("_data_parallel")  # one torchrun rank of the distributed suite (internal)
    worker.add_argument("spec", type=json.loads, help="engines.data_parallel_worker's arguments as a JSON object")
    args = parser.parse_args(argv)
    if args.command == "_data_parallel":
        engines.data_parallel_worker(**args.spec)
    elif args.command == "run":
        run(args)
    elif args.command == "posteriordb":
        posteriordb.main(args)
    elif args.command == "zoo-seeds":
        zoo.main(args)
    elif args.command == "render":
        if args.check:
            text = render.PAGE.read_text(encoding="utf-8")
            current = render.render_page(text) == text
            print("current" if current else "stale: run `python -m benchmarks render`")
            return 0 if current else 1
        print("rewritten" if render.write() else "already current")
    else:
        for suite in SUITES.values():
            print(f"{suite.name}: {suite.title}")
            for size in suite.sizes:
                print(f"  {size}: " + ", ".join(f"{p or '-'}@{n}" for p, n in suite.sizes[size]))
            print("  engines: " + ", ".join(suite.engines))
        print("posteriordb: every engine at its defaults on posteriordb's 32 posteriors (run, advised, report)")
        print("zoo-seeds: the default kernels on the test zoo over seeds (a Markdown report; --cells: records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
