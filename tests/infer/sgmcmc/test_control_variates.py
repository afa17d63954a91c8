"""Control variates: the controlled minibatch estimate is unbiased (every minibatch enumerated), has no noise at its
centre, finds the mode, and works with every kernel, vectorised chains, constrained sites, loaders and checkpoints.

The statistical test is the calibration test of issue 7 at minibatch 10 of 1,000 with the control variate on; its
tolerance is the Monte-Carlo standard error of a standard deviation (see test_calibration.py).
"""

from __future__ import annotations

import itertools
import math
import re
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch.func import grad_and_value, vmap
from torch.utils.data import DataLoader, TensorDataset

from pyro_scalable.bridge.model import Batch, ModelBridge
from pyro_scalable.infer import BAOAB, PSGLD, SGHMC, SGLD, SGNHT, StochasticMCMC, mode_search
from pyro_scalable.infer.checkpoint import load
from pyro_scalable.infer.gradients import (
    AffineMap,
    ControlledDensity,
    Density,
    WhitenedDensity,
    chains_gradient,
    estimate_gradient,
)
from pyro_scalable.infer.gradients import estimate as estimate_module
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.mode_search import MODE_TOLERANCE
from pyro_scalable.infer.sgmcmc import control_variates
from pyro_scalable.infer.sgmcmc.control_choice import centred, choose
from pyro_scalable.infer.sgmcmc.control_variates import (
    CentreError,
    find_mode,
    full_data_gradient,
    prepare,
)

from ...conftest import LinearRegression
from .test_calibration import sd_ratio
from .test_checkpoint import Killed, assert_same_run, stop_at

NUM_DATA, MINIBATCH = 6, 2


def scaled_regression(x, y):
    """Weights and a constrained noise scale (a log-transformed site, with its log|det J|), float64."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    scale = pyro.sample("scale", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("data", len(y), subsample_size=MINIBATCH) as idx:
        pyro.sample("obs", dist.StudentT(4.0, x[idx] @ w, scale), obs=y[idx])


def small_data(n=NUM_DATA, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, generator=g, dtype=dtype)
    return x, x @ torch.tensor([0.7, -1.2], dtype=dtype) + 0.5 * torch.randn(n, generator=g, dtype=dtype)


def point(w, scale):
    return {"w": torch.tensor(w, dtype=torch.float64), "scale": torch.tensor(math.log(scale), dtype=torch.float64)}


def test_the_controlled_gradient_is_unbiased_over_every_minibatch():
    """Drawn without replacement, every B-subset is equally likely: their mean is the expectation, exactly."""
    bridge = ModelBridge(scaled_regression, small_data())
    control = full_data_gradient(bridge, point([0.5, -1.0], 0.8))
    controlled = ControlledDensity(bridge.log_posterior_fn, control)
    theta = point([0.9, -0.4], 1.7)  # far from the centre: the noise is not small here
    estimates = [
        estimate_gradient(controlled, theta, Batch({"data": torch.tensor(s)}, bridge.args, {}))
        for s in itertools.combinations(range(NUM_DATA), MINIBATCH)
    ]
    exact = full_data_gradient(bridge, theta)
    for name in theta:
        mean = torch.stack([e.grads[name] for e in estimates]).mean(0)
        torch.testing.assert_close(mean, exact.gradient[name], rtol=1e-12, atol=1e-12)
        assert float(torch.stack([e.grads[name] for e in estimates]).var(0).max()) > 1e-3  # not trivially exact
    value = torch.stack([e.log_posterior for e in estimates]).mean()
    torch.testing.assert_close(value, exact.log_joint, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shared", [False, True], ids=["per-chain minibatches", "one shared minibatch"])
@pytest.mark.parametrize("metric", [None, "dense", "diagonal"])
def test_all_chains_controlled_gradients_in_one_pass_are_each_chains_own(shared, metric, device):
    """The batched path (2C chains, one backward pass) against vmap over chains of the controlled density's grad,
    in θ and through warm-up's affine metric; with the estimate switched off (burn-in) it is the plain one."""
    f64 = {"dtype": torch.float64, "device": device}
    bridge = ModelBridge(scaled_regression, tuple(t.to(device) for t in small_data()))
    centre = {k: v.to(device) for k, v in point([0.5, -1.0], 0.8).items()}
    controlled = ControlledDensity(bridge.log_posterior_fn, full_data_gradient(bridge, centre))
    fn = controlled
    if metric is not None:
        scale = torch.rand(3, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(device) + 0.5
        if metric == "dense":
            scale = torch.linalg.cholesky(torch.eye(3, **f64) + 0.3 * torch.ones(3, 3, **f64))
        affine = AffineMap(torch.tensor([0.4, -0.9, 0.1], **f64), scale)
        fn = WhitenedDensity(controlled, ParameterLayout({k: v.shape for k, v in centre.items()}), affine)
    latents = {
        "w": torch.tensor([[0.9, -0.4], [0.1, 0.2], [-1.0, 0.7]], **f64),
        "scale": torch.tensor([0.5, -0.3, 0.1], **f64),
    }
    indices = torch.tensor([1, 4] if shared else [[0, 1], [2, 5], [3, 4]], device=device)
    for active in (True, False):
        controlled.active = active
        batched = chains_gradient(fn, latents, Batch({"data": indices}, bridge.args, {}))

        def one(chain_latents, chain_indices):
            return fn(chain_latents, Batch({"data": chain_indices}, bridge.args, {}))

        grads, values = vmap(grad_and_value(one), in_dims=(0, None if shared else 0))(latents, indices)
        for name in latents:
            torch.testing.assert_close(batched.grads[name], grads[name], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(batched.log_posterior, values, rtol=1e-12, atol=1e-12)
        assert batched.grads["w"].device.type == device.type
    assert not bool(batched.diverging.any())


class Whole(Density):
    """A log posterior with its examples but not its terms apart: the noise estimate evaluates the whole per group."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, latents, batch):
        return self.inner(latents, batch)

    def examples(self, batch):
        return self.inner.examples(batch)


@pytest.mark.parametrize("size", [10, 64])  # single examples; groups of two
@pytest.mark.parametrize("wrapper", ["plain", "controlled", "controlled, dense metric"])
def test_the_noise_estimate_with_the_prior_terms_once_equals_it_per_group(wrapper, size, monkeypatch):
    """``terms`` evaluates the prior once, not per group: the same gradient, value and noise to rounding."""
    monkeypatch.setattr(
        estimate_module, "SHARED_FROM", 0
    )  # the split, here on 3 coordinates (the default: from 10,000)
    spy = spy_on_groups(monkeypatch)
    bridge = ModelBridge(scaled_regression, small_data(200))
    centre = point([0.6, -1.1], 0.6)
    fn = bridge.log_posterior_fn
    if wrapper != "plain":
        fn = ControlledDensity(fn, full_data_gradient(bridge, centre))
    if wrapper.endswith("metric"):
        scale = torch.linalg.cholesky(torch.eye(3, dtype=torch.float64) + 0.3)
        affine = AffineMap(torch.tensor([0.4, -0.9, 0.1], dtype=torch.float64), scale)
        fn = WhitenedDensity(fn, ParameterLayout({k: v.shape for k, v in centre.items()}), affine)
    latents = point([0.9, -0.4], 0.5)
    batch = Batch({"data": torch.randperm(200, generator=torch.Generator().manual_seed(2))[:size]}, bridge.args, {})
    shared, grouped = fn.terms
    torch.testing.assert_close(shared(latents, batch) + grouped(latents, batch), fn(latents, batch), rtol=1e-12, atol=0)
    densities = (fn, Whole(fn))
    apart, whole = (estimate_gradient(f, latents, batch, noise=True) for f in densities)
    torch.testing.assert_close(apart.log_posterior, whole.log_posterior, rtol=1e-12, atol=0)
    for name in latents:
        torch.testing.assert_close(apart.grads[name], whole.grads[name], rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(apart.noise_variance[name], whole.noise_variance[name], rtol=1e-9, atol=0)
    assert float(apart.num_examples) == size
    # the first estimate took the prior's terms apart (its groups' density: the data's terms), the second could not
    assert [seen is density for seen, density in zip(spy, densities, strict=True)] == [False, True]


def spy_on_groups(monkeypatch) -> list:
    """The density each noise estimate from here on evaluates per group (the whole one, or its data's terms)."""
    seen = []
    per_group = estimate_module.per_group

    def spy(fn, *args):
        seen.append(fn)
        return per_group(fn, *args)

    monkeypatch.setattr(estimate_module, "per_group", spy)
    return seen


def test_the_full_data_pass_is_the_full_data_log_joint():
    bridge = ModelBridge(scaled_regression, small_data(50))
    theta = point([0.2, 0.3], 1.1)
    chunked = full_data_gradient(bridge, theta, chunk_size=7)  # 7 chunks, the last of 1 point
    leaves = {k: v.clone().requires_grad_() for k, v in theta.items()}
    value = bridge.log_posterior(leaves, bridge.full_batch())
    value.backward()
    torch.testing.assert_close(chunked.log_joint, value.detach(), rtol=1e-13, atol=1e-10)
    for name, leaf in leaves.items():
        torch.testing.assert_close(chunked.gradient[name], leaf.grad, rtol=1e-12, atol=1e-10)


def test_no_noise_at_the_centre_and_less_near_it():
    bridge = ModelBridge(scaled_regression, small_data(200))
    centre = point([0.6, -1.1], 0.6)
    controlled = ControlledDensity(bridge.log_posterior_fn, full_data_gradient(bridge, centre))
    batch = Batch({"data": torch.arange(0, 200, 17)}, bridge.args, {})
    at_centre = estimate_gradient(controlled, centre, batch, noise=True)
    for name in centre:
        torch.testing.assert_close(at_centre.grads[name], controlled.control.gradient[name], rtol=1e-10, atol=1e-10)
        assert float(at_centre.noise_variance[name].abs().max()) < 1e-20
    # away from the centre the controlled noise grows like the squared distance (the per-example gradient
    # differences are linear in it to first order); the plain estimate's noise does not shrink at all
    variances = []
    for delta in (1e-3, 2e-3):
        moved = {"w": centre["w"] + delta, "scale": centre["scale"] - delta}
        variances.append(
            sum(float(v.sum()) for v in estimate_gradient(controlled, moved, batch, noise=True)[4].values())
        )
    assert variances[1] / variances[0] == pytest.approx(4.0, rel=0.01)
    plain = estimate_gradient(bridge.log_posterior_fn, centre, batch, noise=True)
    assert sum(float(v.sum()) for v in plain.noise_variance.values()) > 1e4 * variances[0]


def _posterior_distance(error, precision):
    """‖error‖ in the posterior's metric (precision P): posterior standard deviations, √(eᵀ P e)."""
    return float(error @ precision @ error) ** 0.5


def test_the_mode_search_finds_the_conjugate_posterior_mean():
    problem = LinearRegression(num_data=3000, dim=3, batch_size=30)
    bridge = ModelBridge(problem.model, (problem.x, problem.y))
    start = {"w": torch.full((3,), 2.0, dtype=torch.float64)}
    mode, search = find_mode(bridge, start, torch.Generator().manual_seed(0))
    distance = _posterior_distance(mode["w"] - problem.mean, torch.linalg.inv(problem.cov))
    # the stopping rule: the next quasi-Newton step under MODE_TOLERANCE √d posterior sds (on a Gaussian posterior
    # the L-BFGS step is the distance left, up to its Hessian's error)
    assert search.converged and distance < MODE_TOLERANCE * 3**0.5, (distance, search)
    assert search.subsample_passes == 0  # 3,000 points: fewer than SUBSAMPLE_FACTOR chunks, no subsample stage
    exact = full_data_gradient(bridge, mode)
    torch.testing.assert_close(search.control.gradient["w"], exact.gradient["w"])
    torch.testing.assert_close(search.control.log_joint, exact.log_joint)


def test_a_runs_mode_search_shows_its_passes_and_the_step_left_unless_the_run_is_quiet(capsys):
    """Minutes of full-data passes on a network must not look like a hung run: the search has its own bar."""
    problem = LinearRegression(num_data=3000, dim=3, batch_size=30)
    for progress_bar in (True, False):
        kernel = SGHMC(problem.model, control_variate="map")
        mcmc = StochasticMCMC(kernel, num_samples=5, num_warmup=5, progress_bar=progress_bar, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a short run: unhealthy on purpose
            mcmc.run(problem.x, problem.y)
        shown = capsys.readouterr().err
        passes = re.findall(r"Mode search \(control variate\): ([0-9.]+) passes over the data", shown)
        if progress_bar:
            assert passes and float(passes[-1]) == mcmc.mode_search.full_passes + mcmc.mode_search.hessian_passes, shown
            assert re.search(r"next step [0-9.e+-]+ sd, stops under 0.173", shown), shown  # 0.1 √3
        else:
            assert "Mode search" not in shown


def _logistic(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=100) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])


def _logistic_mode(x, y):
    """The exact mode and posterior precision by Newton's method in float64."""
    x, y = x.double(), y.double()
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    for _ in range(30):
        p = torch.sigmoid(x @ w)
        precision = (x * (p * (1 - p))[:, None]).T @ x + torch.eye(x.shape[1], dtype=torch.float64)
        w = w + torch.linalg.solve(precision, x.T @ (y - p) - w)
    return w, precision


def test_the_mode_search_on_a_subsample_then_the_full_data_reaches_the_mode_in_few_passes(monkeypatch):
    """Float32 logistic regression, N = 40,000 in chunks of 1,000: the first stage runs on one chunk's subsample
    (1/40 of a pass per evaluation); from its mode, about √(d N/S) ≈ 11 sds from the full data's, the curvature it
    learnt makes the full-data steps near Newton steps: at most 4 passes, the last of them the control variate's
    (prepare adds none), and one pass of the exact Hessian that confirms the stopping rule (d = 3 ≤ EXACT_NEWTON)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40_000, 3, generator=g)
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.0, -0.5, 0.8])), generator=g)
    exact, precision = _logistic_mode(x, y)
    bridge = ModelBridge(_logistic, (x, y))
    passes = []  # None for a full-data pass, else the subsample's indices
    sums = mode_search.full_data_sums

    def counted(bridge, latents, size, reducer, indices=None):
        passes.append(indices)
        return sums(bridge, latents, size, reducer, indices)

    monkeypatch.setattr(mode_search, "full_data_sums", counted)
    for seed in range(3):
        passes.clear()
        start = {"w": torch.full((3,), 1.5) * (-1) ** seed}
        control, search = prepare("map", bridge, bridge, start, seed, chunk_size=1000)
        full = sum(indices is None for indices in passes)
        assert search.converged and full == search.full_passes <= 4 and search.hessian_passes == 1, search
        assert search.subsample_passes == len(passes) - full > 0
        distance = _posterior_distance(control.centre["w"].double() - exact, precision)
        assert distance < MODE_TOLERANCE * 3**0.5, (distance, search)
        again = full_data_gradient(bridge, control.centre, chunk_size=1000)  # the search's last pass, reused
        torch.testing.assert_close(control.gradient["w"], again.gradient["w"], rtol=0, atol=0)


def test_a_trial_point_far_uphill_whose_gradient_overflows_only_shortens_the_step():
    """A scale's float32 gradient overflows far from the mode (log σ = -21 at N = 10⁶: Σ r²/σ² > 3.4e38) while its
    log joint is still finite: the line search steps back from there instead of calling the mode not finite."""

    def evaluate(x):  # f = x²/2, but beyond x = 3 a finite, huge value whose gradient overflowed
        if float(x) > 3:
            return 1e27, torch.tensor([math.inf], dtype=torch.float64), None
        return 0.5 * float(x) ** 2, x.clone(), None

    x = torch.tensor([-2.0], dtype=torch.float64)
    f, g, _ = evaluate(x)
    step = mode_search._line_search(evaluate, x, f, g, torch.tensor([10.0], dtype=torch.float64), 1.0, 0.0)
    assert step is not None and 0 < float(step[0]) < 2 and step[1] < f
    with pytest.raises(mode_search._NoFiniteMode):  # downhill to where it overflows: a mode on the support's edge
        mode_search._line_search(lambda x: (0.0, x * math.inf, None), x, f, g, torch.tensor([1.0]).double(), 1.0, 0.0)


CALIBRATED = {
    "sghmc-map": (SGHMC, "map"),
    "sghmc-warmup": (SGHMC, "warmup"),
    **{
        f"{name}-map": pytest.param((cls, "map"), marks=pytest.mark.slow)
        for name, cls in (("sgld", SGLD), ("psgld", PSGLD), ("sgnht", SGNHT))
    },
}


def effective_step(mcmc: StochasticMCMC, kernel) -> float:
    """The mean step in θ's units after warm-up: ε, times pSGLD's preconditioner G = 1 / (damping + √v).

    pSGLD learns v from the squared gradient estimates, which the control variate makes small near the mode: its G
    grows and its ε shrinks with it, so ε alone is not comparable between the two runs.
    """
    step = mcmc.sample_stats["step_size"][:, -1].double()
    if not isinstance(kernel, PSGLD):
        return float(step.mean())
    squares = mcmc.state.kernel.square_avg  # (chains, ...) per site
    scale = torch.cat([(1.0 / (kernel.damping + v.sqrt())).reshape(v.shape[0], -1) for v in squares.values()], -1)
    return float((step[:, None] * scale.double()).mean())


@pytest.mark.filterwarnings("ignore:in .* of the coordinates")
@pytest.mark.parametrize("case", CALIBRATED.values(), ids=CALIBRATED.keys())
def test_minibatch_of_10_in_1000_with_the_control_variate_is_calibrated(case):
    """Issue 7's calibration test, control variate on (at the mode, or at warm-up's window means): the step is no
    longer bounded by the gradient noise."""
    cls, centre = case
    problem = LinearRegression(num_data=1000, dim=2, batch_size=10)
    kernel = cls(problem.model, control_variate=centre)
    corrected, error, mcmc = sd_ratio(kernel, problem, 256, 300, 600)
    assert bool((4 * error < 0.08).all()), f"too few effective draws to resolve 10%: MCSE {error}"
    assert bool(((corrected - 1).abs() < 4 * error + 0.03).all()), corrected
    plain = StochasticMCMC(
        cls(problem.model, control_variate=None),
        num_samples=1,
        num_warmup=300,
        num_chains=4,
        seed=0,
        progress_bar=False,
    )
    plain.run(problem.x, problem.y)
    # the noise bound no longer sets the step: several times larger than without the control variate
    assert effective_step(mcmc, kernel) > 3 * effective_step(plain, plain.kernel)
    assert mcmc.control_variate is not None and (mcmc.mode_search is not None) == (centre == "map")


KERNELS = {"sgld": SGLD, "sghmc": SGHMC, "psgld": PSGLD, "sgnht": SGNHT, "baoab": BAOAB}


# ten warm-up steps choose the step coarsely (the noise warning may fire): the test is about the kernels running
@pytest.mark.filterwarnings("ignore:in .* of the coordinates of the kept steps:UserWarning")
@pytest.mark.parametrize("cls", KERNELS.values(), ids=KERNELS.keys())
def test_every_kernel_takes_it_vectorised(cls):
    """Vectorised (a fall-back to sequential chains would warn, and warnings fail tests), finite draws and lp."""
    mcmc = StochasticMCMC(
        cls(scaled_regression, control_variate="map"),
        num_samples=5,
        num_warmup=10,
        num_chains=2,
        seed=4,
        progress_bar=False,
    )
    mcmc.run(*small_data(40))
    assert all(bool(torch.isfinite(v).all()) for v in mcmc.get_samples().values())
    assert bool(torch.isfinite(mcmc.sample_stats["lp"]).all())
    assert not bool(mcmc.sample_stats["diverging"].any())


def test_a_given_centre_a_guide_and_a_loader():
    x, y = small_data(40)
    values = {"w": torch.tensor([0.7, -1.2], dtype=torch.float64), "scale": torch.tensor(0.5, dtype=torch.float64)}
    given = StochasticMCMC(
        SGLD(scaled_regression, step_size=1e-4, control_variate=values),
        num_samples=3,
        num_warmup=0,
        progress_bar=False,
        seed=0,
    )
    given.run(x, y)
    torch.testing.assert_close(given.control_variate.centre["scale"], values["scale"].log())
    assert given.mode_search is None

    guide = AutoNormal(scaled_regression)
    pyro.clear_param_store()
    guide(x, y)  # initialise its parameters: median() is the constrained loc
    by_guide = StochasticMCMC(
        SGLD(scaled_regression, step_size=1e-4, control_variate=guide),
        num_samples=3,
        num_warmup=0,
        progress_bar=False,
        seed=0,
    )
    by_guide.run(x, y)
    torch.testing.assert_close(by_guide.control_variate.centre["w"], guide.median(x, y)["w"].detach())

    def loader_model(x, y, idx=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
        scale = pyro.sample("scale", dist.HalfNormal(torch.ones((), dtype=x.dtype)))
        with pyro.plate("data", 40, subsample=idx):
            pyro.sample("obs", dist.StudentT(4.0, x @ w, scale), obs=y)

    index = torch.arange(40)
    loader = DataLoader(TensorDataset(x, y, index), batch_size=8, shuffle=False)
    with_loader = StochasticMCMC(
        SGLD(loader_model, step_size=1e-4, control_variate="map"),
        num_samples=3,
        num_warmup=0,
        progress_bar=False,
        seed=0,
    )
    with_loader.run(x, y, batches=loader)
    direct = StochasticMCMC(
        SGLD(scaled_regression, step_size=1e-4, control_variate="map"),
        num_samples=3,
        num_warmup=0,
        progress_bar=False,
        seed=0,
    )
    direct.run(x, y)
    # the same mode, to the search's stopping rule: each within 0.1·√3 posterior sds of it (sd(w) ≈ 0.5/√40 ≈ 0.08;
    # the two searches' paths part at rounding: x @ w on the loader's rows against x[idx] @ w)
    for name in ("w", "scale"):
        torch.testing.assert_close(
            with_loader.control_variate.centre[name], direct.control_variate.centre[name], rtol=0, atol=0.03
        )
    with pytest.raises(ValueError, match="full data"):
        StochasticMCMC(
            SGLD(loader_model, step_size=1e-4, control_variate="map"), num_samples=3, num_warmup=0, progress_bar=False
        ).run(batches=loader)


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="control_variate must be None, .auto., .map."):
        SGLD(scaled_regression, control_variate="mode")
    with pytest.raises(TypeError, match="trained autoguide"):
        SGHMC(scaled_regression, control_variate=3.0)
    x, y = small_data(20)
    mcmc = StochasticMCMC(
        SGLD(scaled_regression, step_size=1e-3, control_variate={"w": torch.zeros(2)}),
        num_samples=2,
        num_warmup=0,
        progress_bar=False,
    )
    with pytest.raises(ValueError, match="'scale'"):
        mcmc.run(x, y)
    outside = {"w": torch.zeros(2, dtype=torch.float64), "scale": torch.tensor(-1.0, dtype=torch.float64)}
    mcmc = StochasticMCMC(
        SGLD(scaled_regression, step_size=1e-3, control_variate=outside),
        num_samples=2,
        num_warmup=0,
        progress_bar=False,
    )
    with pytest.raises(ValueError, match="non-finite"):
        mcmc.run(x, y)


@pytest.mark.filterwarnings("ignore:in .* of the coordinates of the kept steps:UserWarning")
def test_a_resumed_run_keeps_the_centre_and_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    data = small_data(40)

    def run(path=None, kill=None):
        mcmc = StochasticMCMC(
            SGHMC(scaled_regression, control_variate="map"),
            num_samples=8,
            num_warmup=8,
            num_chains=2,
            seed=2,
            progress_bar=False,
            checkpoint=path,
            checkpoint_every=4,
        )
        with monkeypatch.context() as patch:
            if kill is not None:
                stop_at(patch, kill)
                with pytest.raises(Killed):
                    mcmc.run(*data)
            else:
                mcmc.run(*data)
        return mcmc

    reference = run()
    path = tmp_path / "run.pt"
    run(path, kill=11)
    saved = load(path)
    torch.testing.assert_close(saved["control_variate"]["centre"], reference.control_variate.centre)
    resumed = run(path)
    assert resumed.mode_search is None  # read back, not searched again
    assert_same_run(resumed, reference)


def test_auto_is_on_where_the_noise_bound_sets_the_step():
    problem = LinearRegression(num_data=1000, dim=2, batch_size=10)  # N/B = 100
    bridge = ModelBridge(problem.model, (problem.x, problem.y))
    assert choose("auto", SGHMC(problem.model), bridge) == "map"
    assert choose("auto", SGHMC(problem.model, step_size=1e-3), bridge) is None  # a hand-set step
    assert choose("auto", SGLD(problem.model, gradient_noise="estimate"), bridge) is None  # not corrected
    assert choose(None, SGHMC(problem.model), bridge) is None
    wide = LinearRegression(num_data=1000, dim=2, batch_size=200)  # N/B = 5
    assert choose("auto", SGHMC(wide.model), ModelBridge(wide.model, (wide.x, wide.y))) is None


def hierarchical(x, group, y, batch=10):
    """Group effects z_g ~ N(0, 1) scaled by a latent τ: a latent site inside a plate (a hierarchy), float32."""
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("groups", 5):
        z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", len(y), subsample_size=batch) as idx:
        pyro.sample("obs", dist.Normal(tau * z[group[idx]] + x[idx], 1.0), obs=y[idx])


def hierarchical_data(n=1000):
    g = torch.Generator().manual_seed(5)
    x, group = torch.randn(n, generator=g), torch.arange(n) % 5
    z = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.2])
    return x, group, x + 0.8 * z[group] + torch.randn(n, generator=g)


def centred_hierarchical(x, group, y, batch=10):
    """Group effects b_g ~ N(0, τ): the prior of a latent site inside a plate depends on another latent."""
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("groups", int(group.max()) + 1):
        b = pyro.sample("b", dist.Normal(x.new_zeros(()), tau))
    with pyro.plate("data", len(y), subsample_size=batch) as idx:
        pyro.sample("obs", dist.Normal(b[group[idx]] + x[idx], 1.0), obs=y[idx])


def test_auto_centres_a_centred_hierarchy_at_its_mode_and_a_non_centred_one_at_warmups_windows():
    """A non-centred hierarchy's joint mode is atypical (choose's docstring): 'auto' centres on warm-up's window
    means there, where warm-up has them and N/B reaches HIERARCHY_RATIO; a centred one with ROWS_PER_GROUP rows a
    group or more at its mode; 'warmup' without windows is refused with the fix."""
    bridge = ModelBridge(hierarchical, hierarchical_data())
    assert not centred(bridge) and centred(ModelBridge(centred_hierarchical, hierarchical_data()))
    assert choose("auto", SGHMC(hierarchical), bridge) == "warmup"
    assert choose("auto", SGHMC(centred_hierarchical), ModelBridge(centred_hierarchical, hierarchical_data())) == "map"
    x, _, y = hierarchical_data()  # 1,000 rows in 200 groups: 5 rows a group, under ROWS_PER_GROUP
    few = ModelBridge(centred_hierarchical, (x, torch.arange(1000) % 200, y))
    assert centred(few) and choose("auto", SGHMC(centred_hierarchical), few) == "warmup"
    assert choose("auto", SGHMC(hierarchical), bridge, windows=False) is None
    assert choose("map", SGHMC(hierarchical), bridge) == "map"  # asked for: kept
    wide = ModelBridge(lambda x, g, y: hierarchical(x, g, y, batch=300), hierarchical_data())  # N/B = 3.3
    assert choose("auto", SGHMC(hierarchical), wide) is None
    with pytest.raises(ValueError, match="metric='diagonal' or 'dense'"):
        choose("warmup", SGHMC(hierarchical), bridge, windows=False)
    with pytest.raises(ValueError, match="metric='diagonal' or 'dense'"):
        StochasticMCMC(
            SGHMC(hierarchical, control_variate="warmup"), num_samples=5, num_warmup=50, progress_bar=False
        ).run(*hierarchical_data())  # "auto" keeps no metric for a warm-up under 200 steps


def test_the_warmup_centre_is_each_windows_mean_and_burn_in_is_plain(monkeypatch):
    """control_variate="warmup": off in every burn-in step and on in every calibrated and sampling step; recentred
    at the end of each metric window at that window's mean, with the exact full-data gradient there."""
    from pyro_scalable.infer.sgmcmc import control_choice, metric
    from pyro_scalable.infer.sgmcmc.chains import ChainStepper

    flags, centres = [], []
    step = ChainStepper.step

    def controlled(stepper, batch, index, estimator):  # each step's density: controlled, or plain
        density = estimator.density
        unwrapped = density.inner if isinstance(density, WhitenedDensity) else density
        flags.append(isinstance(unwrapped, ControlledDensity) and unwrapped.control is not None)
        return step(stepper, batch, index, estimator)

    monkeypatch.setattr(ChainStepper, "step", controlled)
    original = control_choice.recentre

    def spy(full, schedule, reducer=None):
        centres.append(schedule.window_mean.clone())
        return original(full, schedule, reducer)

    monkeypatch.setattr("pyro_scalable.infer.sgmcmc.phases.recentre", spy)
    data = hierarchical_data()
    num_warmup = 200
    mcmc = StochasticMCMC(
        SGHMC(hierarchical, control_variate="warmup"),
        num_samples=20,
        num_warmup=num_warmup,
        num_chains=2,
        seed=3,
        progress_bar=False,
        metric="dense",
    )
    mcmc.run(*data)
    ends = [round(share * num_warmup) for share in metric.STAGES]
    starts = [0, *ends]
    lengths = [b - a for a, b in zip(starts, [*ends, num_warmup])]
    # the first stage is warm-up's start as without a metric (its burn-in is half of num_warmup); each later
    # stage is a warm-up of its own, burn-in first
    lengths[0] = num_warmup
    expected = [t - a >= n // 2 for a, n, end in zip(starts, lengths, [*ends, num_warmup]) for t in range(a, end)]
    expected = [on and t >= ends[0] for on, t in zip(expected, range(num_warmup))]  # no centre before the first
    expected += [True] * 20
    assert flags == expected
    assert len(centres) == len(ends)
    layout = ParameterLayout({k: v.shape[1:] for k, v in mcmc.state.kernel.latents.items()})
    centre = mcmc.control_variate.centre
    torch.testing.assert_close(layout.flatten(centre, 0), centres[-1])
    exact = full_data_gradient(ModelBridge(hierarchical, data), centre)
    for name, g in exact.gradient.items():
        torch.testing.assert_close(mcmc.control_variate.gradient[name], g)


def funnel_data(n=100):
    """Group effects that the data put at 0 with few rows each: the centred model's mode search runs into the funnel."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g)
    return x, torch.arange(n) % 5, x + torch.randn(n, generator=g)


def test_a_centred_hierarchy_without_a_finite_mode_goes_on_centred_at_warmups_windows():
    """'auto' chose the mode for a centred hierarchy; where the search finds none (its group scale runs to 0), the
    run goes on with "warmup" (no error, no plain run); asked for, "map" says why."""
    data = funnel_data()
    short = dict(num_samples=5, num_warmup=200, num_chains=2, seed=0, progress_bar=False)
    with pytest.raises(CentreError, match="no finite mode"):
        StochasticMCMC(SGHMC(centred_hierarchical, control_variate="map"), **short).run(*data)
    mcmc = StochasticMCMC(SGHMC(centred_hierarchical), **short)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 5 draws: not healthy
        mcmc.run(*data)
    assert mcmc.mode_search is None and mcmc.control_variate is not None  # recentred by warm-up
    assert float(mcmc.control_variate.centre["tau"]) > -5.0  # not in the funnel's neck


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_run_resumed_after_the_fallback_goes_on_recentring(tmp_path, monkeypatch):
    """The checkpoint keeps the policy the run went on with: resumed after the fallback's second recentre (a dense
    metric's windows close at steps 30, 60 and 110), the run goes on as "warmup" (not "map" at the centre it read
    back: off in the last stage's burn-in, recentred at step 110) and equals the uninterrupted run bit for bit."""
    data = funnel_data()

    def run(path=None):
        kernel = SGHMC(centred_hierarchical)
        return StochasticMCMC(kernel, 20, 200, 2, seed=0, progress_bar=False, checkpoint=path, metric="dense")

    reference = run()
    reference.run(*data)
    path = tmp_path / "run.pt"
    with monkeypatch.context() as patch:
        stop_at(patch, 100, KeyboardInterrupt, after=True)
        with pytest.raises(KeyboardInterrupt):
            run(path).run(*data)
    saved = load(path)
    assert saved["option"] == "warmup" and saved["control_variate"] is not None
    resumed = run(path)
    resumed.run(*data)
    assert_same_run(resumed, reference)


def _centred_without_a_plate(x, y, group):
    """Group effects as one event site (no plate): "auto" cannot see the hierarchy, whose mode has tau at 0."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    effect = pyro.sample("effect", dist.Normal(mu, tau).expand([4]).to_event(1))
    with pyro.plate("data", len(y), subsample_size=12) as idx:
        pyro.sample("obs", dist.Normal(effect[group[idx]], 1.0), obs=y[idx])


def test_auto_runs_plain_where_the_mode_search_finds_no_finite_mode_and_map_says_why():
    from tests.model_zoo import data

    x, y, group = data(torch.float32)
    short = dict(num_samples=5, num_warmup=20, num_chains=2, seed=1, progress_bar=False)
    mcmc = StochasticMCMC(SGHMC(_centred_without_a_plate), **short)
    with pytest.warns(UserWarning):  # the chains are not healthy after 20 steps; no error
        mcmc.run(x, y, group)
    assert mcmc.control_variate is None
    with pytest.raises(ValueError, match="no finite mode.*'warmup'"):
        StochasticMCMC(SGHMC(_centred_without_a_plate, control_variate="map"), **short).run(x, y, group)


def _regression_on_a_tiny_scale(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    s = pyro.sample("s", dist.HalfNormal(1.0))
    with pyro.plate("data", len(y), subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(w * x[idx], s), obs=y[idx])


def _tiny_scale_data():
    g = torch.Generator().manual_seed(0)
    x = 1e-8 * torch.randn(100, generator=g)
    return x, 2.0 * x + 1e-8 * torch.randn(100, generator=g)


def _assert_fitting_advice(message):
    assert re.search(r"observed values are on a scale of \de-08", message) and "standardise the data" in message
    assert "control_variate='map'" not in message and "hierarchy" not in message


def test_the_advice_after_a_failed_mode_search_fits_the_model(monkeypatch):
    # the message alone: a mode search that ends at NaN (as on data scaled by 1e-8, below) without running one
    from pyro_scalable.infer.sgmcmc import control_variates

    bridge = ModelBridge(_regression_on_a_tiny_scale, _tiny_scale_data())
    nan = {name: torch.full(site.unconstrained_shape, float("nan")) for name, site in bridge.sites.items()}
    monkeypatch.setattr(control_variates, "find_mode", lambda *args, **kwargs: (nan, object()))
    with pytest.raises(ValueError, match=r"the mode search found no finite mode") as caught:
        control_variates.prepare("map", bridge, bridge, nan, 0)
    _assert_fitting_advice(str(caught.value))


def test_the_mode_search_finds_a_narrow_mode_of_data_on_a_tiny_scale():
    # float32 data scaled by 1e-8: L-BFGS's own stopping overshot the likelihood's narrow mode into NaN; the
    # exact-Hessian finish (d = 2) ends at the least-squares fit, its noise scale the residuals' (about 1e-8)
    x, y = _tiny_scale_data()
    bridge = ModelBridge(_regression_on_a_tiny_scale, (x, y))
    start = {name: value[0] for name, value in bridge.init_latents(1, seed=0).items()}
    control, search = control_variates.prepare("map", bridge, bridge, start, 0)
    centre = bridge.constrain(control.centre)
    slope = float(x.double() @ y.double() / (x.double() @ x.double()))
    residual = float((y.double() - slope * x.double()).square().mean().sqrt())
    assert search.converged and abs(float(centre["w"]) - slope) < 0.05 * abs(slope)
    assert abs(float(centre["s"]) / residual - 1) < 0.05


def test_the_mode_search_starts_at_the_candidate_with_the_highest_log_joint():
    """``also``: the search starts where the log joint is highest on one chunk (here the whole data); the first
    candidate on ties and over non-finite ones."""
    x, y = small_data(40)
    full = ModelBridge(scaled_regression, (x, y))
    good = {"w": torch.tensor([0.8, -1.2], dtype=torch.float64), "scale": torch.tensor(-0.6, dtype=torch.float64)}
    far = {"w": torch.tensor([9.0, 9.0], dtype=torch.float64), "scale": torch.tensor(3.0, dtype=torch.float64)}
    broken = {"w": torch.tensor([math.nan, 0.0], dtype=torch.float64), "scale": torch.tensor(0.0, dtype=torch.float64)}
    generator = torch.Generator().manual_seed(0)
    size = mode_search.points_per_chunk(full, None)
    assert mode_search._best_start(full, [far, good], generator, size, None) == (good, None)
    assert mode_search._best_start(full, [good, far], generator, size, None)[0] is good
    assert mode_search._best_start(full, [broken, far], generator, size, None)[0] is far
    assert mode_search._best_start(full, [broken, broken], generator, size, None)[0] is broken
    _, search = mode_search.find_mode(full, far, generator, also=[good])
    assert search.converged and search.full_passes >= 2  # the two candidates' evaluations are counted


def test_the_control_variates_search_on_a_network_starts_from_a_prior_draw_not_saturated_units(monkeypatch):
    """init_to_uniform's ±2 in every weight saturates a tanh network's units, where L-BFGS crawls; from a draw of the
    fan-in-scaled prior it converges in a few passes (benchmarks/studies/diagnose_control_variate_size.py's 20-50-50-1
    network: 81 full-data passes against 14). Asked for at most a third of the passes here."""
    dims = (20, 50, 50, 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, dims[0], generator=g)

    def forward(weights, x):
        h = x
        for i, w in enumerate(weights):
            h = h @ w if i == len(weights) - 1 else torch.tanh(h @ w)
        return h.squeeze(-1)

    teacher = [torch.randn(a, b, generator=g) * a**-0.5 for a, b in zip(dims[:-1], dims[1:])]
    y = forward(teacher, x) + 0.5 * torch.randn(len(x), generator=g)

    def network(x, y):
        weights = [
            pyro.sample(f"w{i}", dist.Normal(x.new_zeros(a, b), a**-0.5).to_event(2))
            for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))
        ]
        with pyro.plate("data", x.shape[0], subsample_size=100) as idx:
            pyro.sample("obs", dist.Normal(forward(weights, x[idx]), 0.5), obs=y[idx])

    full = ModelBridge(network, (x, y))
    saturated = {name: value[0] for name, value in full.init_latents(1, seed=0).items()}  # init_to_uniform
    passes = {}
    _, search = prepare("map", full, full, saturated, seed=0)
    passes["with a prior draw"] = search.full_passes
    original = mode_search.find_mode
    monkeypatch.setattr(control_variates, "find_mode", lambda *a, also=(), **k: original(*a, **k))
    _, search = prepare("map", full, full, saturated, seed=0)
    passes["from the saturated start"] = search.full_passes
    assert 3 * passes["with a prior draw"] < passes["from the saturated start"], passes
