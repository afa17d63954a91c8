"""One-line checks of the public entry points' arguments: each error names the argument and what it must be.

Generic (no Pyro in here): every engine, the driver and the ArviZ adapter validate their keyword arguments with
these at construction, so that a wrong value fails at once with a message, not deep inside a run.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
from collections.abc import Hashable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "check_choice",
    "check_count",
    "check_device",
    "check_flag",
    "check_number",
    "check_seed",
    "check_tensor",
    "fork_rng",
]


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


@contextlib.contextmanager
def fork_rng(seed: int | None) -> Iterator[None]:
    """Seed torch's RNGs (CPU and every initialised CUDA device) for a block and restore them after it.

    ``seed=None`` leaves the RNGs alone: the block draws from, and advances, the global state.

    Example:
        >>> before = torch.get_rng_state()
        >>> with fork_rng(0):
        ...     a = torch.rand(2)
        >>> with fork_rng(0):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b) and torch.equal(torch.get_rng_state(), before)
        True

    """
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
