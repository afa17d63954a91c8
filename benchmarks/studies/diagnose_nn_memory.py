"""Does K chains' memory scale with the random part only? Peak memory of SGHMC on a network with a fixed backbone.

A ``BayesianNetwork`` over an MLP whose hidden layers are fixed (d_F parameters) and whose last layer is random
(d_R), sampled by ``StochasticMCMC(SGHMC(model), num_chains=K)`` (one ``torch.func.vmap`` over chains): the peak
resident memory of ``run`` above the memory before it, against the fixed part's size × K, which a run holding K
copies of the network would need at least. For contrast (``--all-random``), the same network with every parameter
random, where K copies are the point. Each cell runs in its own process with every block of 128 KB or more mapped
on its own (``MALLOC_MMAP_THRESHOLD_=131072``), so that resident memory is memory in use; one torch thread.

    python benchmarks/studies/diagnose_nn_memory.py                 # width 2048, K = 1, 2, 4, 8: ~2 min
    python benchmarks/studies/diagnose_nn_memory.py --width 1024 --chains 1 4

Prints a Markdown table (docs/nn.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

MB = 2**20


def _rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _peak() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024


def worker(width: int, chains: int, random: str, samples: int) -> dict:
    import warnings

    import torch
    from torch import nn

    from pyro_scalable.infer import SGHMC, StochasticMCMC
    from pyro_scalable.nn import BayesianNetwork

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, 10),
    )
    x, y = torch.randn(2_000, 64), torch.randint(0, 10, (2_000,))
    model = BayesianNetwork(net, "categorical", random=random, prior_center="pretrained", batch_size=32)
    fixed = sum(t.numel() * t.element_size() for t in model.fixed.values()) / MB
    random_mb = model.num_random() * 4 / MB
    kernel = SGHMC(model, step_size=1e-6, friction=1.0, init_strategy=model.init_to_pretrained)
    mcmc = StochasticMCMC(kernel, num_samples=samples, num_warmup=5, num_chains=chains, seed=0, progress_bar=False)
    before = _rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    mcmc.run(x, y)
    return {"fixed_mb": fixed, "random_mb": random_mb, "peak_above_mb": _peak() - before, "before_mb": before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--all-random", type=int, nargs="*", default=[], metavar="K",
        help="also these K with every parameter random (GBs at width 2048: e.g. --width 1024 --all-random 1 4)",
    )  # fmt: skip
    parser.add_argument("--worker", nargs=4, metavar=("WIDTH", "K", "RANDOM", "SAMPLES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        width, chains, random, samples = args.worker
        print(json.dumps(worker(int(width), int(chains), random, int(samples))))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    print(f"width {args.width}, minibatch 32, SGHMC, 5 warm-up steps; MB = 2^20 bytes\n")
    print("| random | K | draws kept | fixed part × K (MB) | random part × K (MB) | peak above before `run` (MB) |")
    print("|---|---|---|---|---|---|")
    cells = [("last_layer", 20, k) for k in args.chains] + [("all", 1, k) for k in args.all_random]
    for random, samples, chains in cells:
        command = [sys.executable, __file__, "--worker", str(args.width), str(chains), random, str(samples)]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        cell = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {random} | {chains} | {samples} | {cell['fixed_mb'] * chains:.1f} | "
            f"{cell['random_mb'] * chains:.2f} | {cell['peak_above_mb']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
