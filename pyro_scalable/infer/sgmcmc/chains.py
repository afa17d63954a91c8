"""Stepping many chains at once: one ``torch.func.vmap``-ed computation, or one chain after another.

The driver (:mod:`.mcmc`) hands each step's minibatch, index and gradient estimator (the
:class:`~pyro_scalable.infer.gradients.GradientEstimator` of the density whose gradient the step takes) to a
:class:`ChainStepper`, which runs a *program*
on every chain: vectorised where the model allows it, sequentially (with a one-line warning) where vmap cannot
batch it. A program (:class:`~.program.Program`) is warm-up around a kernel (:class:`~.adaptation.Adaptation`) or
the kernel sampling with its hyperparameters (:class:`~.adaptation.Tuned`): ``init(latents)``,
``phase(step_index)``, ``step(state, batch, estimator, generator, phase)``, ``latents(state)``, and the
halves of a step. With a ``reducer`` (data-parallel, :mod:`.distributed`) a step is
``estimate(state, batch, estimator, phase, direction)`` on this rank's share, an all-reduce, then
``update(state, gradient, estimator, generator, phase)`` (which folds the pooled estimate into the estimator's
state).
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
from pyro_scalable.bridge.traced import block_steps, compiling
from pyro_scalable.infer.gradients.estimate import chain_indices, index_dims
from pyro_scalable.infer.gradients.estimator import GradientEstimator
from pyro_scalable.infer.sgmcmc.base import DrawnNoise, Phase
from pyro_scalable.infer.sgmcmc.compiled_step import CompiledStep
from pyro_scalable.infer.sgmcmc.distributed import normalised_per_chain
from pyro_scalable.infer.sgmcmc.stragglers import copy_chains

__all__ = ["ChainStepper", "CompiledStep", "first_line"]


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
        self.estimator: GradientEstimator | None = None  # the running step's, as step() is handed it
        self.generator = generator
        self.num_chains = next(iter(latents.values())).shape[0]
        self.mode = "vectorized" if method == "vectorized" and self.num_chains > 1 else "sequential"
        self.state: Any = None
        self._chains: list = []
        self._vsteps: dict[tuple, Any] = {}  # by phase and the indices' vmap dims
        self._batched_estimates = True  # eager steps estimate every chain at once (program.chains_estimate)
        # model_tracing(compile=True, block_steps=1): the whole step compiled (more steps: the driver's blocks)
        self.compiled = CompiledStep() if compiling() and block_steps() == 1 else None
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

    def _one(self, state: Any, indices: dict, args: tuple, kwargs: dict, phase: Phase, noise: Any = None):
        if noise is not None:  # a compiled block's step: its noise drawn before the block, as the eager step draws it
            generator = DrawnNoise(noise)
        else:  # compiled one step at a time: torch's RNG, seeded per step
            generator = None if torch.compiler.is_compiling() else self.generator
        return self.program.step(state, Batch(indices, args, kwargs), self.estimator, generator, phase)

    def _vstep(self, phase: Phase, indices: dict, drawn: bool = False):
        dims = index_dims(indices)
        key = (phase, tuple(dims.items()), drawn)
        if key not in self._vsteps:

            def one(state, indices, args, kwargs, noise=None):
                return self._one(state, indices, args, kwargs, phase, noise)

            in_dims = (0, dims, None, None) + ((0,) if drawn else ())  # the drawn noise: each chain's row
            self._vsteps[key] = vmap(one, in_dims=in_dims, randomness="different")
        return self._vsteps[key]

    def _vupdate(self, phase: Phase):
        key = ("update", phase)
        if key not in self._vsteps:

            def update(state, gradient):
                generator = None if torch.compiler.is_compiling() else self.generator
                return self.program.update(state, gradient, self.estimator, generator, phase)

            self._vsteps[key] = vmap(update, randomness="different")
        return self._vsteps[key]

    def step(self, batch: Batch, step_index: int, estimator: GradientEstimator):
        """Step every chain on ``batch``, the run's step ``step_index``, by the gradient ``estimator`` estimates.

        Returns the stacked Info (one chain's: 0-d).
        """
        self.estimator = estimator
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

    def advance(
        self, state: Any, indices: dict, args: tuple, kwargs: dict, phase: Phase, noise: Any = None
    ) -> tuple[Any, Any]:
        """Every chain one step from ``state`` (vectorised: the stacked state; sequential: the list of chains).

        A function of its arguments (the generator aside): what :class:`CompiledStep` compiles, and a compiled
        block (:mod:`.compiled_blocks`) unrolls, handing each step its ``noise`` drawn before the block
        (vectorised: one ``(chains, ...)`` tensor per latent; sequential: a list of each chain's latents' noise).
        """
        if not isinstance(state, list):  # vectorised (also while falling back to sequential: a list of chains)
            # eager: every chain's estimate at once outside vmap (plain autograd), then the vmapped update
            if noise is None and not torch.compiler.is_compiling() and self._batched_estimates:
                try:
                    gradient = self.program.chains_estimate(state, Batch(indices, args, kwargs), self.estimator, phase)
                except (RuntimeError, NotImplementedError):  # a model vmap cannot batch so: the transform below
                    self._batched_estimates = False
                else:
                    return self._vupdate(phase)(state, gradient)
            # compiled, or a block's drawn noise: one vmapped gradient transform and update (traced when compiled)
            drawn = () if noise is None else (noise,)
            return self._vstep(phase, indices, bool(drawn))(state, indices, args, kwargs, *drawn)
        chains, infos = [], []
        for c, chain_state in enumerate(state):
            chain_noise = None if noise is None else noise[c]
            chain_state, info = self._one(chain_state, chain_indices(indices, c), args, kwargs, phase, chain_noise)
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
            population = self.estimator.density.examples(local)[2] if gradient.noise_variance else None
            gradient = self.reducer.reduce(gradient, population)
            direction = normalised_per_chain(gradient.hessian_product) if gradient.hessian_product else None

        def update(state, gradient):
            return self.program.update(state, gradient, self.estimator, self.generator, phase)

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
            return self.program.estimate(state, Batch(indices, args, kwargs), self.estimator, phase, direction)

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
        return chains_draw(self.program, self.state if self.mode == "vectorized" else self._chains)

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


def chains_draw(program: Any, state: Any) -> Latents:
    """The chains' draw ``(chains, ...)`` from their state: stacked (vectorised) or a list of each chain's."""
    if not isinstance(state, list):
        return program.latents(state)
    per_chain = [program.latents(chain) for chain in state]
    return {name: torch.stack([chain[name] for chain in per_chain]) for name in per_chain[0]}
