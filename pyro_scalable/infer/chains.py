"""Stepping many chains at once: one ``torch.func.vmap``-ed computation, or one chain after another.

The driver (:mod:`pyro_scalable.infer.mcmc`) hands each step's minibatch to a :class:`ChainStepper`, which runs the
kernel on every chain: vectorised where the model allows it, sequentially (with a one-line warning) where vmap
cannot batch it. With a ``reducer`` (data-parallel, :mod:`pyro_scalable.infer.distributed`) a step is the kernel's
``estimate`` on this rank's share, an all-reduce, then its ``update``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.infer.distributed import normalised_per_chain

__all__ = ["ChainStepper", "first_line"]


class ChainStepper:
    """Steps all chains: vmapped, single-chain, or one after another (the fallback).

    With a ``reducer`` (data-parallel) a step is ``estimate`` on this rank's share, an all-reduce, then ``update``.
    """

    def __init__(
        self,
        kernel: Any,
        bridge: ModelBridge,
        latents: Latents,
        generator: torch.Generator,
        method: str,
        reducer: Any = None,
    ):
        self.kernel = kernel
        self.reducer = reducer
        self.bridge = bridge
        self.log_posterior_fn = bridge.log_posterior_fn
        self.adapts = bool(getattr(kernel, "adapts", False))
        self.burn_in = False  # the first half of warm-up: an adapting kernel's step size need not be calibrated yet
        self.generator = generator
        self.num_chains = next(iter(latents.values())).shape[0]
        self.mode = "vectorized" if method == "vectorized" and self.num_chains > 1 else "sequential"
        self.state: Any = None
        self._chains: list = []
        self._vsteps: dict[int, Any] = {}
        if self.mode == "vectorized":
            self.state = vmap(kernel.init)(latents)
        else:
            self._chains = [kernel.init({k: v[c] for k, v in latents.items()}) for c in range(self.num_chains)]

    def _one(self, state: Any, indices: dict, args: tuple, kwargs: dict, adapt: int = 0):
        batch = Batch(indices, args, kwargs)
        if self.adapts:
            return self.kernel.step(
                state, batch, self.log_posterior_fn, self.generator, adapt=adapt, burn_in=self.burn_in
            )
        return self.kernel.step(state, batch, self.log_posterior_fn, self.generator)

    def _update(self, state: Any, gradient: Any):
        if self.adapts:
            return self.kernel.update(state, gradient, self.generator, burn_in=self.burn_in)
        return self.kernel.update(state, gradient, self.generator)

    def _vstep(self, adapt: int):
        if adapt not in self._vsteps:

            def one(state, indices, args, kwargs):
                return self._one(state, indices, args, kwargs, adapt)

            self._vsteps[adapt] = vmap(one, in_dims=(0, 0, None, None), randomness="different")
        return self._vsteps[adapt]

    def step(self, batch: Batch, adapt: int = 0):
        if self.reducer is not None:
            return self._reduced_step(batch, adapt)
        if self.mode == "vectorized":
            try:
                self.state, info = self._vstep(adapt)(self.state, batch.indices, batch.args, batch.kwargs)
                return info
            except (RuntimeError, NotImplementedError, ModelError) as error:
                self._chains = [tree_map(lambda x, c=c: x[c], self.state) for c in range(self.num_chains)]
                info = self._sequential(batch, adapt)  # a model error that is not about vmap is raised here
                self.mode = "sequential"
                warnings.warn(
                    "chains run one after another: the model cannot be vectorised with torch.func.vmap "
                    f"({first_line(error)}).",
                    stacklevel=4,
                )
                return info
        return self._sequential(batch, adapt)

    def _sequential(self, batch: Batch, adapt: int = 0):
        infos = []
        for c, chain_state in enumerate(self._chains):
            indices = {k: v[c] for k, v in batch.indices.items()}
            self._chains[c], info = self._one(chain_state, indices, batch.args, batch.kwargs, adapt)
            infos.append(info)
        return _stack(infos)

    def _reduced_step(self, batch: Batch, adapt: int):
        local = self.reducer.shard(batch)
        direction = None  # several power iterations: each Hessian-vector product is all-reduced, then normalised
        for _ in range(max(adapt, 1)):
            gradient = self._estimate(local, min(adapt, 1), direction)
            # the N behind the per-example noise estimate (inf for minibatches drawn with replacement)
            population = self.log_posterior_fn.examples(local)[2] if gradient.noise_variance else None
            gradient = self.reducer.reduce(gradient, population)
            direction = normalised_per_chain(gradient.hessian_product) if gradient.hessian_product else None
        if self.mode == "vectorized":
            update = vmap(self._update, randomness="different")
            self.state, info = update(self.state, gradient)
            return info
        infos = []
        for c, chain_state in enumerate(self._chains):
            self._chains[c], info = self._update(chain_state, tree_map(lambda x, c=c: x[c], gradient))
            infos.append(info)
        return _stack(infos)

    def _estimate(self, batch: Batch, adapt: int, direction: Latents | None):
        """Every chain's :class:`GradientEstimate` on ``batch``, stacked (``direction``: the power-iteration vector)."""

        def one(state, indices, args, kwargs, direction):
            if direction is not None:
                state = state._replace(adaptation=state.adaptation._replace(direction=direction))
            batch = Batch(indices, args, kwargs)
            if self.adapts:
                return self.kernel.estimate(state, batch, self.log_posterior_fn, adapt=adapt)
            return self.kernel.estimate(state, batch, self.log_posterior_fn)

        if self.mode == "vectorized":
            try:
                return vmap(one, in_dims=(0, 0, None, None, None if direction is None else 0))(
                    self.state, batch.indices, batch.args, batch.kwargs, direction
                )
            except (RuntimeError, NotImplementedError, ModelError) as error:
                self._chains = [tree_map(lambda x, c=c: x[c], self.state) for c in range(self.num_chains)]
                self.mode = "sequential"
                try:
                    estimate = self._estimate(batch, adapt, direction)  # an error not about vmap is raised here
                except Exception:
                    self.mode = "vectorized"
                    raise
                warnings.warn(
                    "chains run one after another: the model cannot be vectorised with torch.func.vmap "
                    f"({first_line(error)}).",
                    stacklevel=5,
                )
                return estimate
        estimates = []
        for c, chain_state in enumerate(self._chains):
            indices = {k: v[c] for k, v in batch.indices.items()}
            chain_direction = None if direction is None else {k: v[c] for k, v in direction.items()}
            estimates.append(one(chain_state, indices, batch.args, batch.kwargs, chain_direction))
        return _stack(estimates)

    def latents(self) -> Latents:
        """The draw of each chain: its last point with a finite log density and gradient."""
        if self.mode == "vectorized":
            return self.state.checked_latents
        names = self._chains[0].checked_latents
        return {name: torch.stack([s.checked_latents[name] for s in self._chains]) for name in names}

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
    leaves = [tree_flatten(record)[0] for record in records]
    return tree_unflatten([torch.stack(values) for values in zip(*leaves)], tree_flatten(records[0])[1])


def first_line(error: Exception) -> str:
    """The first line of an error's message (its type's name where it has none), for one-line warnings."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
