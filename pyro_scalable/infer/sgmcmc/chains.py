"""Stepping many chains at once: one ``torch.func.vmap``-ed computation, or one chain after another.

The driver (:mod:`.mcmc`) hands each step's minibatch and index to a :class:`ChainStepper`, which runs a *program*
on every chain: vectorised where the model allows it, sequentially (with a one-line warning) where vmap cannot
batch it. A program (:class:`~.program.Program`) is warm-up around a kernel (:class:`~.adaptation.Adaptation`) or
the kernel sampling with its hyperparameters (:class:`~.adaptation.Tuned`): ``init(latents)``,
``phase(step_index)``, ``step(state, batch, log_posterior_fn, generator, phase)``, ``latents(state)``, and the
halves of a step. With a ``reducer`` (data-parallel, :mod:`.distributed`) a step is
``estimate(state, batch, log_posterior_fn, phase, direction)`` on this rank's share, an all-reduce, then
``update(state, gradient, generator, phase)``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pyro_scalable.bridge.checks import ModelError, first_line, user_stacklevel
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.bridge.traced import compiling
from pyro_scalable.infer.sgmcmc.base import GradientEstimate, Phase
from pyro_scalable.infer.sgmcmc.compiled_step import CompiledStep
from pyro_scalable.infer.sgmcmc.distributed import normalised_per_chain
from pyro_scalable.infer.sgmcmc.stragglers import copy_chains

__all__ = ["ChainStepper", "CompiledStep", "chains_gradient", "first_line"]


class ChainStepper:
    """Steps all chains of one program: vmapped, single-chain, or one after another (the fallback).

    With a ``reducer`` (data-parallel) a step is ``estimate`` on this rank's share, an all-reduce, then ``update``.
    """

    def __init__(
        self,
        program: Any,
        bridge: ModelBridge,
        latents: Latents,
        generator: torch.Generator,
        method: str,
        reducer: Any = None,
    ):
        self.program = program
        self.reducer = reducer
        self.bridge = bridge
        self.log_posterior_fn = bridge.log_posterior_fn
        self.generator = generator
        self.num_chains = next(iter(latents.values())).shape[0]
        self.mode = "vectorized" if method == "vectorized" and self.num_chains > 1 else "sequential"
        self.state: Any = None
        self._chains: list = []
        self._vsteps: dict[tuple, Any] = {}  # by phase and the indices' vmap dims
        self.compiled = CompiledStep() if compiling() else None  # model_tracing(compile=True): the whole step
        if self.mode == "vectorized":
            self.state = vmap(program.init)(latents)
        else:
            self._chains = [program.init({k: v[c] for k, v in latents.items()}) for c in range(self.num_chains)]

    def end_warmup(self) -> None:
        """Unwrap warm-up (where the program is one): each chain goes on with its kernel and chosen hyperparameters."""
        program, finish = self.program, self.program.finish
        if program.sampler is program:  # no warm-up to unwrap
            return
        if self.mode == "vectorized":
            self.state = finish(self.state)
        else:
            self._chains = [finish(chain) for chain in self._chains]
        self.program = program.sampler
        self._vsteps.clear()
        if self.compiled is not None:
            self.compiled = CompiledStep()

    def _one(self, state: Any, indices: dict, args: tuple, kwargs: dict, phase: Phase):
        generator = None if torch.compiler.is_compiling() else self.generator  # compiled: torch's RNG, seeded per step
        return self.program.step(state, Batch(indices, args, kwargs), self.log_posterior_fn, generator, phase)

    def _vstep(self, phase: Phase, indices: dict):
        dims = index_dims(indices)
        key = (phase, tuple(dims.items()))
        if key not in self._vsteps:

            def one(state, indices, args, kwargs):
                return self._one(state, indices, args, kwargs, phase)

            self._vsteps[key] = vmap(one, in_dims=(0, dims, None, None), randomness="different")
        return self._vsteps[key]

    def _vupdate(self, phase: Phase):
        key = ("update", phase)
        if key not in self._vsteps:

            def update(state, gradient):
                generator = None if torch.compiler.is_compiling() else self.generator
                return self.program.update(state, gradient, generator, phase)

            self._vsteps[key] = vmap(update, randomness="different")
        return self._vsteps[key]

    def step(self, batch: Batch, step_index: int):
        """Step every chain on ``batch``, the run's step ``step_index``; returns the stacked Info (one chain's: 0-d)."""
        phase = self.program.phase(step_index)
        if self.reducer is not None:
            return self._reduced_step(batch, phase)
        if self.compiled is not None and self.program.sampler is self.program:  # sampling: one phase in four
            stepped = self.compiled(self, batch, phase)
            if stepped is not None:
                self.restore(self.mode, stepped[0])
                return stepped[1]
        if self.mode == "vectorized":
            try:
                self.state, info = self.advance(self.state, batch.indices, batch.args, batch.kwargs, phase)
                return info
            except (RuntimeError, NotImplementedError, ModelError) as error:
                self._chains = [tree_map(lambda x, c=c: x[c], self.state) for c in range(self.num_chains)]
                info = self._sequential(batch, phase)  # a model error that is not about vmap is raised here
                self.mode = "sequential"
                warnings.warn(
                    "chains run one after another: the model cannot be vectorised with torch.func.vmap "
                    f"({first_line(error)}).",
                    stacklevel=user_stacklevel(),
                )
                return info
        return self._sequential(batch, phase)

    def advance(self, state: Any, indices: dict, args: tuple, kwargs: dict, phase: Phase) -> tuple[Any, Any]:
        """Every chain one step from ``state`` (vectorised: the stacked state; sequential: the list of chains).

        A function of its arguments (the generator aside): what :class:`CompiledStep` compiles.
        """
        if not isinstance(state, list):  # vectorised (also while falling back to sequential: a list of chains)
            latents = self.program.plain_gradient_at(state, phase)
            if latents is None or torch.compiler.is_compiling():  # compiled: one vmapped gradient transform, traced
                return self._vstep(phase, indices)(state, indices, args, kwargs)
            gradient = chains_gradient(self.log_posterior_fn, latents, Batch(indices, args, kwargs))
            return self._vupdate(phase)(state, gradient)
        chains, infos = [], []
        for c, chain_state in enumerate(state):
            chain_state, info = self._one(chain_state, chain_indices(indices, c), args, kwargs, phase)
            chains.append(chain_state)
            infos.append(info)
        # one chain: its Info as it is, 0-d values that broadcast where the chains' dimension would be (the driver
        # records them into (1, ...) buffers); a stacked copy would cost an operation per field on every step
        return chains, infos[0] if len(infos) == 1 else _stack(infos)

    def _sequential(self, batch: Batch, phase: Phase):
        self._chains, info = self.advance(self._chains, batch.indices, batch.args, batch.kwargs, phase)
        return info

    def _reduced_step(self, batch: Batch, phase: Phase):
        local = self.reducer.shard(batch)
        iterations = phase.power_iterations
        single = phase._replace(power_iterations=min(iterations, 1))
        direction = None  # several power iterations: each Hessian-vector product is all-reduced, then normalised
        for _ in range(max(iterations, 1)):
            gradient = self._estimate(local, single, direction)
            # the N behind the per-example noise estimate (inf for minibatches drawn with replacement)
            population = self.log_posterior_fn.examples(local)[2] if gradient.noise_variance else None
            gradient = self.reducer.reduce(gradient, population)
            direction = normalised_per_chain(gradient.hessian_product) if gradient.hessian_product else None

        def update(state, gradient):
            return self.program.update(state, gradient, self.generator, phase)

        if self.mode == "vectorized":
            self.state, info = vmap(update, randomness="different")(self.state, gradient)
            return info
        infos = []
        for c, chain_state in enumerate(self._chains):
            self._chains[c], info = update(chain_state, tree_map(lambda x, c=c: x[c], gradient))
            infos.append(info)
        return _stack(infos)

    def _estimate(self, batch: Batch, phase: Phase, direction: Latents | None):
        """Every chain's :class:`GradientEstimate` on ``batch``, stacked (``direction``: the power-iteration vector)."""

        def one(state, indices, args, kwargs, direction):
            return self.program.estimate(state, Batch(indices, args, kwargs), self.log_posterior_fn, phase, direction)

        if self.mode == "vectorized":
            try:
                in_dims = (0, index_dims(batch.indices), None, None, None if direction is None else 0)
                return vmap(one, in_dims=in_dims)(self.state, batch.indices, batch.args, batch.kwargs, direction)
            except (RuntimeError, NotImplementedError, ModelError) as error:
                self._chains = [tree_map(lambda x, c=c: x[c], self.state) for c in range(self.num_chains)]
                self.mode = "sequential"
                try:
                    estimate = self._estimate(batch, phase, direction)  # an error not about vmap is raised here
                except Exception:
                    self.mode = "vectorized"
                    raise
                warnings.warn(
                    "chains run one after another: the model cannot be vectorised with torch.func.vmap "
                    f"({first_line(error)}).",
                    stacklevel=user_stacklevel(),
                )
                return estimate
        estimates = []
        for c, chain_state in enumerate(self._chains):
            indices = chain_indices(batch.indices, c)
            chain_direction = None if direction is None else {k: v[c] for k, v in direction.items()}
            estimates.append(one(chain_state, indices, batch.args, batch.kwargs, chain_direction))
        return _stack(estimates)

    def latents(self) -> Latents:
        """The draw of each chain: its last point with a finite log density and gradient."""
        draw = self.program.latents
        if self.mode == "vectorized":
            return draw(self.state)
        per_chain = [draw(s) for s in self._chains]
        return {name: torch.stack([chain[name] for chain in per_chain]) for name in per_chain[0]}

    def restart(self, bad: Tensor, donors: Tensor) -> None:
        """Chains ``bad`` go on as copies of chains ``donors`` (their whole state: :mod:`.stragglers`)."""
        if self.mode == "vectorized":
            self.state = copy_chains(self.state, bad, donors)
        else:
            for chain, donor in zip(bad.tolist(), donors.tolist(), strict=True):
                self._chains[chain] = tree_map(torch.clone, self._chains[donor])

    @property
    def final_state(self) -> Any:
        return self.state if self.mode == "vectorized" else self._chains

    def restore(self, mode: str, state: Any) -> None:
        """Go on from a checkpointed ``final_state`` that was taken in ``mode``."""
        self.mode = mode
        if mode == "vectorized":
            self.state = state
        else:
            self._chains = state


def chains_gradient(log_posterior_fn: Any, latents: Latents, batch: Batch) -> GradientEstimate:
    """:func:`~.base.evaluate` for all chains at once: one vmapped log density, one backward pass outside vmap.

    The chains share no parameter, so the gradient of the sum of their log densities with respect to chain c's
    latents is chain c's own gradient. Plain autograd over the vmapped density spares every operation the gradient
    transform that ``vmap(grad_and_value(...))`` wraps it in (a quarter of a small model's vectorised step, on a CPU).

    Example:
        >>> import torch
        >>> from pyro_scalable.bridge import Batch
        >>> def log_density(latents, batch):
        ...     return -latents["w"].square().sum()
        >>> two_chains = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
        >>> chains_gradient(log_density, two_chains, Batch({}, (), {})).grads["w"]
        tensor([[-2., -4.],
                [-6., -8.]])

    """
    own = getattr(log_posterior_fn, "batched_gradient", None)
    result = own(latents, batch) if own is not None else None
    grads, values = result if result is not None else gradient_and_value(log_posterior_fn, latents, batch)
    grad_sq = sum(g.square().reshape(g.shape[0], -1).sum(1) for g in grads.values())
    diverging = ~torch.isfinite(values + grad_sq)  # as evaluate's: finite where both are
    count = torch.zeros(values.shape, device=values.device)  # no noise estimated (as estimate_gradient's)
    return GradientEstimate(grads, values, grad_sq.sqrt(), diverging, {}, count, {})


def gradient_and_value(log_posterior_fn: Any, latents: Latents, batch: Batch) -> tuple[Latents, Tensor]:
    """Every chain's gradient and value of ``log_posterior_fn``: one vmapped density, one backward pass."""
    leaves = {name: x.detach().requires_grad_() for name, x in latents.items()}

    def one(chain_latents, indices, args, kwargs):
        return log_posterior_fn(chain_latents, Batch(indices, args, kwargs))

    in_dims = (0, index_dims(batch.indices), None, None)
    with torch.enable_grad():
        values = vmap(one, in_dims=in_dims)(leaves, batch.indices, batch.args, batch.kwargs)
        grads = torch.autograd.grad(values.sum(), list(leaves.values()), allow_unused=True, materialize_grads=True)
    return dict(zip(leaves, grads, strict=True)), values.detach()


def index_dims(indices: dict) -> dict:
    """The ``in_dims`` for a step's indices: 0 for per-chain ``(C, B)``, None for a shared ``(B,)``."""
    return {name: 0 if idx.dim() == 2 else None for name, idx in indices.items()}


def chain_indices(indices: dict, chain: int) -> dict:
    """Chain ``chain``'s minibatch indices (a shared minibatch is every chain's)."""
    return {name: idx[chain] if idx.dim() == 2 else idx for name, idx in indices.items()}


def _stack(records: list) -> Any:
    """Stack per-chain records (NamedTuples of tensors and dicts of tensors) on a new leading dimension."""
    if all(isinstance(value, torch.Tensor) for value in records[0]):  # an Info: a flat NamedTuple, no tree to walk
        if len(records) == 1:
            return type(records[0])(*(value.unsqueeze(0) for value in records[0]))
        return type(records[0])(*(torch.stack(values) for values in zip(*records)))
    first, spec = tree_flatten(records[0])
    if len(records) == 1:  # one chain: a view with the leading dimension (a copy per field per step costs more)
        return tree_unflatten([value.unsqueeze(0) for value in first], spec)
    leaves = [first, *(tree_flatten(record)[0] for record in records[1:])]
    return tree_unflatten([torch.stack(values) for values in zip(*leaves)], spec)
