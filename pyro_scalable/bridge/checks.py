"""Validation of a Pyro model and its inputs, with errors that name the site or argument and say what to do."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ModelError",
    "check_inputs",
    "named_tensors",
    "one_subsampled_plate",
]


class ModelError(ValueError):
    """A Pyro model or its inputs cannot be used by an engine; the message says which site or argument and why."""


def named_tensors(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the model's arguments, nested containers included."""
    try:
        names = list(inspect.signature(model).parameters)
    except (TypeError, ValueError):
        names = []
    for position, value in enumerate(args):
        label = f"argument '{names[position]}'" if position < len(names) else f"positional argument {position}"
        yield from _walk(label, value)
    for key, value in kwargs.items():
        yield from _walk(f"argument '{key}'", value)


def _walk(label: str, value: Any) -> Iterator[tuple[str, Tensor]]:
    if isinstance(value, Tensor):
        yield label, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(f"{label}[{i}]", item)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(f"{label}[{key!r}]", item)


def check_inputs(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> torch.device | None:
    """Check the model's tensor arguments are finite and on one device; return that device (None if no tensors)."""
    device = None
    first = None
    for label, tensor in named_tensors(model, args, kwargs):
        if device is None:
            device, first = tensor.device, label
        elif tensor.device != device:
            raise ModelError(
                f"{label} is on {tensor.device} but {first} is on {device}; "
                "move every data tensor to one device (e.g. `.to(device)`) before calling run()."
            )
        if tensor.is_floating_point() or tensor.is_complex():
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                bad = int((~finite).sum())
                raise ModelError(
                    f"{label} holds {bad} non-finite value(s) (NaN or Inf); "
                    "drop or impute them before sampling, or mask them with `poutine.mask` in the model."
                )
    return device


def one_subsampled_plate(bridge: Any, purpose: str) -> Any:
    """The model's one subsampled plate (its ``DataPlate``), or a ``ModelError`` saying ``purpose`` needs one.

    ``purpose`` completes "... needs the likelihood in exactly one subsampled plate", e.g. "SWAG (its snapshots spread
    by the minibatch noise)".

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge.model import ModelBridge
        >>> from pyro_scalable.bridge.checks import one_subsampled_plate
        >>> def model(x):
        ...     w = pyro.sample("w", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", 100, subsample_size=10) as idx:
        ...         pyro.sample("y", dist.Normal(w * x[idx], 1.0), obs=x[idx])
        >>> plate = one_subsampled_plate(ModelBridge(model, (torch.randn(100),), {}), "this engine")
        >>> plate.name, plate.size, plate.subsample_size
        ('data', 100, 10)

    """
    plates = list(bridge.plates.values())
    if len(plates) != 1:
        raise ModelError(
            f"{purpose} needs the likelihood in exactly one subsampled plate (pyro.plate('data', N, "
            f"subsample_size=B)); the model has {len(plates)}."
        )
    return plates[0]
