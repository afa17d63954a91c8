"""What every stochastic-gradient MCMC engine shares: the contract, the Info record, gradients and noise.

Contract (BlackJAX-style): an engine module has ``init(latents) -> State`` and
``step(state, batch, log_posterior_fn, *, <hyperparameters>, generator) -> (State, Info)``, with every State
field a tensor so that ``torch.func.vmap(step, randomness="different")`` runs many chains as one computation.
Every State also carries ``checked_latents``: the last point at which the log density and its gradient were
found finite. That point, not the untested proposal, is the draw the driver records, so ``Info.log_posterior``
and ``Info.grad_norm`` belong to it (on a diverging step they show the non-finite values met). A step whose log
density or gradient is not finite sets ``Info.diverging`` and sends the chain back to ``checked_latents``
(momentum reset): it goes on from there with fresh noise and a fresh minibatch, and no engine ever hands the
driver a point with a non-finite density, let alone a NaN draw.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.func import grad_and_value

__all__ = ["LogPosteriorFn", "SGMCMCInfo", "evaluate", "gaussian_like", "keep_where_finite"]

Latents = dict[str, Tensor]


class LogPosteriorFn(Protocol):
    """``log_posterior_fn(latents, batch)``: an unbiased minibatch estimate of the full-data log joint."""

    def __call__(self, latents: Latents, batch: Any) -> Tensor: ...


class SGMCMCInfo(NamedTuple):
    """What one step did, for people and for ArviZ ``sample_stats`` (all 0-d tensors per chain)."""

    log_posterior: Tensor  # minibatch estimate at the latents before the step ("lp" in ArviZ)
    grad_norm: Tensor
    step_size: Tensor  # after schedules
    temperature: Tensor  # after schedules
    diverging: Tensor  # bool: the step was rejected because the log density or gradient was not finite


def evaluate(log_posterior_fn: LogPosteriorFn, latents: Latents, batch: Any) -> tuple[Latents, Tensor, Tensor, Tensor]:
    """Gradient, value, gradient norm and a divergence flag of the log posterior at ``latents``."""
    if any(_under_transform(x) for x in latents.values()):
        grads, value = grad_and_value(log_posterior_fn)(latents, batch)
    else:
        # Outside vmap, plain autograd gives the same numbers and saves torch.func's per-call overhead
        # (about half a millisecond on a CPU, as much as a small model's whole backward pass).
        leaves = {name: x.detach().requires_grad_() for name, x in latents.items()}
        with torch.enable_grad():
            value = log_posterior_fn(leaves, batch)
            values = torch.autograd.grad(value, list(leaves.values()), allow_unused=True, materialize_grads=True)
        grads = dict(zip(leaves, values, strict=True))
        value = value.detach()
    grad_sq = sum(g.square().sum() for g in grads.values())
    diverging = ~(torch.isfinite(value) & torch.isfinite(grad_sq))
    return grads, value, grad_sq.sqrt(), diverging


def _under_transform(x: Tensor) -> bool:
    """Whether ``x`` is a torch.func (vmap/grad) wrapper, so that autograd.grad cannot be used on it."""
    is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return True if is_wrapped is None else bool(is_wrapped(x))


def gaussian_like(latents: Latents, generator: torch.Generator | None, temperature: Any = 1.0) -> Latents:
    """Independent standard normal noise shaped like each latent (zeros, drawing nothing, at a constant T = 0)."""
    if not callable(temperature) and float(temperature) == 0.0:
        return {name: torch.zeros_like(x) for name, x in latents.items()}
    return {
        name: torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device) for name, x in latents.items()
    }


def keep_where_finite(diverging: Tensor, new: Latents, old: Latents) -> Latents:
    """Select ``new`` where the step was finite and ``old`` where it diverged."""
    return {name: torch.where(diverging, old[name], new[name]) for name in new}
