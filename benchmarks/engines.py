"""The engines a suite runs: ours at the defaults, and each peer set up as a user would, its set-up counted.

Each :class:`Engine` names the optional packages it imports (``needs``); :func:`missing` says which are absent, and
the runner then writes a *skipped* cell with that reason, never nothing. An engine's ``run(cell)`` returns its
figures; the runner adds the time stamps, the load and the memory.

**MCMC engines** (problems with a posterior reference): ours is ``StochasticMCMC(SGHMC(model))`` with every default
(warm-up 500 steps, 4 vectorised chains, minibatch B = 1,000), re-run with twice the draws (same seed) until it is
accurate or its next run would pass the budget; its time is the accurate run's wall clock from the constructor on.
The NUTS peers (Pyro's ``NUTS``, NumPyro's ``NUTS``, BlackJAX's window adaptation + ``nuts``) and NumPyro's
``HMCECS`` (Taylor proxy at the posterior mode, subsample B = 1,000) run one chain of 500 warm-up iterations and
500 draws on the full data; their time is that run's, compilation included (a user's first run).

**Sample-then-optimise** (``ours-sto``): ``SampleThenOptimize(model, num_samples=2048)`` at its defaults, on
the same minibatches; its draws are independent, so 2,048 of them put a mean's Monte-Carlo error at 0.022 sd.

**Laplace engines** (the digits MLP, scored on held-out data): fit at the shared MAP, tune a scalar prior
precision by the evidence, the linearised (GLM) predictive with the probit link on the test set.

**From the digits MAP** (``swag-<E>``, ``ours-sghmc-<S>``): ``SWAG(model, start=MAP, rank=20)`` with its automatic
learning rate for E epochs, and ``SGHMC`` at its defaults with 4 vectorised chains from the MAP for S steps in all
(half warm-up); each predicts with the mean over 50 draws. Time: the call, the predictive included.

**Fixed-length runs** (the hierarchies, no reference): ``ours-sghmc-fixed`` is ``StochasticMCMC(SGHMC(model))`` at
every default with 4 chains, ``pyro-nuts-fixed`` Pyro's ``NUTS`` on the full data with one chain; both 1,000 warm-up
steps and 1,000 draws per chain (300 and 300 at the smoke size), scored by the smallest ESS over the unconstrained
coordinates, ESS per second of the whole run and the largest split r_hat (one chain: its two halves).

**Calibration** (the conjugate regression, exact sds): ``<kernel>-b<B>`` is ``StochasticMCMC(<kernel>(model))`` at
every default with minibatches of B (``bN``: the full data), many chains from ``init_to_uniform``;
``posteriors-<sgld|sghmc>-b<B>`` is posteriors 0.1.3's update at hand-picked settings (SGLD ε = 10⁻⁴; SGHMC
ε = 0.005, α = 100), no noise correction, the same chains and steps, driven by a plain loop.

**Sample-then-optimise** (``sto-*`` suites): ``ours-sto-accuracy`` runs ``SampleThenOptimize(model, K,
num_epochs=20)`` at every other default on a float64 linear-Gaussian model and scores its K draws against the exact
solves of the same perturbed problems (``state.targets``: no Monte-Carlo error) beside the timed Cholesky solve;
``ours-sto-cost`` times the engine's optimisation step (``core.step``, wrapped) against a hand-written forward +
backward of the tanh MLP, and the peak memory per extra draw from runs with K draws and one, in one process; the
``ours-sto-em-<groups>`` engines run EM for the prior precision from the digits MAP.

**One step's cost** (``sgmcmc-step``, ``step-blackjax``; ``--device cuda`` runs them on a GPU): SGHMC at a hand
step size and friction, one chain; a run of K steps minus a run of k, over K − k, is the time per step (set-up
cancels), the implementations interleaved over repetitions (``harness.time_per_step``): ``ours-step`` against a
hand-written ``torch.autograd`` loop on the same log density and posteriors' ``sghmc`` (CPU),
``ours-step-corrected`` the same with ``gradient_noise="correct"``, ``ours-16-chains`` 16 vectorised chains
against 16 sequential and a hand-written batched loop, in chain-steps per second; ``step-vs-blackjax`` our step
(eager, noise-corrected, compiled) and the hand-written one (eager, compiled) in interleaved blocks against
``jax.jit`` of a ``lax.scan`` of BlackJAX's SGLD steps.

**The cold posterior** (``cold-posterior``: the digits MLP 64-32-10, every engine at its defaults or as the
posteriors paper sets it up, each tempered to p(θ | D)^(1/T) for T in 1, 0.3, 0.1, 0.03, 0.01): SG-MCMC through the
kernel's ``temperature`` (SGHMC serial: one chain, many draws; parallel: many chains, the last draw of each); the
Gaussian engines (Laplace ``kron`` through the linearised network or with its weights sampled, Laplace ``sampled``,
SWAG, sample-then-optimise) through their covariance scaled by T (MultiSWAG: each run's about its own mean); SVI
with ``AutoNormal`` through the log joint scaled by 1/T. Scored on 450 held-out digits (NLL, accuracy, ECE) and by
the AUROC of the predictive's total entropy and of its epistemic part against the same digits turned 90°.

**EKF engines** (the GLM problems, N = 2,000 streamed once in minibatches of B): ``EKF(model)`` and
``DiagonalEKF(model)`` at their defaults, scored by the posterior's mean and sd against the exact ones.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import harness, metrics, problems, records

__all__ = ["ENGINES", "Cell", "Engine", "missing"]

BATCH, CHAINS, WARMUP, DRAWS = 1000, 4, 500, 500
STO_DRAWS = 2048  # independent draws: a mean's Monte-Carlo error 0.022 sd, well inside the 0.1-sd criterion


@dataclass
class Cell:
    """What an engine is handed: the problem, its data and reference (shared by the suite's cells), seed, budget."""

    problem: problems.Problem | None
    n: int
    seed: int
    budget: float
    shared: dict = field(default_factory=dict)  # per-suite cache: data, reference, the digits MAP
    size: str = "smoke"  # the suite's size: engines of a fixed length run longer at "full"

    def _cached(self, key: tuple, make: Callable[[], object]):
        """``shared[key]``, made by ``make()`` the first time a cell of the suite asks for it."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]

    @property
    def data(self) -> problems.Data:
        return self._cached(
            ("data", self.problem.name, self.n, self.seed), lambda: self.problem.data(self.n, self.seed)
        )

    @property
    def reference(self) -> dict:
        key = ("reference", self.problem.name, self.n, self.seed)
        return self._cached(key, lambda: problems.reference(self.problem, self.data))

    def prepare(self, family: str) -> None:
        """Make the shared inputs before the cell is timed: its time and memory are then the engine's alone."""
        kind = self.problem.kind if self.problem is not None else None
        made = {"hierarchy": "built", "teacher": "teacher", "step": "step", "cold": "cold"}
        made |= {"sto-linear": "data", "sto-mlp": "data"}  # their engines time the exact solve themselves
        if kind not in (None, "mlp"):  # the mlp is timed, not scored: no reference
            getattr(self, made.get(kind, "reference"))  # the reference makes the data too
        if family in ("laplace", "digits", "sto-em"):
            self.digits  # noqa: B018

    @property
    def built(self) -> tuple:
        """A hierarchy's (title, model, data): :data:`problems.HIERARCHIES`."""
        make = problems.HIERARCHIES[self.problem.name]
        return self._cached(("built", self.problem.name, self.n, self.seed), lambda: make(self.n, self.seed))

    @property
    def step(self) -> problems.StepProblem:
        """A step-cost problem's model and hand-written log density (:func:`problems.make_step`)."""
        key = ("step", self.problem.name, self.n, self.seed, str(problems.DEVICE))
        return self._cached(key, lambda: problems.make_step(self.problem, self.n, self.seed))

    @property
    def cold(self) -> dict:
        """The cold-posterior problem's digits (its first ``n`` training points)."""
        return self._cached(("cold", self.n), lambda: problems.cold_digits(self.n))

    @property
    def teacher(self) -> dict:
        """The teacher problem's data and MAP (20 Adam epochs and 100 L-BFGS steps; 3 and 50 at the smoke size)."""
        epochs, lbfgs = (20, 100) if self.size == "full" else (3, 50)
        key = ("teacher", self.n, self.seed, self.size)
        return self._cached(key, lambda: problems.teacher(self.n, self.seed, epochs, lbfgs))

    @property
    def digits(self) -> dict:
        return self._cached(("digits",), lambda: problems.digits(self.seed))


@dataclass(frozen=True)
class Engine:
    name: str
    family: str  # the page's section: "sgmcmc", "laplace"
    run: Callable[[Cell], dict]
    needs: tuple[str, ...] = ()
    description: str = ""


def missing(engine: Engine) -> list[str]:
    return [name for name in engine.needs if importlib.util.find_spec(name) is None]


def _scored(cell: Cell, draws: torch.Tensor, seconds: float, label: str | None = None) -> dict:
    """The draws' accuracy against the cell's reference and their mixing; with ``label`` (what the draws are, e.g.
    "500 × 1"), the run's seconds and that label first."""
    ref = cell.reference
    scored = {**metrics.accuracy(draws, ref["mean"], ref["sd"]), **metrics.mixing(draws, seconds)}
    scored["reference_ess"] = "exact" if ref["ess"] is None else round(ref["ess"])
    return scored if label is None else {"seconds": round(seconds, 2), "draws": label, **scored}


# ---------------------------------------------------------------------------------------------- MCMC
def _ours_sghmc(cell: Cell) -> dict:
    from pyro_scalable.infer import SGHMC, StochasticMCMC

    draws, spent = 250, 0.0
    while True:
        with harness.Timed() as timed:  # the HealthWarning is judged here against the reference instead
            lengths = {"num_samples": draws, "num_warmup": WARMUP, "num_chains": CHAINS}
            mcmc = StochasticMCMC(SGHMC(cell.problem.pyro_model(BATCH)), **lengths, seed=cell.seed, progress_bar=False)
            mcmc.run(cell.data.x, cell.data.y)
        spent += timed.seconds
        flat = cell.problem.flatten(mcmc.get_samples(group_by_chain=True))
        scored = _scored(cell, flat, timed.seconds, f"{draws} × {CHAINS}")
        if scored["accurate"] or spent + 2 * timed.seconds > cell.budget:
            return {**scored, "seconds_all_runs": round(spent, 2)}
        draws *= 2


def _run_pyro_nuts(model: Callable, data: tuple, warmup: int, draws: int, seed: int) -> tuple[dict, float]:
    """Pyro's ``NUTS``, one chain: its draws by site, ``(1, draws, ...)``, and the run's seconds."""
    import pyro
    from pyro.infer import MCMC, NUTS

    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    mcmc = MCMC(NUTS(model), num_samples=draws, warmup_steps=warmup, disable_progbar=True)
    mcmc.run(*data)
    return mcmc.get_samples(group_by_chain=True), time.perf_counter() - start


def _pyro_nuts(cell: Cell) -> dict:
    data = (cell.data.x, cell.data.y)
    samples, seconds = _run_pyro_nuts(cell.problem.pyro_model(), data, WARMUP, DRAWS, cell.seed)
    return _scored(cell, cell.problem.flatten(samples), seconds, f"{DRAWS} × 1")


def _jax_data(cell: Cell) -> tuple:
    import jax.numpy as jnp

    return jnp.asarray(cell.data.x.numpy()), jnp.asarray(cell.data.y.numpy())


def _numpyro_run(cell: Cell, kernel, extra: dict) -> dict:
    import jax
    from numpyro.infer import MCMC

    start = time.perf_counter()
    mcmc = MCMC(kernel, num_warmup=WARMUP, num_samples=DRAWS, num_chains=1, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(cell.seed), *_jax_data(cell))
    samples = jax.device_get(mcmc.get_samples(group_by_chain=True))
    seconds = time.perf_counter() - start
    flat = cell.problem.flatten({k: torch.from_numpy(v.copy()) for k, v in samples.items()})
    return {**_scored(cell, flat, seconds, f"{DRAWS} × 1"), **extra}


def _numpyro_nuts(cell: Cell) -> dict:
    from numpyro.infer import NUTS

    return _numpyro_run(cell, NUTS(cell.problem.numpyro_model()), {})


def _hmcecs(cell: Cell) -> dict:
    import jax.numpy as jnp
    from numpyro.infer import HMCECS, NUTS
    from numpyro.infer.hmc_gibbs import taylor_proxy

    mode = cell.reference["mode"] if "mode" in cell.reference else cell.reference["mean"]
    reference = {"w": jnp.asarray(mode[: cell.problem.d].float().numpy())}
    if "scale" in cell.problem.sites:
        reference["scale"] = jnp.exp(jnp.asarray(float(mode[-1])))
    kernel = HMCECS(NUTS(cell.problem.numpyro_model(BATCH)), num_blocks=100, proxy=taylor_proxy(reference, degree=2))
    return _numpyro_run(cell, kernel, {"subsample": BATCH})


def _blackjax_nuts(cell: Cell) -> dict:
    import blackjax
    import jax
    from numpyro.infer.util import initialize_model

    start = time.perf_counter()
    key = jax.random.PRNGKey(cell.seed)
    init_key, warm_key, sample_key = jax.random.split(key, 3)
    info = initialize_model(init_key, cell.problem.numpyro_model(), model_args=_jax_data(cell), dynamic_args=False)

    def logdensity(position):
        return -info.potential_fn(position)

    adaptation = blackjax.window_adaptation(blackjax.nuts, logdensity)
    (state, parameters), _ = adaptation.run(warm_key, info.param_info.z, num_steps=WARMUP)
    kernel = blackjax.nuts(logdensity, **parameters)

    def one_step(state, step_key):
        state, _ = kernel.step(step_key, state)
        return state, state.position

    _, positions = jax.lax.scan(one_step, state, jax.random.split(sample_key, DRAWS))
    positions = jax.device_get(positions)
    seconds = time.perf_counter() - start
    latents = {k: torch.from_numpy(v.copy())[None] for k, v in positions.items()}  # one chain
    return _scored(cell, cell.problem.flatten(latents, constrained=False), seconds, f"{DRAWS} × 1")


def _ours_sto(cell: Cell) -> dict:
    from pyro_scalable.infer import SampleThenOptimize

    model = cell.problem.pyro_model(BATCH)
    with harness.Timed() as timed:
        engine = SampleThenOptimize(model, num_samples=STO_DRAWS, seed=cell.seed, progress_bar=False)
        engine.run(cell.data.x, cell.data.y)
    flat = cell.problem.flatten(engine.get_samples())[None]  # independent draws: one "chain"
    return _scored(cell, flat, timed.seconds, f"{STO_DRAWS} independent")


# ---------------------------------------------------------------------------------------------- Laplace
def _fit_laplace(impl: str, problem: dict, structure: str, chunk: int, **options):
    """Ours (``AutoLinearizedLaplace``; ``options`` go to its ``laplace_approximation``) or laplace-torch's
    ``Laplace`` ("laplace-torch": its default backend, ``CurvlinopsGGN``; "laplace-torch-backpack") fitted on every
    weight at ``problem``'s MAP network (laplace-torch's default subset is the last layer), ``chunk`` points a batch."""
    if impl == "ours":
        from pyro_scalable.infer import AutoLinearizedLaplace

        guide = AutoLinearizedLaplace(problems.pyro_network(chunk, problem["sizes"]))
        x, y, latents = problem["x"], problem["y"], problem["latents"]
        return guide.laplace_approximation(x, y, structure=structure, map_latents=latents, chunk_size=chunk, **options)
    import laplace
    from laplace import curvature
    from torch.utils.data import DataLoader, TensorDataset

    net = problems.network(problem["sizes"])
    net.load_state_dict(problem["net"].state_dict())
    backend = curvature.BackPackGGN if impl.endswith("backpack") else curvature.CurvlinopsGGN
    setting = {"subset_of_weights": "all", "hessian_structure": structure, "prior_precision": problems.DIGITS_PRIOR}
    la = laplace.Laplace(net, "classification", **setting, backend=backend)
    la.fit(DataLoader(TensorDataset(problem["x"], problem["y"]), batch_size=chunk))
    return la


def _glm_probs(impl: str, posterior, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The probit GLM predictive's class probabilities at ``x`` (laplace-torch's ``chunk`` points at a time)."""
    if impl == "ours":
        return posterior.predict(x, link_approx="probit").distribution.probs.detach()
    return torch.cat([posterior(part, pred_type="glm", link_approx="probit") for part in x.split(chunk)])


def _laplace_digits(impl: str, structure: str) -> Callable[[Cell], dict]:
    """Fit at the digits MAP, a scalar prior precision tuned by the evidence, the probit predictive on the test set."""

    def run(cell: Cell) -> dict:
        digits = cell.digits
        start = time.perf_counter()
        posterior = _fit_laplace(impl, digits, structure, 256)
        if impl == "ours":
            posterior.optimize_prior_precision("scalar")
        else:
            posterior.optimize_prior_precision(pred_type="glm", method="marglik", prior_structure="scalar")
        probs = _glm_probs(impl, posterior, digits["x_test"], 256)
        seconds = time.perf_counter() - start
        prior = float(posterior.prior_precision.flatten()[0])
        return {"seconds": round(seconds, 2), "prior_precision": round(prior, 4), **_calibrated(probs, digits)}

    return run


def _map(cell: Cell) -> dict:
    digits = cell.digits
    with torch.no_grad():
        probs = torch.softmax(digits["net"](digits["x_test"]), -1)
    return _calibrated(probs, digits)  # the MAP is trained before the cell: no time of its own here


def _calibrated(probs: torch.Tensor, digits: dict) -> dict:
    return metrics.calibration(probs.detach(), digits["y_test"])


# ---------------------------------------------------------------------------------------------- Laplace cost
def _laplace_call(impl: str, operation: str, structure: str) -> Callable[[Cell], dict]:
    """One call on the teacher MLP (all weights), timed and its extra memory measured, after the same call on a tiny
    net (imports and lazy initialisation untimed). ``impl``: "ours", "laplace-torch" (its default backend,
    ``CurvlinopsGGN``) or "laplace-torch-backpack"; ``operation``: "fit" (the posterior and one evidence evaluation),
    "fit-checked" (ours with ``check_map=True``, the default) or "predict" (the probit GLM predictive on the test
    points, after an untimed fit)."""
    options = {"check_map": operation == "fit-checked"} if impl == "ours" else {}

    def once(problem: dict) -> dict:
        found: dict = {}
        if operation == "predict":
            posterior = _fit_laplace(impl, problem, structure, 1000, **options)
            float(posterior.log_marginal_likelihood())
        harness.release_free_memory()
        harness.reset_peak()
        base = harness.rss_mb()
        start = time.perf_counter()
        if operation == "predict":
            _glm_probs(impl, posterior, problem["x_test"], 100)
        else:
            evidence = _fit_laplace(impl, problem, structure, 1000, **options).log_marginal_likelihood()
            found["log_evidence"] = round(float(evidence), 1)
        found["seconds"] = round(time.perf_counter() - start, 3)
        found["call_mb"] = round(harness.peak_mb() - base, 1)
        return found

    def run(cell: Cell) -> dict:
        big = cell.teacher
        torch.manual_seed(0)
        tiny_sizes = (big["sizes"][0], 8, 8, big["sizes"][-1])
        net = problems.network(tiny_sizes)
        x = torch.randn(40, tiny_sizes[0])
        tiny = {"sizes": tiny_sizes, "net": net, "latents": problems.latents_of(net), "x": x, "x_test": x[:20]}
        tiny["y"] = torch.randint(0, tiny_sizes[-1], (40,))
        with harness.Timed():  # each call times itself; the warnings are not shown
            once(tiny)
            return once(big)

    return run


LAPLACE_CALLS = (
    ("ours", "fit", "diag"),
    ("ours", "fit-checked", "diag"),
    ("laplace-torch-backpack", "fit", "diag"),
    ("ours", "fit", "kron"),
    ("ours", "fit-checked", "kron"),
    ("laplace-torch", "fit", "kron"),
    ("laplace-torch-backpack", "fit", "kron"),
    ("ours", "predict", "kron"),
    ("laplace-torch", "predict", "kron"),
    ("laplace-torch-backpack", "predict", "kron"),
    ("ours", "predict", "diag"),
    ("laplace-torch-backpack", "predict", "diag"),
)


# ---------------------------------------------------------------------------------------------- from the digits MAP
DIGITS_DRAWS = 50


def _swag(epochs: int) -> Callable[[Cell], dict]:
    def run(cell: Cell) -> dict:
        from pyro_scalable.infer import SWAG

        digits = cell.digits
        with harness.Timed() as timed:  # lr="auto" capped by the stability bound warns: its lr is in the record
            options = {"start": digits["latents"], "num_epochs": epochs, "rank": 20, "seed": cell.seed}
            engine = SWAG(problems.pyro_network(), **options, progress_bar=False)
            posterior = engine.run(digits["x"], digits["y"])
            draws = posterior.get_samples(DIGITS_DRAWS, seed=cell.seed)
            probs = problems.member_probs(draws, digits["x_test"]).mean(0)
        return {"seconds": round(timed.seconds, 2), "lr": engine.stats.get("lr"), **_calibrated(probs, digits)}

    return run


def _digits_sghmc(steps: int) -> Callable[[Cell], dict]:
    def run(cell: Cell) -> dict:
        from pyro.infer.autoguide.initialization import init_to_value

        from pyro_scalable.infer import SGHMC, StochasticMCMC

        digits = cell.digits
        per_chain, kept = steps // CHAINS, DIGITS_DRAWS // CHAINS
        lengths = {"num_samples": kept, "num_warmup": per_chain // 2, "thin": max(1, (per_chain // 2) // kept)}
        with harness.Timed() as timed:  # the health warning: these draws are scored on held-out data instead
            kernel = SGHMC(problems.pyro_network(), init_strategy=init_to_value(values=digits["latents"]))
            mcmc = StochasticMCMC(kernel, **lengths, num_chains=CHAINS, seed=cell.seed, progress_bar=False)
            mcmc.run(digits["x"], digits["y"])
            probs = problems.member_probs(mcmc.get_samples(), digits["x_test"]).mean(0)
        return {"seconds": round(timed.seconds, 2), "draws": f"{kept} × {CHAINS}", **_calibrated(probs, digits)}

    return run


# ---------------------------------------------------------------------------------------------- hierarchies
FIXED_STEPS = {"smoke": 300, "full": 1000}  # warm-up steps and draws per chain of the fixed-length runs


def _fixed_scored(cell: Cell, model: Callable, samples: dict, chains: int, seconds: float, extra: dict) -> dict:
    _, _, data = cell.built
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in samples.items()}
    mixing = metrics.mixing(problems.unconstrained(model, data, flat, chains), seconds, halves=True)
    steps = FIXED_STEPS[cell.size]
    return {"seconds": round(seconds, 2), "draws": f"({steps} + {steps}) × {chains}", **mixing, **extra}


def _ours_fixed(cell: Cell) -> dict:
    from pyro_scalable.infer import SGHMC, StochasticMCMC

    _, model, data = cell.built
    steps = FIXED_STEPS[cell.size]
    lengths = {"num_samples": steps, "num_warmup": steps, "num_chains": CHAINS}
    with harness.Timed() as timed:  # judged here by ESS and r_hat
        mcmc = StochasticMCMC(SGHMC(model), **lengths, seed=cell.seed, progress_bar=False)
        mcmc.run(*data)
    cv = "off" if mcmc.control_variate is None else "at the mode" if mcmc.mode_search is not None else "window means"
    samples = mcmc.get_samples(group_by_chain=True)
    return _fixed_scored(cell, model, samples, CHAINS, timed.seconds, {"control_variate": cv})


def _nuts_fixed(cell: Cell) -> dict:
    _, model, data = cell.built

    def full(*args):
        return model(*args, batch=None)

    samples, seconds = _run_pyro_nuts(full, data, FIXED_STEPS[cell.size], FIXED_STEPS[cell.size], cell.seed)
    return _fixed_scored(cell, full, samples, 1, seconds, {})


# ---------------------------------------------------------------------------------------------- calibration
CALIBRATION = {"smoke": (32, 16, 100, 100), "full": (256, 128, 300, 600)}  # chains (at B = N), warm-up, kept
CALIBRATION_BATCHES = (10, 30, 100, None)  # None: the full data, exact gradients
HAND = {"sgld": {"step_size": 1e-4}, "sghmc": {"step_size": 5e-3, "friction": 100.0}}  # posteriors' hand settings


def _sd_scored(cell: Cell, draws: torch.Tensor, seconds: float, extra: dict) -> dict:
    """Per coordinate the sd of the draws (chains, draws, d) over the exact sd, its Monte-Carlo error; mean error."""
    from pyro.ops.stats import effective_sample_size

    ref = cell.reference
    draws = draws.double()
    ratio = draws.reshape(-1, draws.shape[-1]).std(0) / ref["sd"]
    ess = effective_sample_size(draws, chain_dim=0, sample_dim=1).clamp_min(1.0)
    error = ((draws.reshape(-1, draws.shape[-1]).mean(0) - ref["mean"]) / ref["sd"]).abs().max()
    return {
        "seconds": round(seconds, 2),
        "sd_ratios": [round(float(r), 3) for r in ratio],
        "mcse": round(float((ratio / (2 * ess).sqrt()).max()), 3),
        "mean_error_sd": round(float(error), 4),
        "sd_error": round(float((ratio - 1).abs().max()), 4),
        **extra,
    }


def _calibration_chains(cell: Cell, batch: int | None) -> tuple[int, int, int]:
    chains, chains_full, warmup, kept = CALIBRATION[cell.size]
    return (chains if batch else chains_full), warmup, kept


def _kernel_at(kernel: str, batch: int | None) -> Callable[[Cell], dict]:
    def run(cell: Cell) -> dict:
        from pyro_scalable import infer

        chains, warmup, kept = _calibration_chains(cell, batch)
        lengths = {"num_samples": kept, "num_warmup": warmup, "num_chains": chains, "seed": cell.seed}
        with harness.Timed() as timed:  # minibatches="independent": what a noise-estimating kernel gets by default
            model = getattr(infer, kernel)(cell.problem.pyro_model(batch))
            mcmc = infer.StochasticMCMC(model, **lengths, progress_bar=False, minibatches="independent")
            mcmc.run(cell.data.x, cell.data.y)
        stats = mcmc.sample_stats
        extra = {"draws": f"{kept} × {chains}", "step_size": float(stats["step_size"].float().median())}
        if "friction" in stats:
            extra["friction"] = float(stats["friction"].float().median())
        extra["warnings"] = sorted({str(w.message).split(":")[0][:90] for w in timed.caught})
        return _sd_scored(cell, cell.problem.flatten(mcmc.get_samples(group_by_chain=True)), timed.seconds, extra)

    return run


def _posteriors_at(method: str, batch: int | None) -> Callable[[Cell], dict]:
    """posteriors' ``sgld``/``sghmc`` update (``beta=0``) at the hand settings, C chains as the rows of one tensor."""

    def run(cell: Cell) -> dict:
        import posteriors

        module = getattr(posteriors.sgmcmc, method)
        chains, warmup, kept = _calibration_chains(cell, batch)
        x, y, n, hyper = cell.data.x, cell.data.y, cell.n, HAND[method]
        torch.manual_seed(cell.seed)  # posteriors draws its noise from torch's global generator
        gen = torch.Generator().manual_seed(cell.seed)
        params = {"w": torch.rand(chains, cell.problem.d, generator=gen, dtype=x.dtype) * 4.0 - 2.0}  # U(-2, 2)

        def log_posterior(params: dict, idx: torch.Tensor | None) -> tuple:  # the N/B scaling written by hand
            w = params["w"]
            residual = y - w @ x.T if idx is None else y[idx] - (x[idx] @ w.unsqueeze(-1)).squeeze(-1)
            value = -0.5 * w.square().sum() - 0.5 * (n / residual.shape[-1]) * residual.square().sum()
            return value, value.detach()

        state = module.init(params) if method == "sgld" else module.init(params, momenta=None)
        options = {"lr": hyper["step_size"], "beta": 0.0, "inplace": True}
        if method == "sghmc":
            options["alpha"] = hyper["friction"]
        draws = torch.empty(chains, kept, cell.problem.d, dtype=x.dtype)
        start = time.perf_counter()
        for t in range(warmup + kept):
            idx = torch.randint(n, (chains, batch), generator=gen) if batch else None
            state, _ = module.update(state, idx, log_posterior, **options)
            if t >= warmup:
                draws[:, t - warmup] = state.params["w"]
        seconds = time.perf_counter() - start
        return _sd_scored(cell, draws, seconds, {"draws": f"{kept} × {chains}", **hyper})

    return run


# ---------------------------------------------------------------------------------------------- data-parallel
DISTRIBUTED = {"smoke": ((5, 15), 1, 1), "full": ((10, 50), 2, 2)}  # steps short and long, launches, repetitions


def _data_parallel(noise: str) -> Callable[[Cell], dict]:
    """``SGLD(model, step_size=1e-5, gradient_noise=noise)``, 4 chains, ``distributed="data"`` under ``torchrun`` on 1
    and 2 CPU ranks (gloo, one thread each), the two interleaved: time per step ``(T(long) - T(short)) / (long -
    short)`` on rank 0 between barriers, so that setup cancels; the median over launches and repetitions."""

    def run(cell: Cell) -> dict:
        steps, launches, reps = DISTRIBUTED[cell.size]
        times: dict[int, list[float]] = {1: [], 2: []}
        start = time.perf_counter()
        for _ in range(launches):
            for ranks in (1, 2):
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "times.json"
                    spec = {"noise": noise, "n": cell.n, "steps": steps, "reps": reps, "out": str(out)}
                    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
                    command += [f"--nproc_per_node={ranks}", "-m", "benchmarks", "_data_parallel", json.dumps(spec)]
                    env = {**os.environ, "OMP_NUM_THREADS": "1"}
                    subprocess.run(command, check=True, env=env, capture_output=True, cwd=records.ROOT)
                    times[ranks] += json.loads(out.read_text())
        t1, t2 = statistics.median(times[1]), statistics.median(times[2])
        return {
            "seconds": round(time.perf_counter() - start, 1),
            "step_ms_1_rank": round(1e3 * t1, 1),
            "step_ms_2_ranks": round(1e3 * t2, 1),
            "speedup": round(t1 / t2, 2),
            "efficiency": round(t1 / (2 * t2), 2),
            "steps": f"{steps[0]} → {steps[1]}, {launches * reps} repetition{'s' * (launches * reps > 1)}",
        }

    return run


def data_parallel_worker(noise: str, n: int, steps: list[int], reps: int, out: str) -> None:
    """One ``torchrun`` rank of :func:`_data_parallel` (``python -m benchmarks _data_parallel '<JSON of these>'``)."""
    import torch.distributed as tdist

    from pyro_scalable.infer import SGLD, StochasticMCMC

    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    problem = problems.PROBLEMS["mlp-regression"]
    data = problem.data(n)
    kernel = SGLD(problem.pyro_model(BATCH), step_size=1e-5, gradient_noise=noise)

    mcmc = functools.partial(StochasticMCMC, kernel, num_chains=CHAINS, seed=0, progress_bar=False, distributed="data")
    mcmc(num_samples=steps[0]).run(data.x, data.y)  # first calls (vmap, Pyro's tracing caches) are slower
    times = []
    for _ in range(reps):
        per_run = []
        for num in steps:
            runner = mcmc(num_samples=num)
            tdist.barrier()
            start = time.perf_counter()
            runner.run(data.x, data.y)
            tdist.barrier()
            per_run.append(time.perf_counter() - start)
        times.append((per_run[1] - per_run[0]) / (steps[1] - steps[0]))
    if tdist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    tdist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- sample-then-optimise
STO_ACCURACY = {"smoke": (8, 100), "full": (32, 500)}  # draws K, minibatch B
STO_COST = {64: (64, 2), 280: (16, 2), 950: (8, 1)}  # hidden width: draws K, epochs
STO_EM = {"smoke": (8, 5, 3, 4), "full": (16, 20, 10, 6)}  # draws, epochs, EM epochs, EM steps
STO_BATCH, EM_TOLERANCE = 500, 0.05


def _sto_accuracy(cell: Cell) -> dict:
    """K draws against the exact solves H⁻¹Aθⁿ of the same regulariser centres θⁿ; the exact Cholesky solve timed."""
    from pyro_scalable.infer import SampleThenOptimize

    k, batch = STO_ACCURACY[cell.size]
    x, y = cell.data.x, cell.data.y
    start = time.perf_counter()  # the exact posterior: form H = XᵀX + I, Cholesky, the mean, K draws
    h = x.T @ x
    h.diagonal().add_(1.0)
    chol = torch.linalg.cholesky(h)
    mean = torch.cholesky_solve((x.T @ y).unsqueeze(-1), chol).squeeze(-1)
    noise = torch.randn(cell.problem.d, k, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    mean + torch.linalg.solve_triangular(chol.T, noise, upper=True).T
    exact_seconds = time.perf_counter() - start
    sd = torch.cholesky_inverse(chol).diagonal().sqrt()
    engine = SampleThenOptimize(
        problems.sto_linear_model(cell.problem.d, batch), num_samples=k, num_epochs=20, seed=2, progress_bar=False
    )
    with harness.Timed() as timed:
        engine.run(x, y)
    seconds = timed.seconds
    zeta = engine.state.samples[:-1].detach()  # the optimised zero-mean draws
    same = torch.cholesky_solve(engine.state.targets[:-1].T, chol).T  # exact solves, the same centres (α = 1)
    c_hat, c_same = zeta.T @ zeta / k, same.T @ same / k
    return {
        "seconds": round(seconds, 2),
        "exact_seconds": round(exact_seconds, 3),
        "slower": round(seconds / exact_seconds, 1),
        "draws": k,
        "cg_passes": engine.cg_passes[0] if engine.cg_passes else 0,
        "mean_error_sd": round(float(((engine.mean_unconstrained - mean) / sd).abs().max()), 4),
        "cov_error": round(float((c_hat - c_same).norm() / c_same.norm()), 4),
        "sd_error": round(float(((c_hat.diagonal() / c_same.diagonal()).sqrt() - 1).abs().max()), 4),
        "warned": any("not converged" in str(w.message) for w in timed.caught),
    }


def _hand_step_seconds(weights: dict, x: torch.Tensor, y: torch.Tensor, reps: int = 20) -> float:
    """Median time of a hand-written forward + ``torch.autograd.grad`` of the minibatch loss w.r.t. all weights."""
    params = {name: v.clone().requires_grad_(True) for name, v in weights.items()}
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(reps + 3):
        idx = torch.randperm(x.shape[0], generator=gen)[:STO_BATCH]
        start = time.perf_counter()
        loss = 0.5 * ((problems.sto_forward(params, x[idx]) - y[idx]) / problems.STO_NOISE).square().sum()
        torch.autograd.grad(loss, list(params.values()))
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def _sto_cost(cell: Cell) -> dict:
    """The engine's step per draw against a hand-written forward + backward; peak memory per extra draw (K vs 1)."""
    from pyro_scalable.infer import SampleThenOptimize
    from pyro_scalable.infer.linearized.sampling import core

    width, d = cell.problem.width, cell.problem.d
    k, epochs = STO_COST[width]
    steps: list[float] = []
    original = core.step

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        steps.append(time.perf_counter() - start)
        return out

    def run(num: int, data: problems.Data, w: int = width) -> tuple[float, float]:
        model, sizes = problems.sto_mlp(w, STO_BATCH)
        options = {"linearize_at": problems.sto_mlp_weights(sizes, 1), "chunk_size": STO_BATCH, "refine_passes": 0}
        # refine_passes=0: the minibatch step is measured; a refinement pass costs about an epoch
        engine = SampleThenOptimize(model, num_samples=num, num_epochs=epochs, **options, seed=0, progress_bar=False)
        harness.release_free_memory()
        harness.reset_peak()
        before = harness.rss_mb()
        steps.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.run(data.x, data.y)
        extra = harness.peak_mb() - before
        del engine
        return statistics.median(steps), extra

    core.step = timed
    try:
        run(2, problems.Data(*problems.sto_mlp_data(4, 4 * STO_BATCH)), 4)  # warm-up: a 4-unit net, the same path
        one, extra_one = run(1, cell.data)
        step, extra_k = run(k, cell.data)
    finally:
        core.step = original
    _, sizes = problems.sto_mlp(width, STO_BATCH)
    hand = _hand_step_seconds(problems.sto_mlp_weights(sizes, 1), cell.data.x, cell.data.y)
    per_draw_mb = (extra_k - extra_one) / (k - 1)
    return {
        "seconds": round(step, 4),
        "draws": k,
        "per_draw_vs_hand": round(step / k / hand, 2),
        "marginal_vs_hand": round((step - one) / (k - 1) / hand, 2),
        "hand_seconds": round(hand, 5),
        "extra_mb": f"{extra_one:.0f} / {extra_k:.0f}",
        # below 16 MB of difference the peak RSS does not resolve it (benchmarks/harness.py)
        "floats_per_draw": None if extra_k - extra_one < 16 else round(per_draw_mb * 2**20 / 4 / d, 1),
    }


def _sto_em(groups: str) -> Callable[[Cell], dict]:
    """EM for the prior precision (``em_groups``) from the digits MAP; the probit predictive on the test set."""

    def run(cell: Cell) -> dict:
        from pyro_scalable.infer import SampleThenOptimize

        digits = cell.digits
        k, epochs, em_epochs, em_steps = STO_EM[cell.size]
        em = {"em_epochs": em_epochs, "em_steps": em_steps, "em_groups": groups, "linearize_at": digits["latents"]}
        with harness.Timed() as timed:
            model = problems.pyro_network(chunk=128)
            engine = SampleThenOptimize(model, num_samples=k, num_epochs=epochs, **em, seed=0, progress_bar=False)
            engine.run(digits["x"], digits["y"])
        seconds = timed.seconds
        alphas = engine.em_history["prior_precision"]  # (em_steps + 1, groups)
        change = ((alphas[1:] - alphas[:-1]).abs() / alphas[:-1]).max(-1).values
        settled = next((t + 1 for t in range(len(change)) if bool((change[t:] < EM_TOLERANCE).all())), None)
        probs = engine.predict(digits["x_test"], link_approx="probit").distribution.probs.detach()
        return {
            "seconds": round(seconds, 1),
            "em_steps": em_steps,
            "settled": "not within the run" if settled is None else settled,
            "changes": ", ".join(f"{float(c):.1%}" for c in change),
            "prior_precision": ", ".join(f"{float(a):.3g}" for a in alphas[-1]),
            "effective_dimension": round(float(engine.em_history["effective_dimension"][-1].sum()), 1),
            **metrics.calibration(probs, digits["y_test"]),
        }

    return run


# ---------------------------------------------------------------------------------------------- one step's cost
def run_ours(problem: problems.StepProblem, num_steps: int, seed: int, **options) -> tuple[float, float]:
    """Our SGHMC at the problem's step size and friction (``gradient_noise`` "ignore" unless given)."""
    from pyro_scalable.infer import SGHMC, StochasticMCMC

    noise = options.pop("gradient_noise", "ignore")
    kernel = SGHMC(problem.model, step_size=problem.step_size, friction=problem.friction, gradient_noise=noise)
    mcmc = StochasticMCMC(kernel, num_samples=1, num_warmup=num_steps - 1, seed=seed, progress_bar=False, **options)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a hand-set step with the noise ignored: the width warning is right
        mcmc.run(problem.x, problem.y)
    return problems.elapsed(start), float(mcmc.sample_stats["lp"].float().mean())


def run_hand_written(problem: problems.StepProblem, num_steps: int, seed: int, chains: int = 0) -> tuple[float, float]:
    """The loop a torch user writes (autograd, in-place updates); ``chains``: one vmapped density for all of them."""
    start = time.perf_counter()
    gen, noise_gen = torch.Generator().manual_seed(seed), problems.noise_generator(seed)
    if chains:
        inits = [problems.uniform_init(problem, gen) for _ in range(chains)]
        latents = {name: torch.stack([i[name] for i in inits]).requires_grad_() for name in problem.shapes}
    else:
        latents = {name: value.requires_grad_() for name, value in problems.uniform_init(problem, gen).items()}
    momenta = {name: torch.zeros_like(value) for name, value in latents.items()}
    eps, alpha = problem.step_size, problem.friction
    decay, noise_scale = 1.0 - eps * alpha, math.sqrt(2.0 * alpha * eps)
    streams = [problems.epoch_batches(problem.num_data, problem.batch_size, gen) for _ in range(max(chains, 1))]
    density = torch.func.vmap(problem.log_density) if chains else problem.log_density
    x, y = problem.x, problem.y
    for _ in range(num_steps):
        idx = torch.stack([next(stream) for stream in streams]) if chains else next(streams[0])
        log_post = density(latents, x[idx], y[idx])
        grads = torch.autograd.grad(log_post.sum(), tuple(latents.values()))
        with torch.no_grad():
            for (name, value), grad in zip(latents.items(), grads):
                noise = torch.randn(value.shape, generator=noise_gen, device=problems.DEVICE)
                momenta[name].mul_(decay).add_(grad, alpha=eps).add_(noise, alpha=noise_scale)
                value.add_(momenta[name], alpha=eps)
    return problems.elapsed(start), float(log_post.detach().mean())


def run_posteriors(problem: problems.StepProblem, num_steps: int, seed: int) -> tuple[float, float]:
    """posteriors' SGHMC transform, in place, on the same log density and minibatches."""
    import posteriors

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # posteriors draws its noise from the global generator

    def log_posterior(params: dict, batch: tuple) -> tuple:
        value = problem.log_density(params, *batch)
        return value, value

    transform = posteriors.sgmcmc.sghmc.build(
        log_posterior, lr=problem.step_size, alpha=problem.friction, sigma=1.0, temperature=1.0, momenta=0.0
    )
    state = transform.init(problems.uniform_init(problem, gen))
    batches = problems.epoch_batches(problem.num_data, problem.batch_size, gen)
    for _ in range(num_steps):
        idx = next(batches)
        state, _ = transform.update(state, (problem.x[idx], problem.y[idx]), inplace=True)
    return time.perf_counter() - start, float(state.log_posterior)


# (short, long) steps per problem kind, repetitions; vectorised and sequential chains' (short, long)
STEP_RUNS = {
    "smoke": {"logistic": (20, 520), "mlp": (20, 80), "reps": 3, "chains": {"logistic": ((20, 170), (3, 43))}},
    "full": {"logistic": (50, 2050), "mlp": (20, 320), "reps": 5, "chains": {"logistic": ((20, 320), (5, 65))}},
}
STEP_RUNS["smoke"]["chains"]["mlp"], STEP_RUNS["full"]["chains"]["mlp"] = ((20, 30), (2, 8)), ((20, 60), (5, 25))


def _step_timing(cell: Cell, variant: str) -> dict:
    from pyro_scalable.bridge.traced import TRACE_AFTER
    from pyro_scalable.infer.sgmcmc.base import NOISE_EVERY

    problem, runs = cell.step, STEP_RUNS[cell.size]
    kind = "mlp" if cell.problem.name == "step-mlp" else "logistic"
    short, long = runs[kind]
    harness.warm_up_torch()
    if variant == "chains":
        vectorised, sequential = runs["chains"][kind]  # (short, long) steps each
        runners = {
            "vectorised": (lambda k, s: run_ours(problem, k, s, num_chains=16), *vectorised),
            "sequential": (lambda k, s: run_ours(problem, k, s, num_chains=16, chain_method="sequential"), *sequential),
            "hand-written batched": (lambda k, s: run_hand_written(problem, k, s, chains=16), *vectorised),
        }
        res = harness.time_per_step(runners, 3)
        vec, seq, batched = res["vectorised"], res["sequential"], res["hand-written batched"]
        return {
            "seconds": round(vec.median, 5),
            "vectorised_per_s": round(16 / vec.median),
            "sequential_per_s": round(16 / seq.median),
            "batched_per_s": round(16 / batched.median),
            "vs_sequential": round(harness.median_ratio(seq, vec), 2),
            "vs_batched": round(harness.median_ratio(batched, vec), 2),
            "clean": harness.clean_note(res),
        }
    runners = {"hand": (lambda k, s: run_hand_written(problem, k, s), short, long)}
    if variant == "corrected":  # past the recording of the noise steps' densities (their 16th call)
        past = max(short, NOISE_EVERY * TRACE_AFTER + 4)
        runners["ours"] = (lambda k, s: run_ours(problem, k, s, gradient_noise="correct"), past, long)
    else:
        runners["ours"] = (lambda k, s: run_ours(problem, k, s), short, long)
        if problems.DEVICE.type == "cpu" and importlib.util.find_spec("posteriors") is not None:
            runners["posteriors"] = (lambda k, s: run_posteriors(problem, k, s), short, long)
    res = harness.time_per_step(runners, runs["reps"])
    ours, hand, post = res["ours"], res["hand"], res.get("posteriors")
    out = {
        "seconds": round(ours.median, 6),
        "ours_ms": round(ours.median * 1e3, 3),
        "hand_ms": round(hand.median * 1e3, 3),
        "vs_hand": round(harness.median_ratio(ours, hand), 2),
        "setup_s": round(ours.median_setup, 2),
        "clean": harness.clean_note(res),
    }
    if post is not None:
        out.update(posteriors_ms=round(post.median * 1e3, 3), vs_posteriors=round(harness.median_ratio(ours, post), 2))
    return out


class OursStepper:
    """Our step alone: a short run, then its stepper stepped in blocks on its own sampler."""

    def __init__(self, problem: problems.StepProblem, noise: str, compiled: bool) -> None:
        from pyro_scalable import model_tracing
        from pyro_scalable.infer import SGHMC, StochasticMCMC
        from pyro_scalable.infer.sgmcmc import phases

        if compiled:  # dynamo recompiles a function at most 8 times per process: each its own start
            torch._dynamo.reset()
        self.compiled, captured, original = compiled, {}, phases.step

        def spy(run, state, t):
            captured["state"] = state
            return original(run, state, t)

        kernel = SGHMC(problem.model, step_size=BLACKJAX_STEP, friction=BLACKJAX_FRICTION, gradient_noise=noise)
        phases.step = spy
        try:
            # the stepper is built under the switch; one step per graph: this stepper is stepped outside the driver
            with model_tracing(compile=compiled, block_steps=1), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                StochasticMCMC(kernel, num_samples=4, num_warmup=4, seed=0, progress_bar=False).run(
                    problem.x, problem.y
                )
        finally:
            phases.step = original
        self.state, self.t = captured["state"], 8

    def __call__(self, steps: int) -> float:
        from pyro_scalable import model_tracing
        from pyro_scalable.bridge import Batch

        state = self.state
        with model_tracing(compile=self.compiled, block_steps=1):
            start = time.perf_counter()
            for _ in range(steps):
                batch = Batch(next(state.sampler), state.bridge.args, state.bridge.kwargs)
                state.stepper.step(batch, self.t, state.estimators.calibrated)
                self.t += 1
            return problems.elapsed(start)


class _HandStepper:
    """The hand-written SGHMC step, eager or as one compiled step (``graphs``: CUDA graphs)."""

    def __init__(self, problem: problems.StepProblem, compiled: bool, graphs: bool = False) -> None:
        gen = torch.Generator().manual_seed(0)
        self.problem, self.graphs = problem, graphs
        self.w = (torch.rand(problem.shapes["w"][0], generator=gen) * 4 - 2).to(problems.DEVICE)
        self.m = torch.zeros_like(self.w)
        self.batches = problems.epoch_batches(problem.num_data, problem.batch_size, gen)
        decay, scale = 1.0 - BLACKJAX_STEP * BLACKJAX_FRICTION, math.sqrt(2.0 * BLACKJAX_FRICTION * BLACKJAX_STEP)

        def step(w, m, idx):
            grad = torch.func.grad(lambda w: problem.log_density({"w": w}, problem.x[idx], problem.y[idx]))(w)
            m = decay * m + BLACKJAX_STEP * grad + scale * torch.randn_like(w)
            return w + BLACKJAX_STEP * m, m

        def eager(w, m, idx):  # autograd and in-place updates: the loop a torch user writes
            w = w.detach().requires_grad_()
            (grad,) = torch.autograd.grad(problem.log_density({"w": w}, problem.x[idx], problem.y[idx]), (w,))
            with torch.no_grad():
                m.mul_(decay).add_(grad, alpha=BLACKJAX_STEP).add_(torch.randn_like(m), alpha=scale)
                return w.add_(m, alpha=BLACKJAX_STEP), m

        mode = "reduce-overhead" if graphs else None  # CUDA graphs: the step's kernels replayed as one graph
        self.step = torch.compile(step, dynamic=False, mode=mode) if compiled else eager

    def __call__(self, steps: int) -> float:
        w, m = self.w, self.m
        start = time.perf_counter()
        for _ in range(steps):
            if self.graphs:  # the graph's outputs are overwritten by its next replay: the state is copied out
                torch.compiler.cudagraph_mark_step_begin()
                w, m = (t.clone() for t in self.step(w, m, next(self.batches)))
            else:
                w, m = self.step(w, m, next(self.batches))
        self.w, self.m = w, m
        return problems.elapsed(start)


class _BlackJAXStepper:
    """``jax.jit`` of a ``lax.scan`` over ``block`` steps of BlackJAX's SGLD, minibatches gathered inside the scan."""

    def __init__(self, problem: problems.StepProblem, block: int) -> None:
        import blackjax
        import jax
        import jax.numpy as jnp

        self.jax, self.block = jax, block
        x, y = jnp.asarray(problem.x.cpu().numpy()), jnp.asarray(problem.y.cpu().numpy())  # JAX's default device

        def loglik(w, example):
            logit = example[0] @ w
            return example[1] * logit - jnp.logaddexp(0.0, logit)

        grad = blackjax.sgmcmc.gradients.grad_estimator(lambda w: -0.5 * jnp.sum(w**2), loglik, problem.num_data)
        algo = blackjax.sgld(grad)

        def scan(key, w, idx):
            def body(w, inputs):
                k, i = inputs
                return algo.step(k, w, (x[i], y[i]), BLACKJAX_STEP), None

            return jax.lax.scan(body, w, (jax.random.split(key, idx.shape[0]), idx))[0]

        self.run = jax.jit(scan)
        gen = torch.Generator().manual_seed(0)
        epochs = -(-block * problem.batch_size // problem.num_data)
        order = torch.cat([torch.randperm(problem.num_data, generator=gen) for _ in range(epochs)])
        self.idx = jnp.asarray(order[: block * problem.batch_size].reshape(block, problem.batch_size).numpy())
        self.w, self.key = jnp.zeros(x.shape[1]), jax.random.PRNGKey(0)

    def __call__(self, steps: int) -> float:
        assert steps == self.block, "the scan is compiled for one block length"
        self.key, key = self.jax.random.split(self.key)
        start = time.perf_counter()
        self.w = self.run(key, self.w, self.idx)
        self.w.block_until_ready()
        return time.perf_counter() - start


BLACKJAX_STEP, BLACKJAX_FRICTION = 1e-4, 10.0
BLACKJAX_ROUNDS = {"smoke": (3, 200), "full": (5, 300)}  # interleaved rounds, steps per block


def _step_vs_blackjax(cell: Cell) -> dict:
    """Each candidate built, its first block timed (compiling), then interleaved rounds: median ms per step."""
    problem, (rounds, block) = cell.step, BLACKJAX_ROUNDS[cell.size]
    candidates = {
        "ours_eager": lambda: OursStepper(problem, "ignore", False),
        "ours_corrected": lambda: OursStepper(problem, "correct", False),
        "ours_compiled": lambda: OursStepper(problem, "correct", True),
        "hand": lambda: _HandStepper(problem, False),
        "hand_compiled": lambda: _HandStepper(problem, True),
        **({"hand_graphs": lambda: _HandStepper(problem, True, True)} if problems.DEVICE.type == "cuda" else {}),
        "blackjax": lambda: _BlackJAXStepper(problem, block),
    }
    built, first = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, make in candidates.items():
            start = time.perf_counter()
            built[name] = make()
            first[name] = time.perf_counter() - start + built[name](block)  # set-up and the first block
        times: dict[str, list[float]] = {name: [] for name in built}
        for _ in range(rounds):
            for name, run in built.items():
                times[name].append(run(block) / block)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "seconds": round(ms["ours_corrected"] / 1e3, 7),
        **{f"{name}_ms": round(value, 3) for name, value in ms.items()},
        "eager_vs_blackjax": round(ms["ours_eager"] / ms["blackjax"], 1),
        "compiled_vs_blackjax": round(ms["ours_compiled"] / ms["blackjax"], 1),
        "compile_s": round(max(first["ours_compiled"] - block * ms["ours_compiled"] / 1e3, 0.0), 1),
        "rounds": f"{rounds} × {block} steps",
    }


# ---------------------------------------------------------------------------------------------- the cold posterior
TEMPERATURES, COLD_DRAWS = (1.0, 0.3, 0.1, 0.03, 0.01), 100  # weight draws per Gaussian predictive
COLD = {  # steps and draws: the smoke size is the old script's --fast
    "full": dict(map_steps=(1000, 500), warmup=1500, serial=(50, 30), chains=10, svi_steps=1500, swag=30, sto=(16, 30)),
    "smoke": dict(map_steps=(400, 200), warmup=400, serial=(10, 20), chains=6, svi_steps=400, swag=10, sto=(8, 10)),
}
COLD_RUNS = {"full": 4, "smoke": 2}  # MultiSWAG's runs


def _cold_scores(p_test: torch.Tensor, y_test: torch.Tensor, p_ood: torch.Tensor) -> dict:
    from sklearn.metrics import roc_auc_score

    from pyro_scalable.infer.uncertainty import decompose_probabilities

    out = metrics.calibration(p_test.mean(0), y_test)
    u_in, u_out = decompose_probabilities(p_test), decompose_probabilities(p_ood)
    truth = [0] * len(y_test) + [1] * p_ood.shape[1]
    for part in ("total", "epistemic"):
        scores = torch.cat([getattr(u_in, part), getattr(u_out, part)]).cpu().numpy()
        out[f"auroc_{part}"] = None if p_test.shape[0] == 1 else round(float(roc_auc_score(truth, scores)), 4)
    return out


def _cold_map(cell: Cell) -> dict:
    """SVI with AutoDelta: Adam on minibatches, then on the full data (cached for the suite's other cells)."""
    import pyro
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoDelta

    key = ("cold-map", cell.n, cell.seed, cell.size)
    if key not in cell.shared:
        data, steps = cell.cold, COLD[cell.size]["map_steps"]
        pyro.clear_param_store()
        pyro.set_rng_seed(cell.seed)
        mlp = problems.cold_mlp()
        guide = AutoDelta(mlp)
        for lr, count, batch in ((1e-2, steps[0], problems.COLD_BATCH), (3e-3, steps[1], None)):
            svi = SVI(mlp, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
            for _ in range(count):
                svi.step(data["x"], data["y"], batch_size=batch)
        cell.shared[key] = {k: v.detach() for k, v in guide.median(data["x"], data["y"]).items()}
    return cell.shared[key]


def _cold(engine: str) -> Callable[[Cell], dict]:
    """One engine's fit, then its predictive at every temperature: per metric, a list in ``TEMPERATURES``' order."""

    def scaled(samples: dict, centre: dict, t: float) -> dict:  # N(centre, T Σ) from draws of N(centre, Σ)
        return {k: centre[k].to(v) + math.sqrt(t) * (v - centre[k].to(v)) for k, v in samples.items()}

    def glm(prediction, t: float, seed: int) -> torch.Tensor:  # softmax(f), f ~ N(mean, T cov) per point
        mean, cov = prediction.mean.double(), t * prediction.covariance.double()
        values, vectors = torch.linalg.eigh(cov)  # sample-then-optimise's draws' covariance can be singular
        root = vectors * values.clamp_min(0.0).sqrt().unsqueeze(-2)
        noise = torch.randn((COLD_DRAWS, *mean.shape), generator=torch.Generator().manual_seed(seed), dtype=mean.dtype)
        return torch.softmax(mean + torch.einsum("nij,snj->sni", root, noise), -1)

    def run(cell: Cell) -> dict:
        import pyro
        from pyro import poutine
        from pyro.infer import SVI, Trace_ELBO
        from pyro.infer.autoguide import AutoNormal
        from pyro.infer.autoguide.initialization import init_to_sample

        from pyro_scalable.infer import SGHMC, SGLD, SWAG, AutoLinearizedLaplace, SampleThenOptimize, StochasticMCMC
        from pyro_scalable.infer import sghmc as sghmc_module

        data, cfg, seed = cell.cold, COLD[cell.size], cell.seed
        x, y, mlp = data["x"], data["y"], problems.cold_mlp
        found: list[dict] = []

        def score(samples: dict | None = None, probs: tuple | None = None) -> None:
            if probs is None:
                probs = tuple(problems.member_probs(samples, data[k], torch.tanh) for k in ("x_test", "x_ood"))
            found.append(_cold_scores(probs[0], data["y_test"], probs[1]))

        with harness.Timed() as timed:  # the warnings are not shown
            latents = _cold_map(cell) if engine == "map" or engine.startswith("laplace") else None  # cached: "map"
            fit = weights = None  # a linearised fit, or weight draws about ``centre``: tempered after the branches
            if engine == "map":
                score({k: v[None] for k, v in latents.items()})
            elif engine.startswith("laplace"):
                options = {"structure": "kron", "map_latents": latents, "check_map": False}
                if engine == "laplace-sampled":
                    options |= {"structure": "sampled", "num_samples": cfg["sto"][0], "seed": seed}
                    options["sampler_options"] = {"num_epochs": cfg["sto"][1]}
                laplace = AutoLinearizedLaplace(mlp()).laplace_approximation(x, y, **options)
                if engine == "laplace-kron-weights":
                    weights, centre = laplace.get_samples(COLD_DRAWS, seed=seed), latents
                else:
                    fit = laplace
            elif engine in ("swag", "multiswag"):
                runs = COLD_RUNS[cell.size] if engine == "multiswag" else 1
                swag = SWAG(mlp(), num_runs=runs, num_epochs=cfg["swag"], rank=20, seed=seed, progress_bar=False)
                swag = swag.run(x, y)
                weights = swag.get_samples(COLD_DRAWS, seed=seed)  # draw s is from run s mod runs: about its mean
                centre = swag.bridge.constrain(swag.layout.unflatten(swag.mean[torch.arange(COLD_DRAWS) % runs]))
            elif engine == "sto":
                fit = SampleThenOptimize(mlp(), num_samples=cfg["sto"][0], num_epochs=cfg["sto"][1], seed=seed,
                                         progress_bar=False)  # fmt: skip
                fit.run(x, y)
            elif engine == "svi-autonormal":
                for t in TEMPERATURES:
                    pyro.clear_param_store()
                    pyro.set_rng_seed(seed)
                    model = mlp()
                    guide = AutoNormal(model, init_scale=1e-2)
                    svi = SVI(poutine.scale(model, 1 / t), guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
                    for _ in range(cfg["svi_steps"]):
                        svi.step(x, y)
                    with torch.no_grad():
                        draws = pyro.infer.Predictive(guide, num_samples=COLD_DRAWS)(x, y)
                        score({k: v.detach() for k, v in draws.items()})
            else:
                hyper = sghmc_module.sgd_hyperparameters(lr=0.05 / len(x), momentum=0.9)
                draws, thin = cfg["serial"]
                chains, kept, gap = (cfg["chains"], 1, 1) if engine == "sghmc-parallel" else (1, draws, thin)
                for t in TEMPERATURES:
                    if engine == "sgld":
                        kernel = SGLD(mlp(), temperature=t, init_strategy=init_to_sample)
                    else:
                        kernel = SGHMC(mlp(), **hyper, temperature=t, init_strategy=init_to_sample)
                    mcmc = StochasticMCMC(kernel, num_samples=kept, num_warmup=cfg["warmup"], thin=gap,
                                          num_chains=chains, seed=seed, progress_bar=False)  # fmt: skip
                    mcmc.run(x, y)
                    score(mcmc.get_samples())
            if fit is not None:
                test, ood = fit.predict(data["x_test"]), fit.predict(data["x_ood"])
                for t in TEMPERATURES:
                    score(probs=(glm(test, t, seed), glm(ood, t, seed)))
            if weights is not None:
                for t in TEMPERATURES:
                    score(scaled(weights, centre, t))
        out = {"seconds": round(timed.seconds, 1)}
        for key in found[0]:
            out[key] = [r[key] for r in found] if engine != "map" else found[0][key]
        return out

    return run


COLD_MCMC = ("sghmc-serial", "sghmc-parallel", "sgld")
COLD_ENGINES = ("map", *COLD_MCMC, "laplace-kron-linearised", "laplace-kron-weights", "laplace-sampled", "swag")
COLD_ENGINES += ("multiswag", "sto", "svi-autonormal")


# ---------------------------------------------------------------------------------------------- EKF
EKF_BATCHES = (1000, 100, 10)


def _ekf(diagonal: bool, batch: int) -> Callable[[Cell], dict]:
    def run(cell: Cell) -> dict:
        from pyro_scalable.infer import EKF, DiagonalEKF

        model = problems.glm_cases().model(cell.problem.family, batch)
        ref = cell.reference
        with harness.Timed() as timed:
            engine = (DiagonalEKF if diagonal else EKF)(model, seed=cell.seed, progress_bar=False)
            posterior = engine.run(cell.data.x, cell.data.y)
        seconds, caught = timed.seconds, timed.caught
        error = ((posterior.mean[0].reshape(-1) - ref["mean"]) / ref["sd"]).abs().max()
        ratio = posterior.variance[0].reshape(-1).sqrt() / ref["sd"]
        return {
            "seconds": round(seconds, 3),
            "batch": batch,
            "mean_error_sd": round(float(error), 4),
            "sd_ratio": f"{float(ratio.min()):.2f}–{float(ratio.max()):.2f}",
            "sd_error": round(float((ratio - 1).abs().max()), 4),
            "warned": bool(caught),
            "warnings": sorted({str(w.message).splitlines()[0][:100] for w in caught}),
        }

    return run


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("ours-sghmc", "sgmcmc", _ours_sghmc, (), "StochasticMCMC(SGHMC(model)), defaults, 4 chains"),
        Engine("pyro-nuts", "sgmcmc", _pyro_nuts, (), "pyro.infer.NUTS, full batch, no JIT"),
        Engine("numpyro-nuts", "sgmcmc", _numpyro_nuts, ("numpyro", "jax"), "numpyro.infer.NUTS, jitted"),
        Engine("blackjax-nuts", "sgmcmc", _blackjax_nuts, ("blackjax", "numpyro", "jax"), "window adaptation + nuts"),
        Engine("numpyro-hmcecs", "sgmcmc", _hmcecs, ("numpyro", "jax"), "HMCECS, Taylor proxy, B = 1,000"),
        Engine("ours-sto", "sto", _ours_sto, (), "SampleThenOptimize(model, num_samples=2048), defaults"),
        Engine("map", "laplace", _map, ("sklearn",), "the MAP network alone"),
        *(
            Engine(f"{prefix}-{s}", "laplace", _laplace_digits(i, s), needs, f"{about}, {s}")
            for i, prefix, needs, about in (
                ("ours", "ours-laplace", ("sklearn",), "AutoLinearizedLaplace"),
                ("laplace-torch", "laplace-torch", ("laplace", "sklearn"), "Laplace"),
            )
            for s in ("kron", "diag")
        ),
        *(
            Engine(f"{i}-{o}-{s}", "teacher", _laplace_call(i, o, s), ("laplace",) * (i != "ours"), f"{i}: {o} {s}")
            for i, o, s in LAPLACE_CALLS
        ),
        *(Engine(f"swag-{e}", "digits", _swag(e), ("sklearn",), f"SWAG, rank 20, {e} epochs") for e in (5, 20, 50)),
        *(
            Engine(f"ours-sghmc-{s}", "digits", _digits_sghmc(s), ("sklearn",), f"SGHMC from the MAP, {s} steps")
            for s in (1000, 4000)
        ),
        Engine("ours-sghmc-fixed", "hierarchy", _ours_fixed, (), "StochasticMCMC(SGHMC(model)), 4 chains, fixed"),
        Engine("pyro-nuts-fixed", "hierarchy", _nuts_fixed, (), "pyro.infer.NUTS, full batch, one chain, fixed"),
        *(
            Engine(f"{k.lower()}-b{b or 'N'}", "calibration", _kernel_at(k, b), (), f"{k}(model), defaults, B {b}")
            for k in ("SGLD", "SGHMC", "PSGLD", "SGNHT", "BAOAB")
            for b in CALIBRATION_BATCHES
        ),
        *(
            Engine(f"posteriors-{m}-b{b or 'N'}", "calibration", _posteriors_at(m, b), ("posteriors",), f"{m}, hand")
            for m in ("sgld", "sghmc")
            for b in CALIBRATION_BATCHES
        ),
        Engine("data-parallel-ignore", "distributed", _data_parallel("ignore"), (), "SGLD, minibatch mean, 1 vs 2"),
        Engine("data-parallel-correct", "distributed", _data_parallel("correct"), (), "SGLD, noise corrected"),
        Engine("ours-step", "step", lambda cell: _step_timing(cell, "plain"), (), "SGHMC, noise ignored, 1 chain"),
        Engine("ours-step-corrected", "step", lambda c: _step_timing(c, "corrected"), (), "SGHMC, noise corrected"),
        Engine("ours-16-chains", "step", lambda cell: _step_timing(cell, "chains"), (), "SGHMC, 16 chains"),
        Engine("step-vs-blackjax", "step", _step_vs_blackjax, ("blackjax", "jax"), "one step against BlackJAX SGLD"),
        *(Engine(f"cold-{e}", "cold", _cold(e), ("sklearn",), f"{e}, tempered") for e in COLD_ENGINES),
        Engine("ours-sto-accuracy", "sto", _sto_accuracy, (), "SampleThenOptimize(model, K, num_epochs=20)"),
        Engine("ours-sto-cost", "sto", _sto_cost, (), "SampleThenOptimize(model, K, linearize_at=prior draw)"),
        *(
            Engine(f"ours-sto-em-{g}", "sto-em", _sto_em(g), ("sklearn",), f"SampleThenOptimize, EM, {g}")
            for g in ("scalar", "site")
        ),
        *(Engine(f"ekf-b{b}", "ekf", _ekf(False, b), (), f"EKF(model), B = {b}") for b in EKF_BATCHES),
        *(Engine(f"diagonal-ekf-b{b}", "ekf", _ekf(True, b), (), f"DiagonalEKF(model), B = {b}") for b in EKF_BATCHES),
    )
}
