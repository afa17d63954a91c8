r"""Control of Pyro's subsampling plates from outside the model.

A Pyro model declares its data as ``pyro.plate("data", N, subsample_size=B)``; the plate then draws B of the N
indices and scales every log-density inside it by N/B, so the model alone gives an unbiased minibatch estimate
of the full-data log joint. The engines need three things the plate cannot give on its own:

* minibatch indices drawn by the engine (one set per chain, on the data's device, from the engine's generator,
  which also works under ``torch.func.vmap``);
* the full index range (full-data mode: log-likelihood, observed data, predictions), where N/B becomes 1;
* chunks of the full range, so that full-data quantities never need all N points in memory at once.

Pyro checks ``len(subsample) == subsample_size`` inside ``SubsampleMessenger._subsample``, so a handler that
rewrites the plate's subsample message can only ever supply B indices. This module therefore replaces that one
static method, and only while one of its contexts (:func:`plate_indices`, :func:`full_data`) is open: there a plate
takes its indices from the innermost context, and a plate Pyro subsamples itself has its size checked with an
error that names it. When the outermost context closes, Pyro's own method is back: code that runs outside our
engines' calls — Pyro's ``Predictive`` or ``SVI`` on the same model, say — runs Pyro exactly as if the package
were not imported (``tests/bridge/test_plates.py`` compares the two in fresh processes). This is the only place in
the package that patches Pyro.

A plate Pyro subsamples itself inside these contexts (the bridge's checking traces) draws its B indices as Pyro's
``torch.randperm(N)[:B]`` does, without the permutation of all N: the CPU ``randperm`` is a Fisher-Yates shuffle whose
step :math:`i` swaps position :math:`i` with :math:`i + (u_i \bmod (N - i))` for the generator's next 32-bit number
:math:`u_i`, and positions before :math:`i` never change again, so the first B steps alone give the first B indices.
``torch.randint(0, N - i)`` draws exactly :math:`u_i \bmod (N - i)`, and N - 1 - B further 32-bit draws leave the global
generator where ``randperm`` leaves it: the indices and the random state after them are Pyro's bit for bit
(``tests/bridge/test_plate_draws.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from pyro.poutine.subsample_messenger import SubsampleMessenger, _Subsample
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError

__all__ = ["FullDataModel", "full_data", "plate_indices"]

_PYRO_SUBSAMPLE = SubsampleMessenger.__dict__["_subsample"]  # Pyro's own static method, put back as it was
_pyro_subsample = SubsampleMessenger._subsample
_PYRO_SAMPLE = _Subsample.sample
_PERMUTATION_LIMIT = 2**32 // 20  # torch's CPU randperm draws 32-bit numbers below this size (64-bit above)
# Each entry: (explicit indices by plate name, whether every other subsampled plate runs on full data, the size N
# of every plate seen while the entry is active).
_OVERRIDES: list[tuple[dict[str, Tensor], bool, dict[str, int]]] = []


def _controlled_subsample(
    name: str,
    size: int | None = None,
    subsample_size: int | None = None,
    subsample: Tensor | None = None,
    use_cuda: bool | None = None,
    device: str | None = None,
):
    if _OVERRIDES and size == 0:
        raise ModelError(
            f"plate '{name}' has size 0: there is no data point to condition on. Pass at least one data point, "
            "or leave the plate and its sites out of the model when there is no data."
        )
    if _OVERRIDES and size is not None:
        indices, full, sizes = _OVERRIDES[-1]
        sizes[name] = size
        if name in indices:
            chosen = indices[name]
            return size, chosen.shape[0], chosen
        if full and subsample is None and subsample_size is not None:
            return size, size, torch.arange(size, device=device)
    if _OVERRIDES:  # Pyro draws the subsample itself: its errors name neither the plate nor the fix
        _check_plate(name, size, subsample_size, subsample)
    return _pyro_subsample(name, size, subsample_size, subsample, use_cuda, device)


def _check_plate(name: str, size: int | None, subsample_size: int | None, subsample: Tensor | None) -> None:
    if subsample_size == 0 or (subsample is not None and len(subsample) == 0):
        raise ModelError(
            f"plate '{name}' has an empty subsample: there is no data point to condition on. Use a "
            "subsample_size of at least 1, or pass at least one data point."
        )
    if subsample is None and size is not None and subsample_size is not None and subsample_size > size:
        raise ModelError(
            f"plate '{name}' has subsample_size {subsample_size}, more than its size {size}; "
            f"use subsample_size <= {size} (or leave it out to use all the data)."
        )


def _first_of_permutation(self: _Subsample, sample_shape: tuple = ()) -> Tensor:
    """Pyro's ``_Subsample.sample``: ``randperm(N)[:B]`` on the CPU without the permutation (module docstring)."""
    size, chosen = self.size, self.subsample_size
    cheap = not sample_shape and not self.use_cuda and chosen is not None and 0 < chosen * 64 <= size
    if not cheap or size >= _PERMUTATION_LIMIT or torch.device(self.device).type != "cpu":
        return _PYRO_SAMPLE(self, sample_shape)
    moved: dict[int, int] = {}  # the positions the shuffle's first steps swapped: position -> value now there
    out = []
    for i in range(chosen):
        j = i + int(torch.randint(0, size - i, ()))
        out.append(moved.get(j, j))
        moved[j] = moved.get(i, i)
    for start in range(chosen, size - 1, 2**24):  # the rest of the shuffle's draws, in chunks of 16 MB
        torch.randint(0, 2, (min(2**24, size - 1 - start),), dtype=torch.uint8)
    return torch.tensor(out, dtype=torch.long)


@contextlib.contextmanager
def plate_indices(indices: Mapping[str, Tensor], *, full_data: bool = False) -> Iterator[dict[str, int]]:
    """Make the named plates use ``indices`` (and, with ``full_data``, every other subsampled plate all of N).

    Pyro's subsampling is ours only inside the outermost such context (module docstring). Yields a dict that
    receives the size N of every subsampling plate the model enters meanwhile.
    """
    outer_indices, outer_full, _ = _OVERRIDES[-1] if _OVERRIDES else ({}, False, {})
    sizes: dict[str, int] = {}
    if not _OVERRIDES:  # the outermost context installs the override, and takes it out again
        SubsampleMessenger._subsample = staticmethod(_controlled_subsample)
        _Subsample.sample = _first_of_permutation
    _OVERRIDES.append(({**outer_indices, **indices}, full_data or outer_full, sizes))
    try:
        yield sizes
    finally:
        _OVERRIDES.pop()
        if not _OVERRIDES:
            SubsampleMessenger._subsample = _PYRO_SUBSAMPLE
            _Subsample.sample = _PYRO_SAMPLE


def full_data() -> contextlib.AbstractContextManager[dict[str, int]]:
    """Switch subsampling off: every ``subsample_size`` plate runs on all of its indices (scale 1)."""
    return plate_indices({}, full_data=True)


class FullDataModel:
    """The user's model with every ``subsample_size`` plate switched to full data (scale 1).

    This is what ``pyro.infer.Predictive`` and ``arviz.from_pyro`` should run: the model on all N points, not on
    a random minibatch of them. The model as written is ``full_data_model.model``.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def model(y):
        ...     with pyro.plate("data", len(y), subsample_size=10) as idx:
        ...         pyro.sample("obs", dist.Normal(0.0, 1.0), obs=y[idx])
        >>> trace = pyro.poutine.trace(FullDataModel(model)).get_trace(torch.zeros(100))
        >>> trace.nodes["obs"]["value"].shape
        torch.Size([100])

    """

    def __init__(self, model: Callable):
        self.model = model.model if isinstance(model, FullDataModel) else model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with full_data():
            return self.model(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FullDataModel({getattr(self.model, '__name__', self.model)!r})"
