"""A plain eager step dispatches only the operations its maths needs (issue 39), with the same numbers.

The kernels' coefficients (decay, noise scale, drift scale, noise statistics) are computed once while the
hyperparameters stay the same objects (:class:`~pyro_scalable.infer.sgmcmc.kernel.RunConstants`), and a plain CPU
gradient's divergence flag is read once on the host (:func:`~pyro_scalable.infer.gradients.evaluate`).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_scalable.infer.gradients import estimate
from pyro_scalable.infer.sgmcmc import sghmc
from pyro_scalable.infer.sgmcmc.divergence import keep_where_finite
from pyro_scalable.infer.sgmcmc.kernel import RunConstants


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _chain(d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = {"w": torch.randn(d, generator=g), "s": torch.randn((), generator=g)}
    state = sghmc.init(latents)
    grads = {name: torch.randn(x.shape, generator=g) for name, x in latents.items()}
    return state, grads


def _gradient(grads, noise=None):
    """A gradient as the program hands it to a kernel: with ``noise``, as one that corrects for it."""
    return estimate.GradientEstimate(
        grads,
        torch.tensor(-1.0),
        torch.tensor(1.0),
        estimate.flag(False, torch.device("cpu")),
        noise or {},
        torch.zeros(()),
        {},
        noise or {},
    )


def test_plain_sghmc_update_dispatches_only_its_maths():
    """Per site: d p, ε g, their sum, √v ξ, the sum; θ + s p (2); one normal draw per site; the step count."""
    state, grads = _chain()
    kwargs = {"step_size": 1e-3, "friction": 10.0, "generator": torch.Generator().manual_seed(1)}
    state, _ = sghmc.update(state, _gradient(grads), **kwargs)  # the coefficients computed once
    gradient = _gradient(grads)
    with Count() as count:
        sghmc.update(state, gradient, **kwargs)
    assert sum(count.ops.values()) == 2 * (5 + 2 + 1) + 1, dict(count.ops)


def test_noise_corrected_update_between_measurements_dispatches_only_its_maths():
    state, grads = _chain()
    noise = {name: torch.rand(x.shape) for name, x in grads.items()}  # the same average: no new measurement
    kwargs = {"step_size": 1e-3, "friction": 10.0, "generator": torch.Generator()}
    state, _ = sghmc.update(state, _gradient(grads, noise), **kwargs)
    gradient = _gradient(grads, noise)
    with Count() as count:
        sghmc.update(state, gradient, **kwargs)
    assert sum(count.ops.values()) == 2 * (5 + 2 + 1) + 1, dict(count.ops)


@pytest.mark.parametrize("noise_mode", ["ignore", "correct"])
def test_remembered_coefficients_give_the_same_draws_bitwise(noise_mode):
    """Each step against a fresh computation of its coefficients (``RunConstants.function``), bit for bit."""
    state, grads = _chain(seed=2)
    fresh = state
    friction = {"w": torch.full((5,), 8.0), "s": torch.tensor(12.0)}  # per coordinate, as warm-up chooses it
    noise, step_size = {}, torch.tensor(1e-3)
    for t in range(6):
        if noise_mode == "correct":  # a new measurement every third step; "ignore": the program hands none
            noise = {name: torch.rand(x.shape) * 1e3 for name, x in grads.items()} if t % 3 == 0 else noise
        kwargs = {"step_size": step_size, "friction": friction}
        state, info = sghmc.update(state, _gradient(grads, noise), **kwargs, generator=torch.Generator().manual_seed(t))
        original = sghmc._coefficients
        sghmc._coefficients = original.function  # no memory: computed anew
        try:
            fresh, fresh_info = sghmc.update(
                fresh, _gradient(grads, noise), **kwargs, generator=torch.Generator().manual_seed(t)
            )
        finally:
            sghmc._coefficients = original
        for name in state.latents:
            assert torch.equal(state.latents[name], fresh.latents[name])
            assert torch.equal(state.momenta[name], fresh.momenta[name])
        for a, b in zip(info, fresh_info, strict=True):
            assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))


def test_run_constants_recompute_for_new_or_changed_hyperparameters():
    calls = []

    def double(latents, scale):
        calls.append(1)
        scale = next(iter(scale.values())) if isinstance(scale, dict) else scale
        return {name: 2.0 * scale * x.new_ones(x.shape) for name, x in latents.items()}

    memo = RunConstants(double)
    latents = {"w": torch.zeros(3)}
    scale = torch.tensor(1.5)
    first = memo(latents, scale)
    assert memo({"w": torch.ones(3)}, scale) is first and len(calls) == 1  # other values, same shapes: kept
    assert torch.equal(memo({"w": torch.ones(4)}, scale)["w"], torch.full((4,), 3.0))  # another shape
    assert torch.equal(memo(latents, torch.tensor(1.5))["w"], first["w"]) and len(calls) == 3  # another object
    scale.mul_(2.0)  # changed in place
    assert torch.equal(memo(latents, scale)["w"], torch.full((3,), 6.0)) and len(calls) == 4
    assert memo(latents, {"a": scale}) is not memo(latents, {"b": scale})  # a dict's names count
    batched = torch.func.vmap(lambda x: memo({"w": x}, scale)["w"])(torch.zeros(2, 3))  # under vmap: every time
    assert torch.equal(batched, torch.full((2, 3), 6.0))
    small = RunConstants(double, size=2)  # full: forgets, and computes again
    scales = [torch.tensor(float(k)) for k in range(3)]
    for _ in range(2):
        assert [float(small(latents, k)["w"][0]) for k in scales] == [0.0, 2.0, 4.0]


def test_a_non_finite_plain_gradient_is_flagged_and_rejected():
    def log_density(latents, batch):
        return -(latents["w"] ** 2).sum() / batch

    latents = {"w": torch.ones(3)}
    finite = estimate.estimate_gradient(log_density, latents, torch.tensor(2.0))
    diverging = estimate.estimate_gradient(log_density, latents, torch.tensor(0.0))
    assert not bool(finite.diverging) and bool(diverging.diverging)
    moved = keep_where_finite(diverging.diverging, {"w": torch.full((3,), 9.0)}, latents)
    assert torch.equal(moved["w"], latents["w"])
