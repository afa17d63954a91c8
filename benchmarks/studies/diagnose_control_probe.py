"""The share of the plain gradient noise a control variate ``"auto"`` chose leaves, per model and seed.

    python benchmarks/studies/diagnose_control_probe.py --out benchmarks/results/control_probe.md

After a run whose control variate ``"auto"`` centred at the mode, the driver measures at the chains' final draws the
spread of the controlled minibatch gradient as a share of the plain one's
(``pyro_scalable/infer/sgmcmc/control_probe.py``) and warns above one half. This runs ``StochasticMCMC(SGHMC(model))``
at its defaults (4 chains × (300 + 200) steps) on every model of the test zoo (``tests/model_zoo.py``) where ``"auto"``
chooses the mode, on the peers benchmark's 50-group hierarchy (``benchmarks/studies/bench_accuracy.py``) and on a 3-8-1
tanh network (``tests/infer/sgmcmc/test_control_probe.py``), and reports the share each seed's run measured (the same
function, on the run's final draws; also for a centre at warm-up's window means, which the driver does not check) and
how many runs warned.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness and the bench_* scripts

import argparse
import time
import warnings

import torch
from bench_accuracy import make
from harness import load_average, log, machine, write_report

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pyro_scalable.bridge import ModelBridge  # noqa: E402
from pyro_scalable.infer import SGHMC, StochasticMCMC  # noqa: E402
from pyro_scalable.infer.gradients import ControlledDensity  # noqa: E402
from pyro_scalable.infer.sgmcmc.control_probe import WORTH, controlled_noise_share  # noqa: E402
from tests.infer.sgmcmc.test_control_probe import _network, _network_data  # noqa: E402
from tests.model_zoo import ZOO, zoo_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "control_probe.md"
WARNING = "control_variate='auto' centred a control variate"


def cases(names: list[str]):
    for name in names:
        if name == "network-3-8-1":
            yield name, lambda: (_network, _network_data())
        elif name.startswith("hierarchy@"):
            problem = make("hierarchical", int(float(name.split("@")[1])), 10, 1000)
            yield name, lambda p=problem: (p.model(subsample=True), (p.x, p.y))
        else:
            yield name, lambda n=name: zoo_model(n)


def share_of(name: str, build, seed: int) -> tuple[str, bool]:
    model, args = build()
    mcmc = StochasticMCMC(SGHMC(model), num_samples=200, num_warmup=300, num_chains=4, seed=seed, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(*args)
    warned = any(WARNING in str(w.message) for w in caught)
    if mcmc.control_variate is None:
        return "–", warned, None
    chosen = "map" if mcmc.mode_search is not None else "warmup"  # "warmup" centres at the window means, no search
    bridge = ModelBridge(model, args)
    final = bridge.unconstrain({k: v[:, -1] for k, v in mcmc.get_samples(group_by_chain=True).items()})
    controlled = ControlledDensity(bridge.log_posterior_fn, mcmc.control_variate)
    return f"{controlled_noise_share(controlled, bridge, final, seed):.3g}", warned, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = [*ZOO, "hierarchy@1e4", "hierarchy@1e5", "network-3-8-1"]
    parser.add_argument("--models", default=",".join(default), help="comma-separated")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    rows = []
    for name, build in cases(args.models.split(",")):
        results = [share_of(name, build, seed) for seed in range(args.seeds)]
        if all(share == "–" for share, _, _ in results):
            log(f'{name}: no control variate ("auto" chose none)')
            continue
        shares = " ".join(share for share, _, _ in results)
        chosen = "/".join(sorted({c for _, _, c in results if c is not None}))
        rows.append(f"| {name} | `{chosen}` | {shares} | {sum(w for _, w, _ in results)}/{args.seeds} |")
        log(rows[-1])
    command = "python benchmarks/studies/diagnose_control_probe.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            '# The share of the plain gradient noise left by the control variate "auto" chose',
            "",
            f"Command: `{command.strip()}`",
            "",
            *machine(args.threads),
            f"- load average at the end {load_average()}; wall time {time.perf_counter() - began:.0f} s",
            f"- SGHMC at the defaults, 4 chains × (300 + 200) steps, seeds 0–{args.seeds - 1}; the driver warns above "
            f'{WORTH} where "auto" chose the mode (`map`), not for warm-up\'s window means (`warmup`); models where it '
            "chose no control variate are left out",
            "",
            '| model | centre "auto" chose | share per seed | runs that warned |',
            "|---|---|---|---:|",
            *rows,
            "",
        ]
    )
    write_report(text, args.out)


if __name__ == "__main__":
    main()
