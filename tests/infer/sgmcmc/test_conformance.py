"""Every stochastic-gradient engine honours the same contract (STYLE.md: a conformance test over engines)."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap
from torch.utils._pytree import tree_leaves

from pyro_scalable.infer import (
    BAOAB,
    PSGLD,
    SGHMC,
    SGLD,
    SGNHT,
    CyclicalSGLD,
    StochasticMCMC,
    baoab,
    psgld,
    sghmc,
    sgld,
    sgnht,
)
from pyro_scalable.infer.gradients import Density, GradientEstimator, NoiseEstimatingGradient, PlainGradient
from pyro_scalable.infer.schedules import Cyclical, PolynomialDecay
from pyro_scalable.infer.sgmcmc import csgld
from pyro_scalable.infer.sgmcmc.adaptation import TunedState
from pyro_scalable.infer.sgmcmc.base import SGMCMCInfo, Transform

from ...conftest import LinearRegression

ENGINES = [
    pytest.param(sgld, SGLD, {"step_size": 0.05}, id="sgld"),
    pytest.param(sghmc, SGHMC, {"step_size": 0.05, "friction": 2.0}, id="sghmc"),
    pytest.param(psgld, PSGLD, {"step_size": 0.05}, id="psgld"),
    pytest.param(sgnht, SGNHT, {"step_size": 0.05, "friction": 2.0}, id="sgnht"),
    pytest.param(baoab, BAOAB, {"step_size": 0.05, "friction": 2.0}, id="baoab"),
]
NO_ZERO_TEMPERATURE = {sgnht}  # SGNHT has no T = 0 limit (its thermostat diverges): it refuses T = 0


def target(latents, batch):
    return -0.5 * (latents["x"].square().sum() + latents["y"].square().sum() / 4)


def start():
    return {"x": torch.tensor([1.0, -1.0], dtype=torch.float64), "y": torch.ones((), dtype=torch.float64)}


def tensors(tree):
    return tree_leaves(tree)


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_state_is_tensors_only(module, cls, hyper):
    state = module.init(start())
    assert all(isinstance(t, torch.Tensor) for t in tensors(state))
    assert state.step_count.dtype == torch.int64 and state.step_count.dim() == 0


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_step_contract_and_info(module, cls, hyper):
    state, info = module.step(module.init(start()), None, target, **hyper, generator=torch.Generator().manual_seed(0))
    assert set(SGMCMCInfo._fields) <= set(info._fields)  # every engine reports the shared statistics
    assert all(v.dim() == 0 for v in info)
    assert int(state.step_count) == 1
    assert set(state.latents) == {"x", "y"} and state.latents["x"].shape == (2,)


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_vmap_over_chains_equals_loop_at_zero_temperature(module, cls, hyper):
    if module in NO_ZERO_TEMPERATURE:
        pytest.skip("no T = 0 limit; test_vmap_over_chains_with_shared_noise_equals_loop covers vmap")
    chains = {"x": torch.randn(4, 2, dtype=torch.float64), "y": torch.randn(4, dtype=torch.float64)}
    batched = vmap(module.init)(chains)

    def one(state):
        return module.step(state, None, target, **hyper, temperature=0.0)

    for _ in range(5):
        batched, info = vmap(one)(batched)
    for c in range(4):
        single = module.init({k: v[c] for k, v in chains.items()})
        for _ in range(5):
            single, _ = one(single)
        for name in chains:
            torch.testing.assert_close(batched.latents[name][c], single.latents[name], rtol=1e-14, atol=1e-14)
    assert info.log_posterior.shape == (4,)


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_vmap_over_chains_with_shared_noise_equals_loop(module, cls, hyper):
    chains = {"x": torch.randn(3, 2, dtype=torch.float64), "y": torch.randn(3, dtype=torch.float64)}
    g = torch.Generator()

    def one(state):
        return module.step(state, None, target, **hyper, temperature=0.5, generator=g)

    g.manual_seed(0)
    batched = vmap(module.init)(chains)
    for _ in range(5):
        batched, _ = vmap(one, randomness="same")(batched)  # one noise draw, shared by the chains
    for c in range(3):
        g.manual_seed(0)
        single = module.init({k: v[c] for k, v in chains.items()})
        for _ in range(5):
            single, _ = one(single)
        for name in chains:
            torch.testing.assert_close(batched.latents[name][c], single.latents[name], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_vmapped_noise_is_independent_across_chains(module, cls, hyper):
    chains = {"x": torch.zeros(2000, 2, dtype=torch.float64), "y": torch.zeros(2000, dtype=torch.float64)}
    g = torch.Generator().manual_seed(0)

    def one(state):
        return module.step(state, None, target, **hyper, generator=g)

    state, _ = vmap(one, randomness="different")(vmap(module.init)(chains))
    x = state.latents["x"][:, 0]
    corr = torch.corrcoef(torch.stack([x[:1000], x[1000:]]))[0, 1]
    assert abs(float(corr)) < 4 / 1000**0.5  # 4 standard errors of a correlation of independent draws
    assert float(x.std()) > 0


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
@pytest.mark.parametrize(
    "schedule", [PolynomialDecay(a=0.05, b=1.0, gamma=0.55), Cyclical(initial=0.05, cycle_length=3)]
)
def test_schedules_are_used_and_reported(module, cls, hyper, schedule):
    state = module.init(start())
    for t in range(4):
        state, info = module.step(state, None, target, **{**hyper, "step_size": schedule})
        assert float(info.step_size) == pytest.approx(float(schedule(torch.tensor(t, dtype=torch.float64))))


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_shell_exposes_hyperparameters_and_validates(module, cls, hyper):
    kernel = cls(lambda: None, **hyper, temperature=0.5)
    assert kernel.step_size == hyper["step_size"] and kernel.temperature == 0.5
    assert "step_size" in repr(kernel)
    with pytest.raises(ValueError, match="step_size"):
        cls(lambda: None, **{**hyper, "step_size": -1.0})
    with pytest.raises(ValueError, match="temperature"):
        cls(lambda: None, **hyper, temperature=float("nan"))


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_divergent_step_is_rejected_and_flagged(module, cls, hyper):
    def bad(latents, batch):
        return target(latents, batch) * torch.tensor(float("nan"))

    state = module.init(start())
    new, info = module.step(state, None, bad, **hyper, generator=torch.Generator().manual_seed(0))
    assert bool(info.diverging)
    for name in state.latents:
        torch.testing.assert_close(new.latents[name], state.latents[name])


# What the update rule of each engine reads: after warm-up a chain holds this and nothing of warm-up's.
MOVING = ("latents", "checked_latents", "step_count")
AFTER_WARMUP = [
    pytest.param(SGLD, {}, MOVING, {"step_size"}, id="sgld"),
    pytest.param(
        SGHMC, {"mass": "fisher"}, ("latents", "momenta", *MOVING[1:]), {"step_size", "friction", "mass"}, id="sghmc"
    ),
    pytest.param(
        PSGLD,
        {},
        ("latents", "checked_latents", "square_avg", "square_count", "step_count"),
        {"step_size"},
        id="psgld",
    ),
    pytest.param(
        SGNHT,
        {},
        ("latents", "momenta", *MOVING[1:3], "thermostat"),
        {"step_size", "friction"},
        id="sgnht",
    ),
    pytest.param(
        BAOAB,
        {},
        ("latents", "momenta", *MOVING[1:3], "previous_step_size"),
        {"step_size", "friction"},
        id="baoab",
    ),
]


@pytest.mark.filterwarnings("ignore:in .* of the coordinates of the kept steps:UserWarning")
@pytest.mark.parametrize("cls,options,fields,chosen", AFTER_WARMUP)
@pytest.mark.parametrize("gradient_noise", ["correct", "ignore"])
def test_after_warmup_a_chain_holds_only_what_its_update_reads(cls, options, fields, chosen, gradient_noise):
    problem = LinearRegression(num_data=100, dim=2, batch_size=10)
    mcmc = StochasticMCMC(
        cls(problem.model, gradient_noise=gradient_noise, **options),
        num_samples=3,
        num_warmup=6,
        num_chains=2,
        seed=0,
        progress_bar=False,
    )
    mcmc.run(problem.x, problem.y)
    state = mcmc.state
    assert isinstance(state, TunedState)
    assert state.kernel._fields == fields
    # the gradient noise's average is the estimator's, handed to the kernel's update with the gradient
    if gradient_noise == "ignore":
        assert state.estimator.noise == {}  # nothing reads it
    else:
        assert state.estimator.noise["w"].shape == (2, 2)
    assert set(state.hyperparameters) == chosen  # friction and mass live here, not in the kernel's State
    for name, value in state.hyperparameters.items():
        for leaf in tensors(value):
            assert bool(torch.isfinite(leaf).all()), name
            assert leaf.shape[0] == 2, name  # one per chain
    assert all(isinstance(t, torch.Tensor) for t in tensors(state))


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_kernel_and_its_warmup_honour_the_written_contract(module, cls, hyper):
    """The driver and the chain stepper call the Protocols of sgmcmc/program.py and probe for nothing else.

    A kernel is not a Program: the programs around it (warm-up, sampling) estimate the gradient and hand it over.
    """
    from pyro_scalable.infer.sgmcmc.adaptation import Adaptation, Tuned
    from pyro_scalable.infer.sgmcmc.program import KernelContract, Program

    problem = LinearRegression(num_data=40, dim=2, batch_size=10)
    kernel = cls(problem.model, **hyper)
    assert isinstance(kernel, KernelContract) and not isinstance(kernel, Program)
    estimator = PlainGradient(problem.model)
    assert isinstance(estimator, GradientEstimator)
    sampling = Tuned(kernel, estimator)
    assert isinstance(sampling, Program) and sampling.sampler is sampling
    adaptive = cls(problem.model)
    if adaptive.adapts:
        warmup = Adaptation(adaptive, 10, NoiseEstimatingGradient(problem.model), estimator)
        assert isinstance(warmup, Program) and isinstance(warmup.sampler, Tuned)
    with pytest.raises(TypeError, match="KernelContract"):
        StochasticMCMC(object(), num_samples=2)


class NoisyTarget(Density):
    """``target`` on a minibatch of two examples, so that warm-up measures a gradient noise."""

    def __call__(self, latents, batch):
        return target(latents, batch) * (1.0 + 0.1 * batch.to(torch.float64).mean())

    def examples(self, batch):
        return batch, 0, float("inf")


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_warmup_rules_return_hyperparameters_and_never_edit_a_kernel_state(module, cls, hyper):
    """A rule reads the kernel's State and hands back hyperparameters (and this step's extra update arguments)."""
    from pyro_scalable.infer.sgmcmc.adaptation import Adaptation

    kernel = cls(lambda: None)
    estimator = NoiseEstimatingGradient(NoisyTarget())
    warmup = Adaptation(kernel, 4, estimator, estimator)
    state = warmup.init(start())
    before = [leaf.clone() for leaf in tensors(state.kernel)]
    for t in (0, 3):  # a burn-in step and a calibrated one
        phase = warmup.phase(t)
        gradient = warmup.estimate(state, torch.tensor([1.0, 2.0]), estimator, phase)
        tuned, after, extra = warmup.rule.tune(kernel, state, gradient, torch.tensor(1.0), phase.burn_in)
        assert after.kernel is state.kernel, "a rule returned an edited kernel State"
        for a, b in zip(before, tensors(state.kernel), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert set(tuned) <= set(kernel.hyperparameters()) and set(extra) <= {"updates", "thermostat"}
        state, _ = warmup.update(state, gradient, estimator, torch.Generator().manual_seed(0), phase)
        before = [leaf.clone() for leaf in tensors(state.kernel)]


@pytest.mark.parametrize(
    "module,cls,hyper",
    [*ENGINES, pytest.param(csgld, CyclicalSGLD, {"step_size": 0.05, "cycle_length": 4}, id="csgld")],
)
def test_build_binds_the_hyperparameters_and_the_kernel_class_is_that_transform(module, cls, hyper):
    """``module.build(**hyperparameters)`` is ``(init, update)`` of one chain; the class runs exactly that."""
    kernel = cls(lambda: None, **hyper)
    assert type(kernel).build is module.build
    transform = module.build(**kernel.hyperparameters())
    assert isinstance(transform, Transform)
    estimator = PlainGradient(target)
    state, kernel_state = transform.init(start()), kernel.init(start())
    for leaf, other in zip(tensors(state), tensors(kernel_state), strict=True):
        torch.testing.assert_close(leaf, other, rtol=0, atol=0, equal_nan=True)
    gradient, _ = estimator.estimate(estimator.init(start()), state.latents, None)
    moved, info = transform.update(state, gradient, torch.Generator().manual_seed(0))
    again, again_info = kernel.update(kernel_state, gradient, torch.Generator().manual_seed(0))
    for leaf, other in zip(tensors((moved, info)), tensors((again, again_info)), strict=True):
        torch.testing.assert_close(leaf, other, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("module,cls,hyper", ENGINES)
def test_a_kernel_module_is_at_most_200_lines(module, cls, hyper):
    """Adding a kernel is one short module (docs/developer/adding_an_engine.md); shared work lives elsewhere."""
    import inspect

    assert len(inspect.getsource(module).splitlines()) <= 200


def test_the_driver_phases_write_nothing_onto_the_driver():
    """The phases and their collaborators return what they decide; only ``StochasticMCMC.run`` assigns results."""
    import ast
    import inspect

    from pyro_scalable.infer.sgmcmc import checkpoint, control_choice, distributed, phases

    for module in (phases, checkpoint, control_choice, distributed):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            targets = list(node.targets) if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            while any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):  # a, run.x = ...
                targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            for target_node in targets:
                while isinstance(target_node, (ast.Subscript, ast.Attribute)):
                    owner = target_node.value
                    if isinstance(owner, ast.Name) and owner.id in ("run", "driver", "mcmc"):
                        raise AssertionError(f"{module.__name__} line {node.lineno} writes onto the driver")
                    target_node = owner
