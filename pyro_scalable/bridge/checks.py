"""Validation of a Pyro model and its inputs, with errors that name the site or argument and say what to do."""

from __future__ import annotations

import inspect
import math
import numbers
import operator
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ModelError",
    "check_choice",
    "check_count",
    "check_device",
    "check_flag",
    "check_inputs",
    "check_number",
    "check_seed",
    "check_tensor",
    "named_tensors",
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


# ---------------------------------------------------------------------------------------------------- arguments
# One-line checks for the public entry points' arguments: each error names the argument and what it must be.


def check_count(name: str, value: Any, least: int = 1, *, optional: bool = False) -> int | None:
    """An ``int >= least`` (``None`` allowed when ``optional``); bools and floats are refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int >= {least}{' or None' if optional else ''}, got {value!r}.")
    if operator.index(value) < least:
        raise ValueError(f"{name} must be an int >= {least}{' or None' if optional else ''}, got {value!r}.")
    return operator.index(value)


def check_number(
    name: str, value: Any, *, positive: bool = False, nonnegative: bool = False, optional: bool = False
) -> float | None:
    """A finite real number (a Python number or a one-element tensor), optionally ``> 0`` or ``>= 0``."""
    if value is None and optional:
        return None
    kind = "a positive" if positive else "a non-negative" if nonnegative else "a finite"
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {kind} number{' or None' if optional else ''}, got {value!r}.")
    number = float(value)
    if not math.isfinite(number) or (positive and number <= 0) or (nonnegative and number < 0):
        raise ValueError(f"{name} must be {kind} finite number, got {value!r}.")
    return number


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """One of ``choices`` (strings, usually)."""
    if not isinstance(value, Hashable) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}.")
    return value


def check_flag(name: str, value: Any, *, optional: bool = False) -> bool | None:
    """A bool (``None`` allowed when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}.")
    return value


def check_seed(name: str, value: Any) -> int | None:
    """A seed: ``None`` or a non-negative int."""
    return check_count(name, value, 0, optional=True)


def check_device(name: str, value: Any) -> torch.device:
    """A ``torch.device`` or a string naming one."""
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', got {value!r}."
        ) from None


def check_tensor(
    name: str, value: Any, *, positive: bool = False, nonnegative: bool = False, shape: torch.Size | None = None
) -> Tensor:
    """A finite float tensor (or number), optionally ``> 0`` or ``>= 0``, broadcastable to ``shape``."""
    if isinstance(value, bool) or not isinstance(value, (Tensor, numbers.Real)):
        raise TypeError(f"{name} must be a number or a float tensor, got {type(value).__name__}.")
    tensor = torch.as_tensor(value)
    if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"{name} must be a number or a float tensor, got dtype {tensor.dtype}.")
    if shape is not None:
        try:
            torch.broadcast_shapes(tensor.shape, shape)
        except RuntimeError:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}; it must be a scalar or broadcast to {tuple(shape)}."
            ) from None
    if (
        not bool(torch.isfinite(tensor).all())
        or (positive and not bool((tensor > 0).all()))
        or (nonnegative and not bool((tensor >= 0).all()))
    ):
        kind = "positive and finite" if positive else "non-negative and finite" if nonnegative else "finite"
        raise ValueError(f"{name} must be {kind} everywhere, got {_short(tensor)}.")
    return tensor


def _short(tensor: Tensor) -> str:
    return repr(tensor.item()) if tensor.numel() == 1 else f"a tensor of shape {tuple(tensor.shape)}"
