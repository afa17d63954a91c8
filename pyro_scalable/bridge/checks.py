"""Validation of a Pyro model and its inputs, with errors that name the site or argument and say what to do."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pyro
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from torch.distributions import constraints

__all__ = [
    "ModelError",
    "check_inputs",
    "check_model",
    "checked_init",
    "checking_draws",
    "explain_latent_in_plate",
    "explain_invalid_parameters",
    "explain_mixed_tensors",
    "explain_sequence_data",
    "first_line",
    "named_arguments",
    "named_arrays",
    "named_tensors",
    "one_subsampled_plate",
    "same_support",
    "user_stacklevel",
]


class ModelError(ValueError):
    """A Pyro model or its inputs cannot be used by an engine; the message says which site or argument and why."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name where it has none), for one-line messages.

    Example:
        >>> first_line(ValueError(chr(10).join(["shape mismatch", "in site 'w'"]))), first_line(KeyError())
        ('shape mismatch', 'KeyError')

    """
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def named_tensors(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the model's arguments, nested containers included."""
    for label, value in _labelled(model, args, kwargs):
        yield from _walk(label, value)


def named_arrays(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` for every numpy array in the model's arguments, nested containers included."""
    for label, value in _labelled(model, args, kwargs):
        yield from _walk(label, value, np.ndarray)


def named_arguments(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, value)`` for every top-level argument, positional ones first (labels as :func:`named_tensors`)."""
    yield from _labelled(model, args, kwargs)


def _walk(label: str, value: Any, kind: type | tuple[type, ...] = Tensor) -> Iterator[tuple[str, Any]]:
    if isinstance(value, kind):
        yield label, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(f"{label}[{i}]", item, kind)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(f"{label}[{key!r}]", item, kind)


def _labelled(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(label, value)`` of every top-level argument, labelled by its parameter's name where the signature has one."""
    try:
        names = list(inspect.signature(model).parameters)
    except (TypeError, ValueError):
        names = []
    for position, value in enumerate(args):
        yield (f"argument '{names[position]}'" if position < len(names) else f"positional argument {position}"), value
    for key, value in kwargs.items():
        yield f"argument '{key}'", value


def check_model(model: Any, args: Any = (), kwargs: Any = None) -> None:
    """Check the model is a callable, not a Pyro guide (``SGHMC(AutoNormal(model))``), args a tuple, kwargs a dict."""
    if not callable(model):
        raise TypeError(f"model must be a Pyro model (a callable), got {type(model).__name__}.")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of the model's positional arguments, got {type(args).__name__}.")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict of the model's keyword arguments, got {type(kwargs).__name__}.")
    if isinstance(model, AutoGuide):
        kind = type(model).__name__
        raise ModelError(
            f"the model given is a guide ({kind}), not a model: its sites are the guide's, with no observed site. "
            f"The engines sample the model's own posterior: pass the model itself, e.g. SGHMC(model) rather than "
            f"SGHMC({kind}(model))."
        )


def check_inputs(model: Callable, args: tuple, kwargs: Mapping[str, Any]) -> torch.device | None:
    """Check the model's tensor arguments are finite, float32/float64, on one device; return that device (or None).

    Numerical numpy arrays are refused before (:func:`~.dtypes.refuse_numpy`), with the conversion to make.
    """
    device = None
    first = None
    for label, tensor in named_tensors(model, args, kwargs):
        if tensor.dtype in (torch.float16, torch.bfloat16):
            raise ModelError(
                f"{label} is {tensor.dtype}; the samplers need float32 or float64 data, since half precision's "
                "few significant digits round away a step's change and its log densities overflow (nearly every "
                "step diverges). Pass it as .float() (or .double()); its memory doubles, only here."
            )
        if device is None:
            device, first = tensor.device, label
        elif tensor.device != device:
            raise ModelError(
                f"{label} is on {tensor.device} but {first} is on {device}; "
                "move every data tensor to one device (e.g. `.to(device)`) before calling run()."
            )
        # a finite sum has no NaN or Inf among its terms (each propagates): one read of the data, no mask; only a
        # sum that is not finite (a value NaN or Inf, or finite ones overflowing) needs the elementwise check
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor.sum())):
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                bad = int((~finite).sum())
                raise ModelError(
                    f"{label} holds {bad} non-finite value(s) (NaN or Inf); "
                    "drop or impute them before sampling, or mask them with `poutine.mask` in the model."
                )
    return device


def checked_init(strategy: Callable, shapes: Mapping[str, torch.Size], supports: Mapping[str, Any]) -> Callable:
    """``strategy`` (a Pyro init strategy) with each latent's value checked before the model uses it.

    A value of another shape than the site's, not finite, or outside the site's support is a ``ModelError`` naming the
    site and the value: a chain started there would diverge at every step (a NaN) or fail with a size mismatch.

    Example:
        >>> import torch
        >>> from pyro.infer.autoguide import init_to_value
        >>> from torch.distributions import constraints
        >>> init = checked_init(init_to_value(values={"s": torch.tensor(-1.0)}), {"s": torch.Size()},
        ...                     {"s": constraints.positive})
        >>> init({"name": "s", "fn": None, "value": None, "infer": {}, "is_observed": False})
        Traceback (most recent call last):
        ...
        pyro_scalable.bridge.checks.ModelError: init_strategy gave latent site 's' the value -1, outside its support ...

    """

    def init(site: dict) -> Tensor:
        value, name = strategy(site), site["name"]
        if name not in shapes or not isinstance(value, Tensor):
            return value
        if value.shape != shapes[name]:
            raise ModelError(
                f"init_strategy gave latent site '{name}' a value of shape {tuple(value.shape)}, but the site's shape "
                f"is {tuple(shapes[name])}: give init_to_value a tensor of shape {tuple(shapes[name])} for '{name}'."
            )
        finite = torch.isfinite(value) if value.is_floating_point() else torch.ones_like(value, dtype=torch.bool)
        outside = f"outside its support {supports[name]}"
        for good, what in ((finite, "which is not finite"), (supports[name].check(value), outside)):
            if not bool(good.all()):
                shown = _short(value[~good][:1] if good.shape == value.shape else value)
                of = f" (at {int((~good).sum())} of {good.numel()} entries)" if good.numel() > 1 else ""
                raise ModelError(
                    f"init_strategy gave latent site '{name}' the value {shown}{of}, {what}: give "
                    f"init_to_value a finite value inside the support for '{name}', or leave '{name}' out of its "
                    "values (then drawn as init_to_uniform does)."
                )
        return value

    return init


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
    rows = getattr(bridge, "data_rows", None)  # the rows of a model that subsamples none (bridge/subsampling.py)
    if len(plates) != 1:
        fix = (
            f": observed site '{rows.site}' runs on all {rows.rows} rows at every step. Write "
            f"`{rows.plate_line()}` around it and index the data with idx"
            if not plates and rows is not None
            else ""
        )
        raise ModelError(
            f"{purpose} needs the likelihood in exactly one subsampled plate (pyro.plate('data', N, "
            f"subsample_size=B)); the model has {len(plates)}{fix}."
        )
    return plates[0]


def explain_sequence_data(model: Callable, args: tuple, kwargs: Mapping[str, Any], error: Exception) -> None:
    """Raise a ModelError naming an argument that is a list or tuple of numbers, when the model failed on its data."""
    for label, value in _labelled(model, args, kwargs):
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
            raise ModelError(
                f"the model failed ({first_line(error)}) and {label} is a {type(value).__name__} of {len(value)} "
                "numbers; the data must be torch tensors (plates index them with tensors of indices): pass "
                "torch.tensor(...) (float32 for real values, the dtype of the model's priors by default)."
            ) from error


#: the seed of the checking traces' prior draws where the caller gives none (the same checks on every call)
CHECK_SEED = 0


@contextlib.contextmanager
def checking_draws(seed: int | None, device: torch.device | None) -> Iterator[None]:
    """Draw the checking traces' latents from the prior under ``seed`` (default :data:`CHECK_SEED`), not the global RNG.

    The checks then pass or fail alike on every call with one seed, and leave the global RNG as they found it.
    """
    devices = [device.index] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(CHECK_SEED if seed is None else seed)
        yield


def explain_invalid_parameters(
    model: Callable, args: tuple, kwargs: Mapping[str, Any], trace, error: Exception
) -> None:
    """Raise a ModelError naming the site whose distribution got invalid parameters at a prior draw of the latents.

    ``trace`` is the failed trace so far: its latents' values are replayed (validation off) to find the first site
    whose parameters break their constraints, where torch's message names no site.
    """
    if not str(error).startswith("Expected parameter"):
        return
    drawn = {
        name: node["value"]
        for name, node in trace.nodes.items()
        if node["type"] == "sample" and not node["is_observed"] and not site_is_subsample(node)
    }
    with pyro.validation_enabled(False):
        replay = pyro.poutine.trace(pyro.poutine.condition(model, data=drawn)).get_trace(*args, **kwargs)
    at = ", ".join(f"{name}={_short(value)}" for name, value in drawn.items()) or "none drawn yet"
    for name, node in replay.nodes.items():
        fn = node["fn"] if node["type"] == "sample" else None
        while hasattr(fn, "base_dist"):  # Independent, masked, expanded: the parameters are the base's
            fn = fn.base_dist
        for parameter, constraint in getattr(fn, "arg_constraints", {}).items():
            value = None if constraints.is_dependent(constraint) else getattr(fn, parameter, None)
            valid = constraint.check(value) if isinstance(value, Tensor) else None
            if valid is not None and not bool(valid.all()):
                shown = _short((value[~valid] if valid.shape == value.shape else value).flatten()[:1])
                count = f" in {int((~valid).sum())} of {valid.numel()} entries" if valid.numel() > 1 else ""
                raise ModelError(
                    f"site '{name}': its {type(fn).__name__} got an invalid {parameter} ({shown}{count}) at latents "
                    f"drawn from their prior ({at}): the model's density is undefined at part of the prior's "
                    f"support. Give the latents priors on the support where {parameter} is valid (a positive one "
                    "as HalfNormal or LogNormal), or map them onto it in the model (torch.exp, softplus)."
                ) from error
    raise ModelError(
        f"a distribution got invalid parameters ({first_line(error)}) at latents drawn from their prior ({at}): the "
        "model's density is undefined at part of the prior's support. Give the latents priors on the support where "
        "the parameters are valid, or map them onto it in the model (torch.exp, softplus)."
    ) from error


def _short(value: Tensor) -> str:
    value = value.detach()
    return f"{value.item():.4g}" if value.numel() == 1 else f"tensor of shape {tuple(value.shape)}"


def explain_latent_in_plate(trace, error: Exception) -> None:
    """Raise a ModelError when the model failed after sampling a latent inside a subsampled plate."""
    for name, node in trace.nodes.items():
        if node["type"] != "sample" or node["is_observed"] or site_is_subsample(node):
            continue
        for frame in node["cond_indep_stack"]:
            if frame.full_size is not None and frame.size < frame.full_size:
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise ModelError(
                    f"the model failed ({first}) after sampling latent site '{name}' inside the subsampled plate "
                    f"'{frame.name}', which gives it a batch dimension of the minibatch's size. Global latents "
                    "must be sampled outside the plate; a PyroModule's PyroSample weights are sampled when the "
                    "module runs, so run the network outside the `with plate` block: "
                    "`data = pyro.plate(...); f = net(x[data.indices]); with data: pyro.sample(..., obs=...)`."
                ) from error


def explain_mixed_tensors(trace, tensors: Iterator[tuple[str, Tensor]], error: Exception) -> None:
    """Raise a ModelError when torch refused to mix float dtypes or devices and a latent's differs from the data's.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> with pyro.poutine.trace() as tracer:
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
        >>> error = RuntimeError("expected m1 and m2 to have the same dtype, but got: float != double")
        >>> explain_mixed_tensors(tracer.trace, iter([("argument 'x'", torch.zeros(3, 2))]), error)
        Traceback (most recent call last):
        ...
        pyro_scalable.bridge.checks.ModelError: latent site 'w' is torch.float64 but argument 'x' is torch.float32, ...

    """
    message = str(error)
    if "device" in message:
        attribute, fix = (
            "device",
            (
                "Make the prior's tensors on the data's device, e.g. dist.Normal(torch.zeros(d, device=x.device), "
                "1.0), or call torch.set_default_device before building the model (a PyroModule makes its "
                "PyroSample priors when it is built)."
            ),
        )
    elif "dtype" in message or "Double" in message:
        attribute, fix = (
            "dtype",
            (
                "Give the prior's parameters the data's dtype, e.g. dist.Normal(torch.zeros(d, dtype=x.dtype), "
                "1.0), or convert the data."
            ),
        )
    else:
        return
    data = {label: getattr(t, attribute) for label, t in tensors if t.is_floating_point()}
    for name, node in trace.nodes.items():
        if node["type"] != "sample" or node["is_observed"] or site_is_subsample(node):
            continue
        value = node["value"]
        mine = getattr(value, attribute)
        other = next(((label, theirs) for label, theirs in data.items() if theirs != mine), None)
        if value.is_floating_point() and other is not None:
            raise ModelError(
                f"latent site '{name}' is {mine} but {other[0]} is {other[1]}, and the model failed mixing them "
                f"({first_line(error)}). {fix}"
            ) from error


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def same_support(first, second) -> bool:
    """Whether two traces' supports of one site are the same constraint (bounds equal, e.g. not a latent's value)."""
    if type(first) is not type(second):
        return False
    a, b = _bounds(first), _bounds(second)
    return len(a) == len(b) and all(x.shape == y.shape and bool((x == y).all()) for x, y in zip(a, b))


def _bounds(support) -> list[Tensor]:
    while hasattr(support, "base_constraint"):
        support = support.base_constraint
    return [torch.as_tensor(getattr(support, a)) for a in ("lower_bound", "upper_bound") if hasattr(support, a)]


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function point at the user's code.

    The first frame outside the package: a warning raised deep inside a run (a phase of the driver, the chain
    stepper) names the user's ``mcmc.run(...)`` line, however many of our frames lie between.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level
