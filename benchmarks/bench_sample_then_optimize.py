"""Benchmark of the sample-then-optimise engine (``SampleThenOptimize``): accuracy, cost, memory, EM.

    python benchmarks/bench_sample_then_optimize.py                 # all parts (about 30 minutes on 2 CPU cores)
    python benchmarks/bench_sample_then_optimize.py --parts a       # one part (a, b or c), under 15 minutes each
    python benchmarks/bench_sample_then_optimize.py --quick         # smoke-sized run (under a minute)

Prints a markdown report and writes it to ``benchmarks/results/sample_then_optimize.md`` (``--out`` to change; a
``--quick`` run writes ``sample_then_optimize_quick.md``); progress and every single measurement go to stderr. A run
of some parts replaces only their sections of an existing report, so the parts can be run one at a time. No peer
library is needed (scikit-learn for part c).

a. **Accuracy against the exact posterior** of a linear-Gaussian Pyro model, ``y ~ Normal(x[idx] @ w, 1)`` in a
   plate that subsamples B = 500 of N = 20,000 points, ``w ~ Normal(0, 1)`` (prior precision α = 1), float64, d =
   2,000 and d = 1,000, features with scales decaying over two decades (so the eigenvalues of H = XᵀX + αI spread
   from ≈ 1 to ≈ 10³ and about half the directions are data-dominated). The reference is the exact Cholesky
   posterior (form H, factorise, mean, K samples). Measured for ``variance_reduction="mean"`` and ``"all"`` at a few
   epoch counts: wall time, the mean's error in posterior sds, the relative (Frobenius) error of the sample
   covariance against the exact solves H⁻¹Aθⁿ of the *same* regulariser centres θⁿ (``engine.state.targets``;
   Monte-Carlo error excluded), and against H⁻¹ itself with its Monte-Carlo expectation. Plus a small check of
   the default step size on isotropic features with B < d.
b. **Cost and memory at d = 10⁴ to 10⁶** (CPU, float32): a tanh MLP 100-h-h-1 with ``PyroSample`` priors
   N(0, 1/fan_in), Normal likelihood (σ = 0.1), N = 10,000, B = 500, linearised at a draw from the prior
   (``linearize_at=``, no MAP search). Each cell runs in a fresh process: the time of every optimisation step (the
   engine's ``core.step``, wrapped), the time per epoch, and the peak RSS of ``run`` above the RSS before it, at
   K = 1 and at a larger K; per-sample memory is the difference over the difference in K. The reference for the
   step time is a hand-written forward + backward pass (``torch.autograd.grad`` of the minibatch loss w.r.t. the
   weights) of the same network on B points.
c. **EM and calibration on digits** (``sklearn.datasets.load_digits``, the 70/30 split and the MAP of the Laplace
   benchmark: ReLU MLP 64-300-200-10, prior precision 1), then ``SampleThenOptimize(..., linearize_at=MAP,
   em_steps=6)`` with ``em_groups="scalar"`` and ``"site"``: the prior-precision and effective-dimension history,
   and the test NLL, ECE and accuracy of the linearised predictive (the K draws pushed through f* + J(θ − θ*),
   probabilities averaged) and of the sampled-weights predictive (the draws through the network) against the MAP.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from harness import (  # benchmarks/ is on sys.path when a script runs
    CLEAN_LIMIT,
    RESOLUTION_MB,
    ForeignLoad,
    load_average,
    log,
    machine,
    peak_mb,
    release_free_memory,
    reset_peak,
    rss_mb,
    wait_for_quiet,
    write_report,
)

RESULTS = Path(__file__).resolve().parent / "results" / "sample_then_optimize.md"
QUICK_RESULTS = RESULTS.with_name("sample_then_optimize_quick.md")
PARTS = ("a", "b", "c")
TITLES = {
    "a": "(a) Accuracy against the exact posterior: linear-Gaussian model",
    "b": "(b) Cost and memory at d = 10⁴ to 10⁶",
    "c": "(c) EM and calibration on digits",
}


def _load(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _sto():
    """The engine class (imported late: a worker sets its threads first)."""
    from pyro_scalable.infer import SampleThenOptimize

    return SampleThenOptimize


# ====================================================================================== part a
def linear_problem(d: int, n: int, seed: int, isotropic: bool = False, correlated: bool = False):
    """Design, responses and the Pyro model of the linear-Gaussian benchmark (float64)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64
    if isotropic:
        scales = torch.ones(d, dtype=dtype)
    else:  # feature scales decaying over two decades: eigenvalues of X^T X from about N/d * 1e-2 to N/d * 1e2
        scales = 10.0 / math.sqrt(d) * torch.logspace(0, -2, d, dtype=dtype)
    x = torch.randn(n, d, generator=gen, dtype=dtype)
    if correlated:  # every feature a mixture of all: the diagonal preconditioner no longer resolves H's spread
        x = x @ (torch.randn(d, d, generator=gen, dtype=dtype) / math.sqrt(d) + torch.eye(d, dtype=dtype))
    x = x * scales
    w = torch.randn(d, generator=gen, dtype=dtype)
    y = x @ w + torch.randn(n, generator=gen, dtype=dtype)
    return x, y


def linear_model(d: int, batch: int, alpha: float = 1.0):
    import pyro
    import pyro.distributions as dist

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(d, dtype=x.dtype), alpha**-0.5).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=batch) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w, 1.0), obs=None if y is None else y[idx])

    return model


def exact_posterior(x, y, alpha: float, num_samples: int, seed: int) -> dict:
    """Cholesky of H = XᵀX + αI (σ = 1), the mean, K samples; timed. Also H⁻¹ (not timed) for the accuracy."""
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    d = x.shape[1]
    h = x.T @ x
    h.diagonal().add_(alpha)
    chol = torch.linalg.cholesky(h)
    mean = torch.cholesky_solve((x.T @ y).unsqueeze(-1), chol).squeeze(-1)
    noise = torch.randn(d, num_samples, generator=gen, dtype=x.dtype)
    samples = mean + torch.linalg.solve_triangular(chol.T, noise, upper=True).T
    seconds = time.perf_counter() - start
    assert samples.shape == (num_samples, d)
    covariance = torch.cholesky_inverse(chol)
    eig, basis = torch.linalg.eigh(h)
    data_dominated = eig - alpha > alpha  # directions where the data's curvature exceeds the prior's
    return {
        "basis": basis,
        "data_dominated": data_dominated,
        "seconds": seconds,
        "chol": chol,
        "mean": mean,
        "covariance": covariance,
        "sd": covariance.diagonal().sqrt(),
        "eig_min": float(eig[0]),
        "eig_max": float(eig[-1]),
    }


def accuracy(engine, exact: dict, alpha: float) -> dict:
    """The engine's errors against the exact posterior, with and without its Monte-Carlo error."""
    state = engine.state
    k = state.samples.shape[0] - 1
    zeta = state.samples[:-1].detach()  # optimised zero-mean samples
    same = torch.cholesky_solve((alpha * state.targets[:-1]).T, exact["chol"]).T  # exact solves, same centres
    c_hat, c_same = zeta.T @ zeta / k, same.T @ same / k
    cov = exact["covariance"]
    mean_err = (engine.mean_unconstrained - exact["mean"]) / exact["sd"]
    error, reference = (zeta - same) @ exact["basis"], same @ exact["basis"]  # in H's eigenbasis
    tr, tr2 = float(cov.trace()), float((cov * cov).sum())
    return {
        "mean_err_max": float(mean_err.abs().max()),
        "mean_err_rms": float(mean_err.square().mean().sqrt()),
        "cov_err_same": float((c_hat - c_same).norm() / c_same.norm()),
        "sample_err_same": float((zeta - same).norm() / same.norm()),
        "sd_err_same": float(((c_hat.diagonal() / c_same.diagonal()).sqrt() - 1).abs().max()),
        "cov_err_exact": float((c_hat - cov).norm() / cov.norm()),
        "cov_err_exact_mc": math.sqrt((tr2 + tr**2) / (k * tr2)),  # E|S - Σ|_F / |Σ|_F for K Gaussian draws
        "cov_err_iso_mc": math.sqrt((cov.shape[0] + 1) / k),
        "relative_grad_norm": float(engine.sample_stats["relative_grad_norm"].median()),
        **{
            f"sample_err_{name}": float(error[:, part].norm() / reference[:, part].norm())
            for name, part in (("data", exact["data_dominated"]), ("prior", ~exact["data_dominated"]))
        },
        "prior_share": float(reference[:, ~exact["data_dominated"]].square().sum() / reference.square().sum()),
    }


def part_a(cfg: dict, max_wait: float, report: list[str], summary: dict) -> None:
    log("part a: accuracy against the exact posterior")
    sto = _sto()
    default_refine = inspect.signature(sto).parameters["refine_passes"].default
    estimates = record_step_size_estimates()
    alpha, n, batch, k = 1.0, cfg["a_n"], cfg["a_batch"], cfg["a_samples"]
    rows = []
    for d, epochs_list, correlated in cfg["a_cells"]:
        x, y = linear_problem(d, n, seed=0, correlated=correlated)
        model = linear_model(d, batch, alpha)
        waited = wait_for_quiet(max_wait)
        load = ForeignLoad()
        exact = exact_posterior(x, y, alpha, k, seed=1)
        exact["foreign"] = load.cores()
        log(
            f"  d={d}: exact {exact['seconds']:.2f} s (other processes {_load(exact['foreign'])} cores), "
            f"eigenvalues of H {exact['eig_min']:.3g} .. {exact['eig_max']:.3g}"
        )
        runs = [("mean", epochs, 0.9, "diagonal", 100) for epochs in epochs_list]  # the defaults (refinement on)
        runs += [(mode, epochs, 0.9, "diagonal", 0) for mode in ("mean", "all") for epochs in epochs_list]
        if not correlated:
            runs += [(mode, epochs, momentum, "diagonal", 0) for mode, epochs, momentum in cfg["a_momentum"]]
            runs += [("mean", epochs, 0.9, None, 0) for epochs in epochs_list]  # plain SGD: before the preconditioner
        for mode, epochs, momentum, preconditioner, refine in runs:
            waited += wait_for_quiet(max_wait)
            engine = sto(
                model,
                num_samples=k,
                num_epochs=epochs,
                momentum=momentum,
                variance_reduction=mode,
                preconditioner=preconditioner,
                refine_passes=refine,
                seed=2,
                progress_bar=False,
            )
            load = ForeignLoad()
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.run(x, y)
            seconds = time.perf_counter() - start
            warned = any("not converged" in str(w.message) for w in caught)
            row = {"d": d, "mode": mode, "epochs": epochs, "momentum": momentum, "seconds": seconds}
            row["correlated"] = correlated
            row["passes"] = engine.cg_passes[0] if engine.cg_passes else 0
            row["cg_error"] = float(engine.sample_stats["cg_error"].max()) if refine else math.nan
            row["mean_cg_error"] = engine.mean_error if refine else math.nan
            row["preconditioner"] = preconditioner or "none"
            stats = engine.sample_stats
            row["error_in_sds"] = float(stats["error_in_sds"].median()) if "error_in_sds" in stats else math.nan
            row["foreign"] = load.cores()
            row["warned"] = warned
            row.update(accuracy(engine, exact, alpha))
            row.update(exact_seconds=exact["seconds"], exact_foreign=exact["foreign"])
            row.update(eig_min=exact["eig_min"], eig_max=exact["eig_max"], engine_lambda=estimates[-1])
            rows.append(row)
            log(f"  {json.dumps({key: v for key, v in row.items() if not isinstance(v, torch.Tensor)})}")
        del exact
    summary["a"] = rows
    check = step_size_check(cfg)
    summary["a_check"] = check
    lines = [
        f"Model: `y ~ Normal(x[idx] @ w, 1)` in a plate of N = {n:,} subsampling B = {batch} "
        f"({n // batch} steps per epoch), `w ~ Normal(0, 1)` (α = 1), **float64**. Features x_ij = z_ij s_j, "
        "z_ij ~ N(0, 1), s_j = (10/√d)·10^(−2j/(d−1)) (two decades), so H = XᵀX + αI has eigenvalues from about 1 "
        "to about 10³ (each d below) and about half of the directions are dominated by the data, half by the prior. "
        f"K = {k} samples plus the mean, the engine's defaults otherwise (Nesterov momentum 0.9 unless the momentum "
        "column says otherwise, step size 0.5/λ̂ from its power iteration, linear decay, chunks of 1,024 points for "
        "the full-data passes). Exact: form H "
        "(N·d² flops), Cholesky, mean, K samples (`torch.linalg`). Errors:",
        "",
        "- *mean error*: |θ̄_engine − θ̄_exact| / posterior sd, max and rms over the d coordinates;",
        "- *cov. error, same noise*: ‖Ĉ − C‖_F / ‖C‖_F with Ĉ = (1/K) Σ ζ̂ ζ̂ᵀ of the optimised zero-mean samples "
        "(`engine.state.samples[:-1]`) and C the same for the exact solves H⁻¹Aθⁿ of the same regulariser "
        "centres (`engine.state.targets[:-1]`): the optimisation error alone, no Monte-Carlo error;",
        "- *sd error, same noise*: max over coordinates of |√Ĉ_jj / √C_jj − 1|;",
        "- *cov. error vs H⁻¹*: ‖Ĉ − H⁻¹‖_F / ‖H⁻¹‖_F, dominated by Monte-Carlo error at K ≪ d; its expectation for K "
        "exact draws is √((tr Σ² + (tr Σ)²)/(K tr Σ²)) (Σ = H⁻¹; √((d+1)/K) if Σ ∝ I);",
        "- *sample error, data / prior directions*: ‖Ẑ − Z‖_F / ‖Z‖_F of the samples (same noise) restricted to the "
        "eigenvectors of H whose data curvature λ − α exceeds α (data-dominated) or not (prior-dominated; the share "
        "of the samples' squared norm there is given below the table);",
        "- *rel. grad.*: the engine's own diagnostic `sample_stats['relative_grad_norm']` (median over samples), "
        "‖∇L′‖ / ‖Aθⁿ‖ on the full data; *error in sds*: its diagnostic `sample_stats['error_in_sds']` (median), "
        "√(gᵀP⁻¹g/d), an estimate of a draw's RMS error in posterior sds (preconditioned runs only); *warned*: "
        "whether `run` warned that the samples had not converged (error in sds above 0.1; without the "
        "preconditioner, rel. grad. above 0.1);",
        "- *preconditioner*: `diagonal` (the default, P = diag(M) + A) or `none` (plain SGD, as before 2026-11-24).",
        "",
        "- *features*: `scaled` (independent features of scales over two decades: H's spread is on its diagonal) or "
        "`correlated` (each feature a random mixture of all before scaling: the spread is in the correlations, "
        "which the diagonal preconditioner does not resolve);",
        "- *CG passes*: the refinement's full-data conjugate-gradient passes after the epochs (default "
        f"`refine_passes={default_refine}`, `tolerance=0.1`; `0`: the epochs only, as before 2026-11-25); *CG "
        "estimate*: its "
        "estimate of the worst draw's / the mean's error in posterior sds along any direction.",
        "",
        "| d | features | preconditioner | variance_reduction | epochs | CG passes | momentum | engine (s) | exact (s) "
        "| engine / exact | mean error, max (sd) | mean error, rms (sd) | **cov. error, same noise** "
        "| sd error, same noise | sample error, data / prior directions | cov. error vs H⁻¹ (MC expectation) "
        "| rel. grad. | error in sds | CG estimate, draws / mean | warned | other processes (cores) |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        cg = f"{r['cg_error']:.3g} / {r['mean_cg_error']:.3g}" if r["passes"] else "–"
        lines.append(
            f"| {r['d']:,} | {'correlated' if r['correlated'] else 'scaled'} | `{r['preconditioner']}` "
            f"| `{r['mode']}` | {r['epochs']} | {r['passes']} | {r['momentum']:g} "
            f"| {r['seconds']:.1f} "
            f"| {r['exact_seconds']:.2f} "
            f"| {r['seconds'] / r['exact_seconds']:.0f}× | {r['mean_err_max']:.3f} | {r['mean_err_rms']:.4f} "
            f"| **{r['cov_err_same']:.3f}** | {r['sd_err_same']:.3f} | {r['sample_err_data']:.3f} / "
            f"{r['sample_err_prior']:.3f} | {r['cov_err_exact']:.2f} ({r['cov_err_exact_mc']:.2f}) "
            f"| {r['relative_grad_norm']:.2g} | {r['error_in_sds']:.3g} | {cg} | {'yes' if r['warned'] else 'no'} "
            f"| {_load(r['foreign'])} / "
            f"{_load(r['exact_foreign'])} |"
        )
    eigs = sorted({(r["d"], r["correlated"], r["eig_min"], r["eig_max"], r["prior_share"]) for r in rows})
    lambdas = {
        (d, c): statistics.median(r["engine_lambda"] for r in rows if (r["d"], r["correlated"]) == (d, c))
        for d, c, *_ in eigs
    }
    lines += [
        "",
        "Eigenvalues of H: "
        + "; ".join(
            f"d = {d:,}{' (correlated)' if c else ''}: {lo:.3g} to {hi:,.0f} ({share:.0%} of the samples' squared "
            f"norm in the prior-dominated directions; the engine's default step size 0.5/λ̂ with λ̂ = "
            f"{lambdas[d, c]:,.0f}, its estimate of a minibatch's largest eigenvalue, so λ̂/λ_min(H) = "
            f"{lambdas[d, c] / lo:,.0f})"
            for d, c, lo, hi, share in eigs
        )
        + ". "
        "The last column: cores used by other processes during the engine run / the exact solve.",
        "",
        f"**Default step size with B < d.** {check['text']}",
        "",
    ]
    report += lines


def record_step_size_estimates() -> list[float]:
    """The engine's estimate λ̂ of each run (its default step size is 0.5/λ̂), by wrapping the private method."""
    from pyro_scalable.infer.sample_then_optimize import engine as engine_module

    estimates: list[float] = []
    problem = engine_module.Problem
    original = problem._largest_eigenvalue

    def recorded(*args, **kwargs):
        estimates.append(original(*args, **kwargs))
        return estimates[-1]

    problem._largest_eigenvalue = recorded
    return estimates


def step_size_check(cfg: dict) -> dict:
    """Isotropic features and B < d: one minibatch's curvature exceeds the full data's several times."""
    sto = _sto()
    d, n, batch = cfg["check_d"], cfg["check_n"], cfg["check_batch"]
    x, y = linear_problem(d, n, seed=0, isotropic=True)
    model = linear_model(d, batch)
    h = x.T @ x + torch.eye(d, dtype=x.dtype)
    full = float(torch.linalg.eigvalsh(h)[-1])
    gen = torch.Generator().manual_seed(0)
    minibatch = max(
        float(torch.linalg.eigvalsh(n / batch * (xb.T @ xb))[-1]) + 1.0
        for xb in (x[torch.randperm(n, generator=gen)[:batch]] for _ in range(5))
    )
    results, warned = {}, {}
    for label, step in (("default", None), ("0.5 / λ_max(minibatch)", 0.5 / minibatch)):
        engine = sto(model, num_samples=4, num_epochs=5, step_size=step, seed=0, progress_bar=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine.run(x, y)
                results[label] = float(engine.sample_stats["relative_grad_norm"].max())
            except RuntimeError as error:  # non-finite iterates
                results[label] = f"error: {str(error)[:80]}"
        warned[label] = [re.split(r"\.\s", str(w.message))[0] for w in caught]
    sd = float(torch.linalg.eigvalsh(h)[0] ** -0.5)
    fmt = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in results.items()}
    said = warned["default"]
    default = results["default"]
    if isinstance(default, str):
        outcome = f"the run stopped: {default}"
    elif default > 1:
        outcome = "the iterates diverge; " + (
            "the engine neither raises nor warns"
            if not said
            else "they stay finite, so the engine does not raise; it only warns: " + "; ".join(f"“{w}”" for w in said)
        )
    else:
        outcome = "stable (the default step size is set by a minibatch's largest eigenvalue)"
    text = (
        f"Isotropic features z_ij ~ N(0, 1), d = {d}, N = {n:,}, B = {batch}: the largest eigenvalue of H is "
        f"{full:,.0f}, that of one minibatch's estimate (N/B)X_BᵀX_B + I is {minibatch:,.0f} (max over 5 "
        f"minibatches), so a step size set from H's would diverge. With the engine's default step size, 5 epochs "
        f"end with a full-data relative gradient norm of {fmt['default']} (largest over 4 samples; posterior sds "
        f"≤ {sd:.2g}): {outcome}. With `step_size = 0.5/λ_max(minibatch)` = {0.5 / minibatch:.3g} passed by hand: "
        f"{fmt['0.5 / λ_max(minibatch)']}."
    )
    log(f"  step-size check: {json.dumps(results)}, full λ {full:.0f}, minibatch λ {minibatch:.0f}")
    return {"full": full, "minibatch": minibatch, "results": results, "text": text}


# ====================================================================================== part b
INPUTS, NOISE = 100, 0.1


def mlp_model(width: int, batch: int):
    """``PyroModule`` tanh MLP INPUTS-width-width-1, N(0, 1/fan_in) priors, Normal(f, NOISE) likelihood."""
    import pyro
    import pyro.distributions as dist
    from pyro.nn import PyroModule, PyroSample
    from torch import nn

    sizes = (INPUTS, width, width, 1)

    class MLP(PyroModule):
        def __init__(self):
            super().__init__()
            layers = []
            for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
                layer = PyroModule[nn.Linear](fan_in, fan_out)
                layer.weight = PyroSample(dist.Normal(0.0, fan_in**-0.5).expand((fan_out, fan_in)).to_event(2))
                layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand((fan_out,)).to_event(1))
                layers.append(layer)
            self.layers = PyroModule[nn.ModuleList](layers)

        def forward(self, x, y=None):
            data = pyro.plate("data", x.shape[0], subsample_size=batch)
            h = x[data.indices]
            for k, layer in enumerate(self.layers):
                h = layer(h)
                if k < len(self.layers) - 1:
                    h = torch.tanh(h)
            with data:
                return pyro.sample("y", dist.Normal(h.squeeze(-1), NOISE), obs=None if y is None else y[data.indices])

    return MLP(), sizes


def num_weights(width: int) -> int:
    return width * width + (INPUTS + 3) * width + 1


def mlp_weights(sizes, seed: int) -> dict[str, torch.Tensor]:
    """A draw from the prior (a random initialisation), as constrained values by site name."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        out[f"layers.{k}.weight"] = torch.randn(fan_out, fan_in, generator=gen) * fan_in**-0.5
        out[f"layers.{k}.bias"] = torch.randn(fan_out, generator=gen)
    return out


def mlp_data(sizes, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, INPUTS, generator=gen)
    teacher = mlp_weights(sizes, seed + 1)
    with torch.no_grad():
        y = hand_forward(teacher, x).squeeze(-1) + NOISE * torch.randn(n, generator=gen)
    return x, y


def hand_forward(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = x
    layers = len(weights) // 2
    for k in range(layers):
        h = torch.nn.functional.linear(h, weights[f"layers.{k}.weight"], weights[f"layers.{k}.bias"])
        if k < layers - 1:
            h = torch.tanh(h)
    return h


def hand_step_seconds(weights: dict[str, torch.Tensor], x, y, batch: int, reps: int = 20) -> float:
    """Median time of a hand-written forward + backward of the minibatch loss w.r.t. all weights."""
    params = [v.clone().requires_grad_(True) for v in weights.values()]
    names = list(weights)
    gen = torch.Generator().manual_seed(0)
    times = []
    for rep in range(reps + 3):
        idx = torch.randperm(x.shape[0], generator=gen)[:batch]
        start = time.perf_counter()
        f = hand_forward(dict(zip(names, params)), x[idx]).squeeze(-1)
        loss = 0.5 * ((f - y[idx]) / NOISE).square().sum()
        grads = torch.autograd.grad(loss, params)
        seconds = time.perf_counter() - start
        assert len(grads) == len(params)
        if rep >= 3:
            times.append(seconds)
    return statistics.median(times)


class Timers:
    """Wall-clock timers (and peak RSS) around the engine's steps and phases: instrumentation, the code unchanged."""

    MEMORY_PHASES = ("_data_pass", "solve", "finish")  # not nested in one another

    def __init__(self):
        from pyro_scalable.infer.linearized.sampling import core
        from pyro_scalable.infer.sample_then_optimize import engine as engine_module

        self.steps: list[float] = []
        self.phases: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.running_peak = 0.0
        self.track_memory = False
        self._wrap(core, "step", self.steps)
        problem = engine_module.Problem
        for name in ("solve", "finish", "_largest_eigenvalue", "_data_pass"):
            self._wrap(problem, name, name)

    def _wrap(self, owner, name: str, sink) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            memory = self.track_memory and sink in self.MEMORY_PHASES
            if memory:  # fold the peak so far into the running peak, then measure this phase's own
                self.running_peak = max(self.running_peak, peak_mb())
                reset_peak()
            start = time.perf_counter()
            out = original(*args, **kwargs)
            seconds = time.perf_counter() - start
            if memory:
                self.peaks[sink] = peak_mb()
                self.running_peak = max(self.running_peak, self.peaks[sink])
            if isinstance(sink, list):
                sink.append(seconds)
            else:
                self.phases[sink] = self.phases.get(sink, 0.0) + seconds
            return out

        setattr(owner, name, timed)

    def reset(self, track_memory: bool) -> None:
        self.steps.clear()
        self.phases.clear()
        self.peaks.clear()
        self.running_peak = 0.0
        self.track_memory = track_memory


def worker_b(width: int, k: int, epochs: int, cfg_json: str, threads: int) -> None:
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    cfg = json.loads(cfg_json)
    n, batch = cfg["b_n"], cfg["b_batch"]
    sto = _sto()
    timers = Timers()

    def run(width: int, n: int, k: int, epochs: int, measure: bool) -> dict:
        model, sizes = mlp_model(width, batch)
        x, y = mlp_data(sizes, n, seed=0)
        latents = mlp_weights(sizes, seed=1)
        engine = sto(
            model,
            num_samples=k,
            num_epochs=epochs,
            linearize_at=latents,
            chunk_size=batch,
            refine_passes=0,  # this part measures the minibatch step; a refinement pass costs about an epoch
            seed=0,
            progress_bar=False,
        )
        result: dict = {}
        release_free_memory()
        timers.reset(track_memory=measure)
        if measure:
            result["reset"] = reset_peak()
            result["base_mb"] = rss_mb()
        load = ForeignLoad()
        start = time.perf_counter()
        try:
            engine.run(x, y)
        except RuntimeError as error:
            result["error"] = str(error)[:200]
        result["seconds"] = time.perf_counter() - start
        result["foreign"] = load.cores()
        if measure:
            result["peak_mb"] = max(peak_mb(), timers.running_peak)
            result["extra_mb"] = result["peak_mb"] - result["base_mb"]
            result["phase_extra_mb"] = {k: v - result["base_mb"] for k, v in timers.peaks.items()}
            steps = timers.steps
            phases = timers.phases
            per_epoch = n // batch
            result.update(
                d=engine.net.layout.num_params if engine.net is not None else None,
                steps=len(steps),
                step_median=statistics.median(steps) if steps else None,
                step_total=sum(steps),
                solve=phases.get("solve", 0.0),
                eigenvalue=phases.get("_largest_eigenvalue", 0.0),
                centres=phases.get("_data_pass", 0.0),
                finish=phases.get("finish", 0.0),
                steps_per_epoch=per_epoch,
            )
            result["epoch"] = (result["solve"] - result["eigenvalue"]) / epochs
            result["reanchor"] = result["solve"] - result["eigenvalue"] - result["step_total"]
            result["other"] = result["seconds"] - result["solve"] - result["finish"] - result["centres"]
            if "error" not in result:
                result["relative_grad_norm"] = float(engine.sample_stats["relative_grad_norm"].median())
            del engine
            release_free_memory()
            result["hand"] = hand_step_seconds(latents, x, y, batch)
        return result

    run(4, 4 * batch, 2, 1, measure=False)  # warm-up: the same code path on a tiny net
    print(json.dumps(run(width, n, k, epochs, measure=True)), flush=True)


# glibc serves blocks above its mmap threshold (at most 32 MB by default) with fresh pages, zeroed by the kernel on
# first touch, and returns them on free: every (K + 2) x d temporary of a step at d = 1e6 pays those page faults.
# Below the threshold, freed blocks stay in the process for reuse and count in its resident memory; with every block
# of 128 KB or more mapped on its own ("live"), the resident memory is the memory in use.
MALLOC_ENVS = {
    None: {},
    "glibc mmap off": {
        "MALLOC_MMAP_THRESHOLD_": str(2**32),
        "MALLOC_TRIM_THRESHOLD_": str(2**36),
        "MALLOC_TOP_PAD_": str(2**30),
    },
    "live": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}


def spawn_b(width: int, k: int, epochs: int, cfg: dict, threads: int, malloc: str | None = None) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        str(width),
        str(k),
        str(epochs),
        json.dumps({"b_n": cfg["b_n"], "b_batch": cfg["b_batch"]}),
        "--threads",
        str(threads),
    ]
    try:
        env = {**os.environ, **MALLOC_ENVS[malloc]}
        done = subprocess.run(command, capture_output=True, text=True, timeout=cfg["b_timeout"], env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {cfg['b_timeout']:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-2:]
        return {"error": f"exit {done.returncode}: {' | '.join(tail)}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _label(row: dict) -> str:
    return f"{row['d']:,}" + (f" ({row['malloc']})" if row.get("malloc") else "")


def _median_result(results: list[dict]) -> dict:
    """Field by field median of a cell's repetitions (numbers, and the per-phase peaks)."""
    out: dict = {}
    for key, value in results[0].items():
        if isinstance(value, bool) or value is None:
            out[key] = value
        elif isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in results)
        elif isinstance(value, dict):
            out[key] = {p: statistics.median(r[key].get(p, 0.0) for r in results) for p in value}
    return out


def _derived(pairs: list[tuple[dict, dict]], k: int) -> dict:
    """Per-sample time and memory, and their ratios: medians of the per-repetition values."""
    per, marginal, hand, per_ratio, marginal_ratio, memory = [], [], [], [], [], []
    for one, many in pairs:
        step_hand = statistics.median([one["hand"], many["hand"]])
        per.append(many["step_median"] / k)
        marginal.append((many["step_median"] - one["step_median"]) / (k - 1))
        hand.append(step_hand)
        per_ratio.append(per[-1] / step_hand)
        marginal_ratio.append(marginal[-1] / step_hand)
        grown = many["extra_mb"] - one["extra_mb"]
        if grown >= RESOLUTION_MB:
            memory.append(grown * 2**20 / (k - 1) / (4 * many["d"]))
    med = statistics.median
    return {
        "d": pairs[0][1]["d"],
        "per": med(per),
        "marginal": med(marginal),
        "hand": med(hand),
        "per_ratio": med(per_ratio),
        "marginal_ratio": med(marginal_ratio),
        "memory": med(memory) if memory else None,
    }


def part_b(cfg: dict, threads: int, max_wait: float, report: list[str], summary: dict) -> None:
    log("part b: cost and memory at large d")
    n, batch = cfg["b_n"], cfg["b_batch"]
    runs: dict[tuple[int, int], list[dict]] = {}
    for rep in range(cfg["b_reps"]):  # repetitions interleaved across the cells
        for width, k_big, epochs, malloc in cfg["b_cells"]:
            for k in (1, k_big):
                wait_for_quiet(max_wait)
                start = time.perf_counter()
                out = spawn_b(width, k, epochs, cfg, threads, malloc)
                runs.setdefault((width, k, malloc), []).append(out)
                seconds = time.perf_counter() - start
                log(
                    f"  rep {rep + 1} width {width} K={k} epochs={epochs} {malloc or ''}: {json.dumps(out)} "
                    f"({seconds:.0f} s)"
                )
    rows = []
    for width, k_big, epochs, malloc in cfg["b_cells"]:
        ones, manys = runs[(width, 1, malloc)], runs[(width, k_big, malloc)]
        pairs = [(one, many) for one, many in zip(ones, manys) if "error" not in one and "error" not in many]
        clean = [
            (one, many)
            for one, many in pairs
            if max(one["foreign"] or 0.0, many["foreign"] or 0.0) < CLEAN_LIMIT  # no other process took a core
        ]
        row = {"width": width, "k": k_big, "epochs": epochs, "reps": len(clean), "of": len(pairs)}
        pairs = clean if len(clean) >= 2 or (clean and len(pairs) == 1) else pairs
        row["malloc"] = malloc
        if not pairs:
            row["error"] = next(r["error"] for r in ones + manys if "error" in r)
        else:
            row["one"] = _median_result([one for one, _ in pairs])
            row["many"] = _median_result([many for _, many in pairs])
            row.update(_derived(pairs, k_big))
        rows.append(row)
    summary["b"] = rows
    lines = [
        f"Model: tanh MLP {INPUTS}-h-h-1 as a `PyroModule` with `PyroSample` priors N(0, 1/fan_in) on the weights "
        f"and N(0, 1) on the biases, `Normal(f, {NOISE})` likelihood, N = {n:,} synthetic points (a random teacher "
        f"of the same shape plus noise), plate subsampling B = {batch} ({n // batch} steps per epoch), **float32**, "
        f"{threads} torch threads. `SampleThenOptimize(model, K, num_epochs, linearize_at=<a draw from the prior>, "
        f"chunk_size={batch}, refine_passes=0)` (the refinement off: this part measures the epochs' step), default "
        "step size and `variance_reduction='mean'`. Each cell is a fresh process, "
        f"warmed up on a 4-unit net first; {cfg['b_reps']} repetitions, interleaved, medians reported (ratios and "
        "per-sample figures: medians of the per-repetition values) over the repetitions during which other processes "
        f"used < {CLEAN_LIMIT} cores in both runs, when at least two were (the last column: clean / all).",
        "",
        "- *step*: median wall time of the engine's optimisation step (`core.step`: one batched JVP and one batched "
        "VJP for the K sample rows, the mean row and its anchor, then the Nesterov update), timed by wrapping it; "
        "*per sample* = step / K; *marginal* = (step(K) − step(1)) / (K − 1), the cost of one more sample;",
        "- *fwd+bwd*: a hand-written forward + `torch.autograd.grad` of the minibatch loss w.r.t. all weights, same "
        "network and weights, B points, median of 20;",
        "- *epoch*: (time in the solve − the step-size power iteration) / epochs: the steps plus the once-per-epoch "
        "full-data pass that re-anchors the mean's control variate;",
        "- *memory per sample*: peak RSS during `run` above the RSS just before it (glibc's free memory returned with "
        "`malloc_trim`, `VmHWM` reset through `/proc/self/clear_refs`), at K and at 1: (extra(K) − extra(1)) / "
        f'(K − 1), in units of d float32s ("–" where the difference is below {RESOLUTION_MB:.0f} MB). It counts '
        "everything that grows with K: the optimiser state, the regulariser centres, the temporaries of the update, "
        "and the batched tangents of the network's "
        "activations in the JVP (B × the hidden widths per sample). Rows marked *live* run with every block of "
        "128 KB or more mapped on its own (`MALLOC_MMAP_THRESHOLD_=131072`): their resident memory is the memory in "
        "use, without the freed blocks the C library's allocator otherwise keeps for reuse (which the other rows "
        "count);",
        "- *exact*: the d × d posterior precision alone would take d² float32s.",
        "",
        "| d (h) | K | epochs | step, K samples (s) | per sample (s) | marginal (s) | fwd+bwd (s) "
        "| **per sample / fwd+bwd** | marginal / fwd+bwd | epoch (s) | whole `run` (s) | extra RSS, 1 / K (MB) "
        "| **memory per sample (d floats)** | exact: d² floats | rel. grad. | other processes (cores) | repetitions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        k = r["k"]
        if "error" in r:
            lines.append(f"| h = {r['width']} | {k} | {r['epochs']} | {r['error']} |")
            continue
        one, many, d = r["one"], r["many"], r["d"]
        exact_gb = d * d * 4 / 1e9
        exact = f"{exact_gb / 1000:,.1f} TB" if exact_gb >= 1000 else f"{exact_gb:,.1f} GB"
        per_sample_memory = "–" if r["memory"] is None else f"{r['memory']:.1f}"
        lines.append(
            f"| {d:,} ({r['width']}){', ' + r['malloc'] if r['malloc'] else ''} | {k} | {r['epochs']} "
            f"| {many['step_median']:.3f} | {r['per']:.4f} "
            f"| {r['marginal']:.4f} | {r['hand']:.4f} | **{r['per_ratio']:.1f}×** | {r['marginal_ratio']:.1f}× "
            f"| {many['epoch']:.1f} | {one['seconds']:.1f} / {many['seconds']:.1f} | {one['extra_mb']:,.0f} / "
            f"{many['extra_mb']:,.0f} | **{per_sample_memory}** | {exact} | {many['relative_grad_norm']:.2g} "
            f"| {_load(one['foreign'])} / {_load(many['foreign'])} | {r['reps']}/{r['of']} |"
        )
    lines.append("")
    breakdown = [
        "Where the K-sample run's time goes (s): the regulariser centres (one VJP pass for all rows), the step-size "
        "power iteration (products with one row on a few fixed minibatches), the steps, the re-anchoring passes, the "
        "final full-data diagnostics (a pass with all K + 1 rows); and the peak memory per sample of each phase (its "
        "peak RSS above the RSS before `run`, the same difference between K and 1 as above, in d floats; `VmHWM` "
        "reset at the start of each phase).",
        "",
        "| d | centres | step size | steps | re-anchoring | final pass | other (checks, set-up) | whole `run` "
        "| memory per sample: centres / solve / final pass (d floats) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            continue
        one, many = r["one"], r["many"]
        reanchor, other = many["reanchor"], many["other"]
        phases = []
        for phase in Timers.MEMORY_PHASES:
            grown = many["phase_extra_mb"].get(phase, 0.0) - one["phase_extra_mb"].get(phase, 0.0)
            phases.append(f"{grown * 2**20 / (r['k'] - 1) / (4 * r['d']):.1f}" if grown >= RESOLUTION_MB else "–")
        breakdown.append(
            f"| {_label(r)} | {many['centres']:.1f} | {many['eigenvalue']:.1f} | {many['step_total']:.1f} "
            f"| {reanchor:.1f} | {many['finish']:.1f} | {other:.1f} | {many['seconds']:.1f} | {' / '.join(phases)} |"
        )
    report += lines + breakdown + [""]


# ====================================================================================== part c
def part_c(cfg: dict, report: list[str], summary: dict) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.problems
    from benchmarks.metrics import calibration
    from benchmarks.problems import latents_of, network, train_map

    def nll_ece_accuracy(probs: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        found = calibration(probs, y)
        return found["nll"], found["ece"], found["test_accuracy"]

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    log("part c: EM and calibration on digits")
    sizes = cfg["c_sizes"]
    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data, data.target, test_size=0.3, random_state=0, stratify=data.target
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    x_train = torch.tensor((x_train - mean) / std, dtype=torch.float32)
    x_test = torch.tensor((x_test - mean) / std, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    torch.manual_seed(0)
    net = network(sizes)
    start = time.perf_counter()
    train_map(net, x_train, y_train, epochs=cfg["c_map_epochs"], batch_size=64, seed=0, lbfgs=cfg["c_lbfgs"])
    map_seconds = time.perf_counter() - start
    log(f"  MAP trained in {map_seconds:.0f} s")
    with torch.no_grad():
        map_probs = torch.softmax(net(x_test), -1)
    latents = latents_of(net)
    weights = sum(p.numel() for p in net.parameters())
    batch, k = cfg["c_batch"], cfg["c_samples"]
    rows = [("MAP", "–", "1 (training)", nll_ece_accuracy(map_probs, y_test), map_seconds, "")]
    histories = {}
    sto = _sto()
    for groups in ("scalar", "site"):
        engine = sto(
            digits_model(sizes, batch),
            num_samples=k,
            num_epochs=cfg["c_epochs"],
            em_epochs=cfg["c_em_epochs"],
            em_steps=cfg["c_em_steps"],
            em_groups=groups,
            linearize_at=latents,
            seed=0,
            progress_bar=False,
        )
        load = ForeignLoad()
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.run(x_train, y_train)
        seconds = time.perf_counter() - start
        foreign = load.cores()
        notes = [re.split(r"\.\s", str(w.message))[0] for w in caught]
        alphas = engine.em_history["prior_precision"]  # (em_steps + 1, groups)
        gammas = engine.em_history["effective_dimension"]
        change = ((alphas[1:] - alphas[:-1]).abs() / alphas[:-1]).max(-1).values  # max over groups
        settled = next(
            (t + 1 for t in range(len(change)) if bool((change[t:] < cfg["c_tolerance"]).all())), None
        )  # the EM step after which every later change is below the tolerance
        histories[groups] = {
            "names": engine.em_history["groups"],
            "alpha": alphas.tolist(),
            "gamma": gammas.tolist(),
            "change": change.tolist(),
            "settled": settled,
            "seconds": seconds,
            "foreign": foreign,
            "relative_grad_norm": float(engine.sample_stats["relative_grad_norm"].median()),
        }
        linearised, probit, sampled = predictives(engine, x_test)
        label = f"`em_groups='{groups}'`"
        final = ", ".join(f"{a:.3g}" for a in alphas[-1].tolist())
        note = "; ".join(notes)
        rows.append(("linearised (MC)", label, final, nll_ece_accuracy(linearised, y_test), seconds, note))
        rows.append(("linearised (probit)", label, final, nll_ece_accuracy(probit, y_test), None, ""))
        rows.append(("sampled weights (MC)", label, final, nll_ece_accuracy(sampled, y_test), None, ""))
        log(f"  {groups}: {json.dumps(histories[groups])}")
        for row in rows[-3:]:
            log(f"  {row}")
    summary["c"] = {"rows": rows, "histories": histories, "tolerance": cfg["c_tolerance"]}
    lines = [
        f"`sklearn.datasets.load_digits`, 70/30 stratified split (`random_state=0`: {len(y_train)} training, "
        f"{len(y_test)} test points), inputs standardised; ReLU MLP {'-'.join(map(str, sizes))} ({weights:,} "
        f"weights) trained to its MAP at prior precision 1 exactly as in the Laplace benchmark (Adam "
        f"{cfg['c_map_epochs']} epochs, then L-BFGS {cfg['c_lbfgs']} iterations; {map_seconds:.0f} s). The Pyro model "
        f"is the same MLP as a `PyroModule` with N(0, 1) `PyroSample` priors, `Categorical(logits=f)`, and a plate "
        f"subsampling B = {batch} ({len(y_train) // batch} steps per epoch). `SampleThenOptimize(model, "
        f"num_samples={k}, num_epochs={cfg['c_epochs']}, em_epochs={cfg['c_em_epochs']}, "
        f"em_steps={cfg['c_em_steps']}, linearize_at=<MAP>)`, float32, default step size and "
        "`variance_reduction='mean'`.",
        "",
        "**Prior precision α (MacKay EM) and effective dimension γ̂ by EM step** (step 0: the model's prior). "
        f"Converged = every later relative change of α (max over groups) below {cfg['c_tolerance']:.0%}.",
        "",
        "| em_groups | group | " + " | ".join(f"α_{t}" for t in range(cfg["c_em_steps"] + 1)) + " | γ̂ (last) |",
        "|---|---|" + "---:|" * (cfg["c_em_steps"] + 2),
    ]
    for groups, h in histories.items():
        for g, name in enumerate(h["names"]):
            alphas = " | ".join(f"{row[g]:.3g}" for row in h["alpha"])
            lines.append(f"| `{groups}` | {name} | {alphas} | {h['gamma'][-1][g]:.1f} |")
    lines += [
        "",
        "| em_groups | relative change of α by EM step (max over groups) | converged after EM step | "
        "γ̂ (sum over groups) by solve | rel. grad. (last solve) | time (s) | other processes (cores) |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for groups, h in histories.items():
        change = ", ".join(f"{c:.1%}" for c in h["change"])
        gam = ", ".join(f"{sum(g):.0f}" for g in h["gamma"])
        settled = "not within the run" if h["settled"] is None else str(h["settled"])
        lines.append(
            f"| `{groups}` | {change} | {settled} | {gam} | {h['relative_grad_norm']:.2g} | {h['seconds']:.0f} "
            f"| {_load(h['foreign'])} |"
        )
    lines += [
        "",
        f"**Test-set predictive** ({k} draws; ECE: 15 equal-width bins of the top-class probability). Linearised "
        "(MC): softmax(f*(x) + J(x)(θ_k − θ*)) averaged over the draws (`engine.net.jvp` at θ* with the flat draws "
        "minus θ*); linearised (probit): `engine.predict(x_test, link_approx='probit')`, the probit approximation "
        "with the outputs' covariance (1/K) Σ (Jζ_k)(Jζ_k)ᵀ from the draws (the link the Laplace benchmark uses, "
        "for comparison with its digits table); sampled weights: softmax(f(x, θ_k)) averaged. The time column is "
        "the engine's whole `run` (all EM steps).",
        "",
        "| predictive | EM | final prior precision | test NLL | ECE | accuracy | time (s) | notes |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for name, label, prior, (nll, ece, acc), seconds, note in rows:
        lines.append(
            f"| {name} | {label} | {prior} | {nll:.4f} | {ece:.4f} | {acc:.4f} | "
            f"{'–' if seconds is None else f'{seconds:.0f}'} | {note} |"
        )
    report += lines + [""]


def digits_model(sizes, batch: int):
    import pyro
    import pyro.distributions as dist
    from pyro.nn import PyroModule, PyroSample
    from torch import nn

    class MLP(PyroModule):
        def __init__(self):
            super().__init__()
            layers = []
            for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
                layer = PyroModule[nn.Linear](fan_in, fan_out)
                layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand((fan_out, fan_in)).to_event(2))
                layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand((fan_out,)).to_event(1))
                layers.append(layer)
            self.layers = PyroModule[nn.ModuleList](layers)

        def forward(self, x, y=None):
            data = pyro.plate("data", x.shape[0], subsample_size=min(batch, x.shape[0]))
            f = x[data.indices]
            for k, layer in enumerate(self.layers):
                f = layer(f)
                if k < len(self.layers) - 1:
                    f = torch.relu(f)
            with data:
                return pyro.sample("y", dist.Categorical(logits=f), obs=None if y is None else y[data.indices])

    return MLP()


def predictives(engine, x_test) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Test-set class probabilities from the draws: linearised (MC, probit) and sampled-weights predictives."""
    net = engine.net
    layout = net.layout
    samples = engine.get_unconstrained_samples()
    draws = layout.flatten({name: samples[name] for name in layout.names}, batch_dims=1)
    deltas = draws - net.theta_star
    linearised, sampled = [], []
    with torch.no_grad():
        for batch in net.batches((x_test,), {}):
            f, products = net.jvp(net.theta_star, deltas, batch)
            linearised.append(torch.softmax(f + products, -1).mean(0))
            sampled.append(torch.stack([torch.softmax(net.f(theta, batch), -1) for theta in draws]).mean(0))
        probit = engine.predict(x_test, link_approx="probit").distribution.probs
    return torch.cat(linearised).detach(), probit.detach(), torch.cat(sampled).detach()


# ====================================================================================== targets and report
def targets(summary: dict) -> list[str]:
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    rows_a = summary.get("a") or []
    for d, correlated in sorted({(r["d"], r["correlated"]) for r in rows_a}):
        cell = [r for r in rows_a if (r["d"], r["correlated"]) == (d, correlated)]
        features = "correlated features" if correlated else "scaled features"
        defaults = [r for r in cell if r["passes"] and r["epochs"] <= 20]
        if not defaults:
            continue
        r = max(defaults, key=lambda r: r["epochs"])
        ok = r["cov_err_same"] <= 0.1 and r["mean_err_max"] <= 0.25
        target = "the target" if d == 1000 else "no target at this d, the same bar"
        epochs_only = [q for q in cell if not q["passes"] and q["epochs"] == r["epochs"] and q["mode"] == "mean"]
        before = (
            f" (the epochs alone: {epochs_only[0]['cov_err_same']:.3f}, {epochs_only[0]['mean_err_max']:.2f} sd)"
            if epochs_only and epochs_only[0]["preconditioner"] == "diagonal"
            else ""
        )
        lines.append(
            f"| (a) d = {d:,}, {features}: covariance error ≤ 0.1 and worst mean error ≤ 0.25 sd with the defaults "
            f"({target}) | {r['epochs']} epochs + {r['passes']} CG passes: {r['cov_err_same']:.3f}, "
            f"{r['mean_err_max']:.3f} sd{before} | {'met' if ok else '**missed**'} |"
        )
    for r in summary.get("b") or []:
        if "per" not in r:
            continue
        lines.append(
            f"| (b) d = {_label(r)}: time per optimisation step per sample ≤ 3× a forward + backward pass "
            f"| {r['per_ratio']:.1f}× at K = {r['k']} (marginal {r['marginal_ratio']:.1f}×) "
            f"| {'met' if r['per_ratio'] <= 3 else '**missed**'} |"
        )
        if r["memory"] is not None:
            lines.append(
                f"| (b) d = {_label(r)}: peak memory per sample ≤ 4·d floats | {r['memory']:.1f}·d "
                f"| {'met' if r['memory'] <= 4 else '**missed**'} |"
            )
    c = summary.get("c")
    if c:
        for groups, h in c["histories"].items():
            ok = h["settled"] is not None and h["settled"] <= 6
            lines.append(
                f"| (c) `em_groups='{groups}'`: α converges (relative change < {c['tolerance']:.0%}) in ≤ 6 EM steps "
                f"| {'after step ' + str(h['settled']) if h['settled'] else 'not within the run'} "
                f"| {'met' if ok else '**missed**'} |"
            )
    return lines


CONFIGS = {
    "full": {
        "a_n": 20_000,
        "a_batch": 500,
        "a_samples": 32,
        "a_cells": [(2000, (5, 10, 20), False), (1000, (20, 40), False), (1000, (20,), True)],
        "a_momentum": [("mean", 20, 0.98), ("all", 20, 0.98)],  # (mode, epochs, momentum): beyond the default 0.9
        "check_d": 200,
        "check_n": 4000,
        "check_batch": 100,
        "b_n": 10_000,
        "b_batch": 500,
        # (hidden width, K, epochs, malloc settings): d ≈ 1e4, 1e5, 1e6
        "b_cells": [
            (64, 64, 2, None),
            (280, 16, 2, None),
            (950, 8, 1, None),
            (950, 8, 1, "glibc mmap off"),
            (280, 16, 2, "live"),
            (950, 8, 1, "live"),
        ],
        "b_timeout": 900.0,
        "b_reps": 3,
        "c_sizes": (64, 300, 200, 10),
        "c_map_epochs": 100,
        "c_lbfgs": 300,
        "c_batch": 128,
        "c_samples": 16,
        "c_epochs": 20,
        "c_em_epochs": 10,
        "c_em_steps": 6,
        "c_tolerance": 0.05,
    },
    "quick": {
        "a_n": 2_000,
        "a_batch": 100,
        "a_samples": 8,
        "a_cells": [(100, (3,), False), (100, (3,), True)],
        "a_momentum": [("mean", 3, 0.98)],
        "check_d": 50,
        "check_n": 500,
        "check_batch": 25,
        "b_n": 1_000,
        "b_batch": 100,
        "b_cells": [(16, 4, 1, None)],
        "b_timeout": 120.0,
        "b_reps": 1,
        "c_sizes": (64, 16, 10),
        "c_map_epochs": 5,
        "c_lbfgs": 0,
        "c_batch": 128,
        "c_samples": 4,
        "c_epochs": 2,
        "c_em_epochs": 1,
        "c_em_steps": 2,
        "c_tolerance": 0.05,
    },
}


def merge(out: Path, title: str, header: list[str], sections: dict[str, list[str]]) -> str:
    """The report: a fresh header, the sections just run, and the other parts' sections of an existing report."""
    old: dict[str, str] = {}
    if out.exists():
        text = out.read_text()
        for part in PARTS:
            found = re.search(rf"<!-- part {part} -->\n(.*?)<!-- /part {part} -->\n", text, re.S)
            if found:
                old[part] = found.group(1)
    body = []
    for part in PARTS:
        if part in sections:
            body.append(f"<!-- part {part} -->\n" + "\n".join(sections[part]) + f"\n<!-- /part {part} -->\n")
        elif part in old:
            body.append(f"<!-- part {part} -->\n{old[part]}<!-- /part {part} -->\n")
    return "\n".join([title, "", *header, "", *body])


def targets_section(out_text: str) -> str:
    """Recompute nothing: collect the per-part target rows kept in each section into one table at the end."""
    rows = re.findall(r"^\| \([abc]\) .*\|$", out_text, re.M)
    return "\n".join(["## Targets", "", "| target | measured | verdict |", "|---|---|---|", *rows, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized run (under a minute)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--parts", default="a,b,c", help="which parts to run, e.g. 'a' or 'b,c'")
    parser.add_argument(
        "--max-wait",
        type=float,
        default=0.0,
        help="before each measurement, wait up to this many seconds for other processes to go quiet (default 0)",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"markdown output (default {RESULTS})")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        width, k, epochs, cfg_json = args.worker
        worker_b(int(width), int(k), int(epochs), cfg_json, args.threads)
        return

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import resource

    cap = int(24 * 2**30)  # the machine may be shared: fail an oversized allocation rather than swap
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    cfg = CONFIGS["quick" if args.quick else "full"]
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        sys.exit(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    command = " ".join(["python benchmarks/bench_sample_then_optimize.py", *sys.argv[1:]])
    sections: dict[str, list[str]] = {}
    for part in PARTS:
        if part not in parts:
            continue
        summary: dict = {}
        start = time.perf_counter()
        stamp = machine(args.threads)
        body: list[str] = []
        if part == "a":
            part_a(cfg, args.max_wait, body, summary)
        elif part == "b":
            part_b(cfg, args.threads, args.max_wait, body, summary)
        else:
            part_c(cfg, body, summary)
        sections[part] = [
            f"## {TITLES[part]}",
            "",
            f"Command: `{command}` ({'quick' if args.quick else 'full'} run, this part "
            f"{time.perf_counter() - start:.0f} s; load average at the end "
            f"{load_average()})",
            "",
            *stamp,
            "",
            *body,
            "Targets of this part:",
            "",
            *targets(summary),
            "",
        ]
    title = "# Sample-then-optimise benchmark"
    header = [
        "Produced by `benchmarks/bench_sample_then_optimize.py`; each part's section says the command and the code "
        "it ran on. Read ratios rather than absolute times: the machine is shared.",
    ]
    text = merge(out, title, header, sections)
    text = text + "\n" + targets_section(text)
    write_report(text, out)


if __name__ == "__main__":
    main()
