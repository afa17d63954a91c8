"""The data's dtype against the priors': numpy arrays and integer tensors, named with the conversion that fits.

The engines index, move, digest and differentiate the data as torch tensors, and torch does not mix dtypes in a
product: ``x @ w`` with an int64 ``x`` and a float32 ``w`` fails with a message that names neither. Both are
refused, not converted, with the conversion to make:

* a numerical **numpy array** is refused before the model runs; the conversion named follows the dtype of the
  model's priors (:func:`priors_dtype`): ``torch.from_numpy(x)`` where it already matches (float64 data, float64
  priors), ``torch.from_numpy(x).float()`` for float32 priors;
* an **integer tensor** is named only where the model failed on it: integers are often indices or counts that must
  stay integers (``b[group]``, a Poisson's observations), so casting every one would break those; the one whose cast
  to the priors' dtype mends the model is named, with that cast (:func:`explain_integer_data`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyro
import torch
from pyro.poutine.util import site_is_subsample
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError, first_line, named_arguments, named_arrays

__all__ = ["explain_integer_data", "priors_dtype", "refuse_numpy"]

_ARGUMENT = re.compile(r"argument '(\w+)'(.*)")  # checks.named_tensors' labels: argument 'x', argument 'd'['x']
_RUNS = (RuntimeError, ValueError, TypeError, IndexError, KeyError)  # how a model fails on data it cannot use


def _expression(label: str) -> str:
    """The Python expression a label of :func:`~.checks.named_tensors` stands for: ``x``, ``d['x']``, ``args[0]``."""
    match = _ARGUMENT.fullmatch(label)
    if match:
        return match.group(1) + match.group(2)
    return f"args[{label.rsplit(' ', 1)[-1]}]" if label.startswith("positional argument") else "x"


def _cast(dtype: torch.dtype) -> str:
    return {torch.float32: "float()", torch.float64: "double()"}.get(dtype, f"to({dtype})")


def _latent_dtype(trace: Any) -> torch.dtype | None:
    for node in trace.nodes.values():
        if node["type"] == "sample" and not node["is_observed"] and not site_is_subsample(node):
            value = node["value"]
            if isinstance(value, Tensor) and value.is_floating_point():
                return value.dtype
    return None


def _converted(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return torch.from_numpy(value)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_converted(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _converted(v) for k, v in value.items()}
    return value


def _runs(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """The model's trace on ``args``/``kwargs`` at a prior draw (the global RNG left as it was), or ``None``."""
    try:
        with torch.random.fork_rng(devices=[]), pyro.validation_enabled(False), torch.no_grad():
            return pyro.poutine.trace(model).get_trace(*args, **kwargs)
    except _RUNS:
        return None


def priors_dtype(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> torch.dtype:
    """The floating dtype of the model's latents at a prior draw (numpy data read as tensors; the default if it fails).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def model(x):
        ...     return pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
        >>> priors_dtype(model, (np.zeros(3),), {})
        torch.float64

    """
    trace = _runs(model, _converted(tuple(args)), _converted(dict(kwargs)))
    found = _latent_dtype(trace) if trace is not None else None
    return found or torch.get_default_dtype()


def refuse_numpy(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Raise a ``ModelError`` for a numerical numpy array among the data, with the conversion the priors ask for."""
    arrays = [(label, a) for label, a in named_arrays(model, args, kwargs) if a.dtype.kind in "biuf"]
    if not arrays:
        return
    label, array = arrays[0]
    dtype, name = priors_dtype(model, args, kwargs), _expression(label)
    if array.dtype.kind == "f" and torch.from_numpy(array[:0]).dtype == dtype:
        fix = f"torch.from_numpy({name}) (it keeps {dtype}, the dtype of the model's priors)"
    elif array.dtype.kind == "f":
        fix = f"torch.from_numpy({name}).{_cast(dtype)} ({dtype}, the dtype of the model's priors)"
    else:
        fix = (
            f"torch.from_numpy({name}) (integers stay integers, for indices and counts; where the model computes "
            f"with it as real numbers, torch.from_numpy({name}).{_cast(dtype)}: the priors are {dtype})"
        )
    raise ModelError(f"{label} is a numpy array ({array.dtype}); the data must be torch tensors: pass {fix} instead.")


def explain_integer_data(model: Callable, args: tuple, kwargs: Mapping[str, Any], trace: Any, error: Exception) -> None:
    """Raise a ``ModelError`` naming the integer argument whose cast to the priors' dtype mends the failed model.

    ``trace``: the failed trace so far (its latents give the priors' dtype). Only top-level tensor arguments are
    tried, one at a time; nothing is raised where no cast mends the model (the failure is something else).
    """
    if isinstance(error, ModelError):
        return
    labelled = list(named_arguments(model, args, kwargs))
    dtype = _latent_dtype(trace) or torch.get_default_dtype()
    for i, (label, value) in enumerate(labelled):
        real = not isinstance(value, Tensor) or value.is_floating_point() or value.is_complex()
        if real or value.dtype == torch.bool:  # (a mask stays a mask)
            continue
        cast = [v.to(dtype) if j == i else v for j, (_, v) in enumerate(labelled)]
        if _runs(model, tuple(cast[: len(args)]), dict(zip(kwargs, cast[len(args) :]))) is not None:
            name = _expression(label)
            raise ModelError(
                f"{label} is {value.dtype} but the model's priors are {dtype}, and the model failed mixing them "
                f"({first_line(error)}). Pass {name}.{_cast(dtype)} (the priors' dtype; "
                f"{name}.to(torch.get_default_dtype()) where they take the default); integers the model only indexes "
                "or counts with can stay integers."
            ) from error
