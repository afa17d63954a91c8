"""The driver's arguments that are not settings: Pyro's and NumPyro's spellings, the data or a ``batches=`` iterable."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch import Tensor

from pyro_scalable.bridge.checks import ModelError, first_line
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer.record import RunRecord

__all__ = ["bind", "check_choices", "cycle", "refuse_pyro_spellings"]

# pyro.infer.MCMC's (and NumPyro's) arguments: what to pass instead, or why there is no such thing here
_PYRO_SPELLINGS = {
    "warmup_steps": "use num_warmup= (steps per chain before the first kept draw)",
    "disable_progbar": "use progress_bar=False",
    "thinning": "use thin=",
    "initial_params": "initial points come from the kernel's init_strategy: pass e.g. "
    "SGHMC(model, init_strategy=pyro.infer.autoguide.init_to_value(values={...}))",
    "hook_fn": "there is no per-step hook; read the draws and sample_stats after run(), or use checkpoint= "
    "to save the state as it goes",
    "mp_context": "chains run together in one process (torch.func.vmap); use chain_method= to choose how, or "
    "distributed='chains' to spread them over torchrun processes",
    "disable_validation": "the model and data are checked once when the run starts, then stepped without "
    "validation; use pyro.enable_validation(False) to switch Pyro's checks off there too",
    "transforms": "each latent site is sampled in the unconstrained space of torch.distributions.biject_to of its "
    "support; reparametrise the model to change it",
    "save_params": "every latent site's draws are kept; select with get_samples()[site]",
    "jit_model_args": "models are not JIT-compiled",
}


def refuse_pyro_spellings(unknown: dict[str, Any]) -> None:
    """Raise a TypeError for ``unknown`` keyword arguments, naming ours where one is Pyro's or NumPyro's."""
    for name in unknown:
        if name in _PYRO_SPELLINGS:
            raise TypeError(f"StochasticMCMC has no argument {name}= (pyro.infer.MCMC's): {_PYRO_SPELLINGS[name]}.")
    if unknown:
        raise TypeError(f"StochasticMCMC got an unexpected keyword argument {next(iter(unknown))!r}.")


def check_choices(kernel: Any, chain_method: str, on_divergence: str, minibatches: str | None) -> str:
    """Check the driver's string choices; return the minibatch scheme.

    ``minibatches=None`` is ``"independent"`` for a kernel that corrects its gradient noise, else ``"epoch"``.
    """
    if chain_method == "parallel":
        raise ValueError(
            "chain_method='parallel' (NumPyro's: one process per chain) is not supported: chains run together in "
            "one process with 'vectorized'; use distributed='chains' to spread them over torchrun processes."
        )
    if chain_method not in ("vectorized", "sequential"):
        raise ValueError(f"chain_method must be 'vectorized' or 'sequential', got {chain_method!r}.")
    if on_divergence not in ("continue", "stop"):
        raise ValueError(f"on_divergence must be 'continue' or 'stop', got {on_divergence!r}.")
    if minibatches not in ("epoch", "independent", None):
        raise ValueError(f"minibatches must be 'epoch', 'independent' or None, got {minibatches!r}.")
    if minibatches is None:
        noisy = kernel.gradient_noise != "ignore"
        minibatches = "independent" if noisy else "epoch"
    return minibatches


def cycle(batches: Iterable) -> Iterator[tuple[tuple, dict]]:
    """Each element of ``batches`` as ``(args, kwargs)``, starting over at its end (an empty one is an error)."""
    while True:
        empty = True
        for element in batches:
            empty = False
            if isinstance(element, dict):
                yield (), element
            elif isinstance(element, (tuple, list)):
                yield tuple(element), {}
            else:
                yield (element,), {}
        if empty:
            raise ValueError("batches is empty: it must yield at least one minibatch.")


def bind(
    model: Any, args: tuple, kwargs: dict, batches: Iterable | None, seed: int | None = None
) -> tuple[RunRecord, Iterator | None]:
    """The run's record (``model`` on the steps' data and on the full data) and the DataLoader's iterator.

    ``seed`` (the run's) seeds the prior draws of the bridges' checking traces.
    """
    if batches is None:
        bridge = ModelBridge(model, args, kwargs, seed=seed)
        return RunRecord(bridge, bridge, args, kwargs), None
    if not isinstance(batches, Iterable) or isinstance(batches, (Tensor, str)):
        raise TypeError(
            f"batches must be an iterable of minibatches (e.g. a DataLoader), got {type(batches).__name__}."
        )
    batch_iter = cycle(batches)
    first = next(batch_iter)
    try:
        bridge = ModelBridge(model, *first, seed=seed)
    except (TypeError, ValueError, IndexError, RuntimeError) as error:
        # a ModelError is the data's fault, unless torch failed inside the model on this element (its cause)
        if isinstance(error, ModelError) and not isinstance(error.__cause__, RuntimeError):
            raise
        raise TypeError(
            f"the model failed on the first element of batches ({first_line(error)}); batches must yield a "
            "tuple of the model's positional arguments or a dict of its keyword arguments."
        ) from error
    full = ModelBridge(model, args, kwargs, seed=seed) if (args or kwargs) else None
    return RunRecord(bridge, full, args, kwargs), itertools.chain([first], batch_iter)
