"""Check the posteriordb ports against their reference draws: ``python scripts/posteriordb_check_ports.py``.

Each port of ``tests/posteriordb`` (or those named with ``--posteriors``) runs Pyro's NUTS on the full data
(``FullDataModel``: subsampling off), float64, ``--chains`` chains of ``--warmup`` + ``--samples`` steps (4 x (500 +
1,000) unless :data:`LONGER` gives a port more), a dense mass matrix, the potential JIT-compiled, one chain after
another on one thread. A port passes when every Stan parameter's mean is within 0.25 reference sd of posteriordb's
reference mean and its sd within 0.8-1.25 reference sds (``tests.posteriordb.errors``). Writes per port, beside the
earlier ones, ``tests/posteriordb/ports_checked.json`` (passed, the worst mean error in reference sds and sd ratio and
where, the largest rank-normalised r_hat and least bulk ESS over Stan's parameters, divergences, seconds, the NUTS
settings) and renders ``benchmarks/results/posteriordb_ports.md`` from it (``--render`` renders only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.posteriordb import CHECKED, MEAN_TOLERANCE, POSTERIORS, SD_RATIO, errors  # noqa: E402

TABLE = ROOT / "benchmarks" / "results" / "posteriordb_ports.md"
COMMAND = "python scripts/posteriordb_check_ports.py"
LONGER: dict[str, dict[str, int]] = {}  # name -> the warm-up / draws a port needs beyond the defaults, and why
REASONS: dict[
    str, str
] = {}  # name -> why a port that fails its check is kept failing (none is fixed by running longer)


def run_nuts(name: str, chains: int, warmup: int, samples: int, seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """Pyro's NUTS on the port's full data: draws by site, ``(chains, samples, ...)``, and the divergences."""
    import pyro
    from pyro.infer import MCMC, NUTS

    from pyro_scalable.bridge.plates import FullDataModel

    posterior = POSTERIORS[name]
    args = posterior.args(torch.float64)
    runs, divergences = [], 0
    for chain in range(chains):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed + chain)
        kernel = NUTS(FullDataModel(posterior.model), full_mass=True, jit_compile=True, ignore_jit_warnings=True)
        mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, disable_progbar=True)
        mcmc.run(*args)
        runs.append(mcmc.get_samples())
        divergences += len(mcmc.diagnostics()["divergences"]["chain 0"])
    return {site: torch.stack([run[site] for run in runs]) for site in runs[0]}, divergences


def diagnostics(posterior, samples: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest rank-normalised r_hat and the least bulk ESS over the port's Stan parameters (ArviZ's)."""
    import arviz as az

    draws = {name: value.detach().double().numpy() for name, value in posterior.stan_draws(samples).items()}
    r_hat = max(float(az.rhat(value)) for value in draws.values())
    ess = min(float(az.ess(value, method="bulk")) for value in draws.values())
    return {"r_hat": r_hat, "ess_bulk": ess}


def check(name: str, chains: int, warmup: int, samples: int, seed: int) -> dict:
    """Run the check of one port and return its record."""
    settings = {"chains": chains, "warmup": warmup, "samples": samples} | LONGER.get(name, {})
    start = time.perf_counter()
    draws, divergences = run_nuts(name, settings["chains"], settings["warmup"], settings["samples"], seed)
    seconds = time.perf_counter() - start
    posterior = POSTERIORS[name]
    record = errors(posterior, draws) | diagnostics(posterior, draws)
    record |= {"divergences": divergences, "seconds": round(seconds, 1)}
    record["nuts"] = settings | {
        "seed": seed,
        "kernel": "pyro.infer.NUTS(FullDataModel(model), full_mass=True, jit_compile=True)",
        "dtype": "float64",
        "target_accept_prob": 0.8,
        "max_tree_depth": 10,
    }
    if not record["passed"]:
        record["reason"] = REASONS.get(name, "not yet explained")
    return record


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def render(record: dict) -> str:
    """The markdown table of the check's record."""
    lines = [
        "# posteriordb ports: Pyro's NUTS against posteriordb's reference draws",
        "",
        f"`{COMMAND}` on {record['machine']} (each port's commit is in `tests/posteriordb/ports_checked.json`). "
        f"Pass: every Stan parameter's mean within {MEAN_TOLERANCE} reference sd of posteriordb's reference mean and "
        f"its sd {SD_RATIO[0]}-{SD_RATIO[1]} times the reference sd. Pyro's NUTS on the full data, float64, a dense "
        "mass matrix, the potential JIT-compiled, the chains one after another on one thread of a shared machine "
        "under `nice` (the seconds include its load: the load average at each port's start is in the record).",
        "",
        "| posterior | kind | data plate (B) | passed | worst mean error (sd) | worst sd ratio | r_hat | least ESS "
        "| divergences | NUTS chains x (warm-up + draws) | seconds |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, posterior in POSTERIORS.items():
        port = record["ports"].get(name)
        plate = f"yes ({posterior.batch_size})" if posterior.has_data_plate else "no"
        if port is None:
            lines.append(f"| {name} | {posterior.kind} | {plate} | not run | | | | | | | |")
            continue
        nuts = port["nuts"]
        passed = "yes" if port["passed"] else f"no: {port['reason']}"
        lines.append(
            f"| {name} | {posterior.kind} | {plate} | {passed} | {port['mean_error']:.3f} ({port['mean_error_at']}) "
            f"| {port['sd_ratio']:.3f} ({port['sd_ratio_at']}) | {port['r_hat']:.3f} | {port['ess_bulk']:.0f} "
            f"| {port['divergences']} | {nuts['chains']} x ({nuts['warmup']} + {nuts['samples']}) "
            f"| {port['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Check the ports named (default: all) and write the record and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--posteriors", nargs="*", default=list(POSTERIORS))
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", type=Path, default=CHECKED, help="where the record is kept (merged into)")
    parser.add_argument("--render", action="store_true", help="render the table from the record only")
    options = parser.parse_args()
    torch.set_num_threads(1)
    record = json.loads(options.record.read_text()) if options.record.exists() else {"ports": {}}
    if not options.render:
        record |= {"command": COMMAND, "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
        for name in options.posteriors:
            start = {"commit": _commit(), "load_average_at_start": round(os.getloadavg()[0], 2)}
            record["ports"][name] = check(name, options.chains, options.warmup, options.samples, options.seed) | start
            options.record.write_text(json.dumps(record, indent=1) + "\n")
            port = record["ports"][name]
            print(
                f"{name}: passed={port['passed']} mean {port['mean_error']:.3f} sd {port['sd_ratio']:.3f} "
                f"r_hat {port['r_hat']:.3f} {port['seconds']:.0f} s",
                flush=True,
            )
    TABLE.write_text(render(record))


if __name__ == "__main__":
    main()
