r"""Posterior predictive draws of a Pyro model: the model on full data, conditioned on each posterior draw.

For draws :math:`\theta_s` of the latents, one draw :math:`y_s \sim p(y \mid \theta_s, x)` per posterior draw is
a draw of the posterior predictive
:math:`p(y \mid x, D) = \int p(y \mid \theta, x)\, p(\theta \mid D)\,d\theta`.
This is what ``pyro.infer.Predictive(FullDataModel(model), posterior_samples=samples)(*args)`` computes, with
three differences: observed sites are always sampled (``poutine.uncondition``: passing ``y`` gives a draw of ``y``,
never ``y`` itself), every site comes back as ``(S, *site shape)`` (no singleton plate dims), and the draws are
vectorised in chunks of draws (one ``pyro.plate`` over them) where the model allows, one by one where it does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import pyro
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import Tensor

from pyro_scalable.arguments import fork_rng
from pyro_scalable.bridge.checks import ModelError, named_tensors
from pyro_scalable.bridge.plates import FullDataModel
from pyro_scalable.memory import check_memory

__all__ = ["predictive_draws"]

_DRAWS_PLATE = "_num_predictive_samples"
# elements of the returned sites per chunk of draws (float64: 128 MiB)
_CHUNK_ELEMENTS = 2**24


def _device(samples: Mapping[str, Tensor], args: tuple, kwargs: Mapping[str, Any]) -> torch.device | None:
    for _, tensor in named_tensors(lambda *a, **k: None, args, kwargs):
        return tensor.device
    return next((v.device for v in samples.values()), None)


def predictive_draws(
    model: Callable,
    samples: Mapping[str, Tensor],
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    return_sites: list[str] | tuple[str, ...] | None = None,
    seed: int | None = None,
    draws_per_chunk: int | None = None,
) -> dict[str, Tensor]:
    """One draw of every returned site per posterior draw, each ``(S, *site shape)``, the model on full data.

    Args:
        samples: constrained draws ``{site: (S, *site shape)}`` (any latent left out is drawn from its prior).
        return_sites: default: every sample site not in ``samples`` (the observed sites, as ``Predictive``).
        draws_per_chunk: posterior draws per vectorised run (default: as many as keep a chunk near 2**24 elements).

    """
    kwargs = dict(kwargs or {})
    if not samples:
        raise ValueError("samples is empty: give constrained posterior draws {site: (S, *site shape)}.")
    sizes = {name: value.shape[0] if value.dim() else None for name, value in samples.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"every site in samples needs the same number of draws on its first dim, got {sizes}.")
    num_draws = next(iter(sizes.values()))
    full = poutine.uncondition(FullDataModel(model))
    device = _device(samples, args, kwargs)
    with fork_rng(seed), torch.no_grad():
        # draws come back from the engines on the CPU; the model runs where its inputs are
        probe = _probe(model, full, {k: v[0].to(device) for k, v in samples.items()}, args, kwargs)
        sites = _return_sites(probe, samples, return_sites)
        shapes = {name: probe.nodes[name]["value"].shape for name in sites}
        _check_memory(probe, sites, num_draws, device)
        outputs = {
            name: torch.empty((num_draws, *shapes[name]), dtype=probe.nodes[name]["value"].dtype, device=device)
            for name in sites
        }
        per_draw = max(1, sum(math.prod(shape) for shape in shapes.values()))
        step = draws_per_chunk or max(1, _CHUNK_ELEMENTS // per_draw)
        vectorized = True
        for start in range(0, num_draws, step):
            chunk = {k: v[start : start + step].to(device) for k, v in samples.items()}
            values = _vectorized(full, chunk, probe, sites, args, kwargs) if vectorized else None
            if values is None:
                vectorized = False
                values = _sequential(full, chunk, sites, args, kwargs)
            for name in sites:
                outputs[name][start : start + step].copy_(values[name])
    return outputs


def _check_memory(probe, sites: list[str], num_draws: int, device: torch.device | None) -> None:
    """Refuse draws that would not fit in the memory of ``device`` (one per posterior draw of every site)."""
    values = [probe.nodes[name]["value"] for name in sites]
    check_memory(
        num_draws * sum(v.numel() * v.element_size() for v in values),
        device or "cpu",
        f"{num_draws} predictive draws of {', '.join(sites)} ({sum(v.numel() for v in values):,} values each)",
        lambda factor: [
            f"fewer posterior draws: get_samples(num_samples={max(1, num_draws // factor)}), or thin={factor} in "
            "to_inference_data",
            f"fewer points: predict at a subset of the inputs (1/{factor} of them fits)",
        ],
    )


def _probe(model: Callable, full: Callable, draw: Mapping[str, Tensor], args: tuple, kwargs: Mapping[str, Any]):
    """The model's trace at one draw, or a ModelError that says which plate does not fit the inputs."""
    tracer = poutine.trace(poutine.condition(full, dict(draw)))
    try:
        return tracer.get_trace(*args, **kwargs)
    except (RuntimeError, ValueError, IndexError) as error:
        if isinstance(error, ModelError):
            raise
        _explain_plate_size(model, tracer.msngr.trace, args, kwargs, error)
        raise


def _explain_plate_size(model: Callable, trace, args: tuple, kwargs: Mapping[str, Any], error: Exception) -> None:
    model = model.model if isinstance(model, FullDataModel) else model
    rows = {label: t.shape[0] for label, t in named_tensors(model, args, kwargs) if t.dim()}
    for name, node in trace.nodes.items():
        if not site_is_subsample(node):
            continue
        size = node["fn"].size
        other = {label: n for label, n in rows.items() if n != size}
        if not other:
            continue
        label, n = next(iter(other.items()))
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelError(
            f"the model failed ({first}) on inputs whose {label} has {n} rows, while its plate '{name}' has size "
            f"{size}. For predictions at new inputs the plate must cover them: write it as "
            f"pyro.plate('{name}', len(x), ...) rather than a fixed size, or, for a plate written with "
            f"subsample=idx (DataLoader style), pass the new points' indices, e.g. idx=torch.arange({n})."
        ) from error


def _return_sites(trace, samples: Mapping[str, Tensor], return_sites) -> list[str]:
    nodes = {
        name: node for name, node in trace.nodes.items() if node["type"] == "sample" and not site_is_subsample(node)
    }
    if return_sites is None:
        return [name for name in nodes if name not in samples]
    if isinstance(return_sites, str) or not all(isinstance(s, str) for s in return_sites):
        raise TypeError(f"return_sites must be a list of site names or None, got {return_sites!r}.")
    unknown = [name for name in return_sites if name not in nodes]
    if unknown:
        raise ValueError(f"return_sites {unknown} are not sample sites of the model; it has {sorted(nodes)}.")
    return list(return_sites)


def _nesting(trace) -> int:
    dims = [
        frame.dim
        for node in trace.nodes.values()
        if node["type"] == "sample"
        for frame in node["cond_indep_stack"]
        if frame.vectorized and frame.name != _DRAWS_PLATE
    ]
    return -min(dims) if dims else 0


def _vectorized(
    full: Callable, chunk: Mapping[str, Tensor], probe, sites: list[str], args: tuple, kwargs: Mapping[str, Any]
) -> dict[str, Tensor] | None:
    """All draws of ``chunk`` in one run under a plate over the draws; ``None`` where the model does not batch."""
    count = next(iter(chunk.values())).shape[0]
    nesting = _nesting(probe)
    conditioned = {}
    for name, value in chunk.items():
        node = probe.nodes.get(name)
        if node is None or node["type"] != "sample":
            return None
        batch_dims = value.dim() - 1 - node["fn"].event_dim
        if batch_dims > nesting:
            return None
        conditioned[name] = value.reshape((count,) + (1,) * (nesting - batch_dims) + value.shape[1:])
    plate = pyro.plate(_DRAWS_PLATE, count, dim=-nesting - 1)
    try:
        trace = poutine.trace(poutine.condition(plate(full), conditioned)).get_trace(*args, **kwargs)
    except Exception:  # noqa: BLE001  (a model that does not broadcast over a leading dim: run draw by draw)
        return None
    values = {}
    for name in sites:
        node = trace.nodes.get(name)
        shape = probe.nodes[name]["value"].shape
        if node is None or node["value"].numel() != count * math.prod(shape):
            return None
        value = node["value"]
        if len(shape) and value.shape[-len(shape) :] != shape:
            return None
        values[name] = value.reshape((count, *shape))
    if not _agrees(full, chunk, trace, sites, args, kwargs):
        return None
    return values


def _agrees(
    full: Callable, chunk: Mapping[str, Tensor], trace, sites: list[str], args: tuple, kwargs: Mapping[str, Any]
) -> bool:
    """Whether the vectorised run's law at the first draw is the law of the model run on that draw alone."""
    first = poutine.trace(poutine.condition(full, {k: v[0] for k, v in chunk.items()})).get_trace(*args, **kwargs)
    for name in sites:
        alone, batched = first.nodes[name], trace.nodes[name]
        count = next(iter(chunk.values())).shape[0]
        value = batched["value"].reshape((count, *alone["value"].shape))[0]
        try:
            expected = alone["fn"].log_prob(value)
            got = batched["fn"].log_prob(batched["value"])
        except (RuntimeError, ValueError, NotImplementedError):
            return False
        got = got.reshape(count, -1)[0] if got.numel() % count == 0 and got.dim() else None
        if got is None or got.numel() != expected.numel():
            return False
        if not torch.allclose(got, expected.reshape(-1), rtol=1e-4, atol=1e-5, equal_nan=True):
            return False
    return True


def _sequential(
    full: Callable, chunk: Mapping[str, Tensor], sites: list[str], args: tuple, kwargs: Mapping[str, Any]
) -> dict[str, Tensor]:
    count = next(iter(chunk.values())).shape[0]
    values: dict[str, list[Tensor]] = {name: [] for name in sites}
    for index in range(count):
        draw = {k: v[index] for k, v in chunk.items()}
        trace = poutine.trace(poutine.condition(full, draw)).get_trace(*args, **kwargs)
        for name in sites:
            values[name].append(trace.nodes[name]["value"])
    return {name: torch.stack(value) for name, value in values.items()}
