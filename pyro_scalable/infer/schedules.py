r"""Step-size (and temperature) schedules: pure functions of the step count, safe under ``torch.func.vmap``.

* constant: a float or 0-d tensor;
* :class:`PolynomialDecay`: :math:`\epsilon_t = a (b + t)^{-\gamma}`, with :math:`\gamma \in (0.5, 1]` for the
  Robbins-Monro conditions of Welling & Teh (2011);
* :class:`Cyclical`: :math:`\epsilon_t = \frac{\epsilon_0}{2}\big(\cos(\pi \frac{t \bmod L}{L}) + 1\big)`,
  the cosine cycles of length :math:`L` steps of Zhang et al. (2020), "Cyclical SG-MCMC".

A schedule is any callable ``step_count -> Tensor``; the classes here are frozen dataclasses so that their
hyperparameters can be read back (``schedule.gamma``) and show in ``repr``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor

__all__ = ["Cyclical", "PolynomialDecay", "ScalarOrSchedule", "check_schedule", "constant", "resolve"]

ScalarOrSchedule = Union[float, Tensor, Callable[[Tensor], Tensor]]


@dataclass(frozen=True)
class PolynomialDecay:
    """Step size ``a * (b + t) ** -gamma`` at step ``t`` (Welling & Teh, 2011).

    Example:
        >>> schedule = PolynomialDecay(a=0.1, b=1.0, gamma=0.55)
        >>> round(float(schedule(torch.tensor(0))), 6)
        0.1

    """

    a: float
    b: float = 1.0
    gamma: float = 0.55

    def __post_init__(self) -> None:
        if not (self.a > 0 and self.b > 0 and self.gamma >= 0):
            raise ValueError(f"PolynomialDecay needs a > 0, b > 0 and gamma >= 0; got {self}.")

    def __call__(self, step_count: Tensor) -> Tensor:
        return self.a * (self.b + step_count) ** (-self.gamma)


@dataclass(frozen=True)
class Cyclical:
    """Cosine cycles from ``initial`` down to 0, each ``cycle_length`` steps long (Zhang et al., 2020).

    Example:
        >>> schedule = Cyclical(initial=0.2, cycle_length=100)
        >>> [round(float(schedule(torch.tensor(t))), 3) for t in (0, 50, 100)]
        [0.2, 0.1, 0.2]

    """

    initial: float
    cycle_length: int

    def __post_init__(self) -> None:
        if not (self.initial > 0 and self.cycle_length >= 1):
            raise ValueError(f"Cyclical needs initial > 0 and cycle_length >= 1; got {self}.")

    def __call__(self, step_count: Tensor) -> Tensor:
        phase = torch.remainder(step_count, self.cycle_length) / self.cycle_length
        return 0.5 * self.initial * (torch.cos(math.pi * phase) + 1.0)


def resolve(value: ScalarOrSchedule, step_count: Tensor, like: Tensor) -> Tensor:
    """The value of a constant or schedule at ``step_count``, as a tensor of ``like``'s dtype and device."""
    if callable(value):
        value = value(step_count)
    if isinstance(value, (int, float)):
        return constant(value, like)
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def constant(value: float, like: Tensor) -> Tensor:
    """``value`` as a 0-d tensor of ``like``'s dtype and device, made once and shared (read it, never write to it).

    A kernel's constant hyperparameters enter every step as tensors; making them anew would add a few tensor
    constructions per step, each a noticeable share of a small model's whole step on a CPU.

    Example:
        >>> import torch
        >>> constant(0.5, torch.zeros(3)) is constant(0.5, torch.ones(2))
        True

    """
    # an inference tensor could not be used outside inference mode later; a compiled step (which cannot ask about
    # inference mode) makes its constants inside its graph
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return torch.full((), float(value), dtype=like.dtype, device=like.device)
    return _constant(float(value), like.dtype, like.device)


@functools.lru_cache(maxsize=64)
def _constant(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((), value, dtype=dtype, device=device)


def check_positive(name: str, value: ScalarOrSchedule, *, allow_zero: bool = False) -> None:
    """Raise a one-line ``ValueError`` unless a constant ``value`` is finite and positive (or zero)."""
    if callable(value):
        return
    bound = ">= 0" if allow_zero else "> 0"
    try:
        number = float(value)
    except (TypeError, ValueError):  # a dict, a string, a tensor of several values: say which argument
        raise TypeError(f"{name} must be a number {bound} or a schedule, got {type(value).__name__}.") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        raise ValueError(f"{name} must be finite and {bound}, got {number}.")


def check_schedule(name: str, value: ScalarOrSchedule, steps: int, *, allow_zero: bool = False) -> None:
    """Raise a one-line ``ValueError`` at the first of ``steps`` steps where a schedule is not finite and positive.

    A schedule is a pure function of the step count, so its values over a run are known before the run: they are
    computed here once, on the host, as one call on ``torch.arange(steps)`` where the schedule takes a vector (the
    classes here do), one call per step otherwise. The kernels then never check a value inside a step (a device
    sync each on a GPU). ``allow_zero``: zero is valid (a temperature). Constants are checked where they are given
    (:func:`check_positive`).

    Example:
        >>> check_schedule("step_size", lambda t: 1e-3 * (1 - t / 100), 200)
        Traceback (most recent call last):
        ...
        ValueError: step_size is a schedule whose value at step 100 is 0 (of the run's 200 steps); ...

    """
    if not callable(value):
        return
    values = None
    try:
        values = torch.as_tensor(value(torch.arange(steps)), dtype=torch.float64).cpu()
    except (RuntimeError, TypeError, ValueError):  # a schedule written for one step count at a time
        pass
    if values is None or values.shape not in ((), (steps,)):
        values = torch.tensor([float(value(torch.tensor(t))) for t in range(steps)], dtype=torch.float64)
    values = values.expand(steps)
    bad = ~torch.isfinite(values) | ((values < 0) if allow_zero else (values <= 0))
    if bool(bad.any()):
        step = int(bad.nonzero()[0])
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(
            f"{name} is a schedule whose value at step {step} is {float(values[step]):.3g} (of the run's {steps} "
            f"steps); {name} must be finite and {bound} at every step: fix the schedule (e.g. clamp it, or let it "
            "end after the run's last step)."
        )
