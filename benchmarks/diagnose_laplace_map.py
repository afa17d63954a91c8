"""Can the Laplace benchmark's network reach a point the MAP check accepts, and what does the check cost there?

    python benchmarks/diagnose_laplace_map.py --out benchmarks/results/laplace_map_check.md
    python benchmarks/diagnose_laplace_map.py --finish 200 --reps 1    # a quick look

``bench_laplace.py`` times ``laplace_approximation(..., check_map=True)`` (the default) on a ReLU MLP 784-128-64-10
(109,386 weights, N = 10,000) trained by Adam and 100 L-BFGS steps; its MAP check then warns, and the check's
full-data GGN-vector products cost about three ``diag`` fits. Were the weights a MAP, the check would stop at its
free upper bound ½ bᵀP⁻¹b or after one product (``pyro_scalable/infer/linearized/map_check.py``). This asks
whether a user who trains longer gets there: it trains the same network the same way (same data, seeds, Adam
epochs and 100 L-BFGS steps in float32), then finishes in float64 with ``--finish`` more full-batch L-BFGS steps
(strong-Wolfe line search, tolerances far below float64's rounding of the loss), and at both points reports the
gradient of the log joint (its norm in float64), the negative log joint, the check's free bound and its verdict
(the lower bound on the Gauss-Newton gain where its iterations stopped, and how many GGN-vector products they took),
and the median time of ``diag`` and ``kron`` fits with and without the check (one process, one torch thread,
``--reps`` of each, interleaved; the first call of each kind untimed).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from bench_laplace import BIG, PRIOR, Ours, latents_of, network, teacher_data, train_map  # benchmarks/ on sys.path
from harness import load_average, log, machine, write_report
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, as the other scripts find it

RESULTS = Path(__file__).resolve().parent / "results" / "laplace_map_check.md"
NOT_A_MAP = "is not a MAP"


def _float64(net: nn.Module) -> nn.Module:
    """A float64 copy of the benchmark's network ``net``."""
    net64 = network(BIG).double()
    net64.load_state_dict({k: v.double() for k, v in net.state_dict().items()})
    return net64


def _loss(net64: nn.Module, x64, y):
    """The negative log joint of ``bench_laplace.train_map``, unscaled: sum cross-entropy + ½λ|θ|²."""
    penalty = 0.5 * PRIOR * sum(p.square().sum() for p in net64.parameters())
    return nn.functional.cross_entropy(net64(x64), y, reduction="sum") + penalty


def negative_log_joint(net: nn.Module, x, y) -> tuple[float, float]:
    """The negative log joint and its gradient's norm, both in float64."""
    net64 = _float64(net)
    loss = _loss(net64, x.double(), y)
    grads = torch.autograd.grad(loss, list(net64.parameters()))
    return float(loss.detach()), float(torch.sqrt(sum(g.square().sum() for g in grads)))


def finish_float64(net: nn.Module, x, y, steps: int) -> None:
    """``steps`` full-batch L-BFGS steps on the float64 negative log joint, written back into ``net``."""
    net64, x64 = _float64(net), x.double()
    optimizer = torch.optim.LBFGS(
        net64.parameters(), max_iter=steps, line_search_fn="strong_wolfe", tolerance_grad=1e-12, tolerance_change=1e-15
    )

    def closure():
        optimizer.zero_grad()
        loss = _loss(net64, x64, y)
        loss.backward()
        return loss

    optimizer.step(closure)
    net.load_state_dict({k: v.float() for k, v in net64.state_dict().items()})


def _count_products(net) -> list[int]:
    """Count the calls of ``net.ggn_vp`` (the check's full-data GGN-vector products) in the returned list."""
    count, inner = [0], net.ggn_vp

    def counted(*args, **kwargs):
        count[0] += 1
        return inner(*args, **kwargs)

    net.ggn_vp = counted
    return count


def measure(net: nn.Module, x, y, reps: int) -> dict:
    problem = {"sizes": BIG, "x": x, "y": y, "latents": latents_of(net)}
    ours, out = Ours(), {}
    for structure in ("diag", "kron"):
        times: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(reps + 1):
            for checked in (False, True):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    start = time.perf_counter()
                    posterior = ours.fit(problem, structure, check_map=checked)
                    float(posterior.log_marginal_likelihood())
                    seconds = time.perf_counter() - start
                if rep:  # the first of each kind warms up
                    times[checked].append(seconds)
                if checked:
                    warned = any(NOT_A_MAP in str(w.message) for w in caught)
        products = _count_products(posterior.net)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gain = posterior.check_map()
        prior = posterior._prior_precision.double()
        b = posterior._log_joint_gradient(posterior._prior_precision, posterior._observation_noise).double()
        median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        out[structure] = {
            "free": 0.5 * float((b.square() / prior).sum()),
            "gain": gain,
            "products": products[0],
            "warned": warned,
            "fit": median[False],
            "checked": median[True],
        }
        log(f"  {structure}: {out[structure]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--finish", type=int, default=2000, help="float64 L-BFGS steps after the benchmark's MAP")
    parser.add_argument("--reps", type=int, default=3, help="timed fits of each kind")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    head = machine(1)
    x, y, _ = teacher_data(BIG, 10_000, 1_000, seed=1)  # bench_laplace.prepare's problem, "full" configuration
    torch.manual_seed(2)
    net = network(BIG)
    train_map(net, x, y, epochs=20, batch_size=200, seed=3, lbfgs=100)
    rows = []
    stages = (
        ("the benchmark's MAP (Adam, 100 L-BFGS steps)", 0),
        (f"+ {args.finish} float64 L-BFGS steps", args.finish),
    )
    for label, steps in stages:
        start = time.perf_counter()
        if steps:
            finish_float64(net, x, y, steps)
        trained = time.perf_counter() - start
        loss, gradient = negative_log_joint(net, x, y)
        log(f"{label}: -log joint {loss:.3f}, |gradient| {gradient:.3g} ({trained:.0f} s)")
        result = measure(net, x, y, args.reps)
        for structure, r in result.items():
            rows.append(
                f"| {label} | {loss:.2f} | {gradient:.3g} | `{structure}` | {r['free']:.2f} | {r['gain']:.2f} "
                f"({r['products']}) | {'yes' if r['warned'] else 'no'} | {r['fit']:.3f} | {r['checked']:.3f} | "
                f"{r['checked'] / r['fit']:.1f}× |"
            )
    command = "python benchmarks/diagnose_laplace_map.py" + "".join(f" {a}" for a in sys.argv[1:])
    text = "\n".join(
        [
            "# The Laplace benchmark's network: the MAP check's verdict and cost as the MAP is trained longer",
            "",
            f"Command: `{command}`",
            "",
            *head,
            "",
            "| weights | −log joint (nats) | gradient norm | fit | free bound ½bᵀP⁻¹b | check: gain ≥ (products) | "
            "warned | fit (s) | fit with `check_map=True` (s) | ratio |",
            "|---|---:|---:|---|---:|---:|---|---:|---:|---:|",
            *rows,
            "",
            f"Load average at the end: {load_average()}. The check warns above 1 nat; the gain it reports is a lower "
            "bound, where its iterations stopped.",
            "",
        ]
    )
    write_report(text, args.out)


if __name__ == "__main__":
    main()
