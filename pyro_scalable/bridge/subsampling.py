r"""A model that never subsamples its data, handed to a minibatch engine: named once, with the plate to write.

The engines take their minibatches from the model's own ``pyro.plate("data", N, subsample_size=B)`` (the plate
draws the indices and scales the likelihood by :math:`N/B`). A model whose data plate has no ``subsample_size``,
or which has no plate at all, still runs: every step then evaluates all N rows, a full-data pass per step, and
the point of a minibatch engine is lost without a word. :func:`data_rows` finds the rows such a model's likelihood
runs on at every step (the size of the plate around an observed site or, without a plate, the observed value's
leading dimension) in the trace the bridge checks the model with; the bridge keeps them as ``data_rows``.
:func:`warn_full_batch` is what each minibatch engine calls: from :data:`FULL_BATCH_ROWS` rows it warns once per
run, with the plate to write and a minibatch size to start from (:attr:`~.records.DataRows.subsample_size`),
unless the engine was told ``full_batch=True``. A model with a subsampled plate, or whose plate takes a
``DataLoader``'s indices (``subsample=idx``), subsamples; the engines that cannot run without one (SWAG, the EKF)
name the same plate in their error (:func:`~.checks.one_subsampled_plate`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

from pyro.poutine.util import site_is_subsample

from pyro_scalable.bridge.checks import named_tensors, user_stacklevel
from pyro_scalable.bridge.records import DataRows

__all__ = ["FULL_BATCH_ROWS", "data_rows", "warn_full_batch"]

#: from this many rows a likelihood evaluated in full at every step is named (a full-data pass per step)
FULL_BATCH_ROWS = 10_000
_ARGUMENT = re.compile(r"argument '(\w+)'")  # a top-level argument's label (checks.named_tensors)


def data_rows(trace: Any, subsampled: Mapping[str, int]) -> DataRows | None:
    """The most rows an observed site of ``trace`` runs on, where no plate subsamples (``None`` where one does).

    ``subsampled``: the model's subsampled plates (the engines' and a ``DataLoader``'s), by name.
    """
    if subsampled:
        return None
    found = None
    for name, node in trace.nodes.items():
        if node["type"] != "sample" or not node["is_observed"] or site_is_subsample(node):
            continue
        if node["infer"].get("_deterministic"):
            continue
        frames = [f for f in node["cond_indep_stack"] if f.size is not None and f.vectorized]
        value = node["value"]
        if frames:
            frame = max(frames, key=lambda f: f.size)
            candidate = DataRows(frame.size, name, frame.name)
        elif hasattr(value, "dim") and value.dim() >= 1:
            candidate = DataRows(value.shape[0], name, None)
        else:
            continue
        if found is None or candidate.rows > found.rows:
            found = candidate
    return found


def warn_full_batch(bridge: Any, engine: str, *, full_batch: bool = False) -> None:
    """Warn once that ``engine`` evaluates all of N >= 10⁴ rows at every step, with the plate that subsamples them.

    ``bridge``: the ``ModelBridge`` the engine steps on; ``full_batch``: the engine's argument, ``True`` where a
    full-batch run is meant (then nothing is said).

    Example:
        >>> import pyro, pyro.distributions as dist, torch, warnings
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_full_batch(ModelBridge(model, (torch.zeros(20_000),)), "StochasticMCMC")
        >>> print(str(caught[0].message).split("To subsample, ")[1].split(", indexing")[0])
        give the plate a subsample_size: `with pyro.plate('data', 20000, subsample_size=200) as idx:`

    """
    found = getattr(bridge, "data_rows", None)
    if full_batch or found is None or found.rows < FULL_BATCH_ROWS:
        return
    rows = found.rows
    names = [
        match.group(1)
        for label, tensor in named_tensors(bridge.model, bridge.args, bridge.kwargs)
        if tensor.dim() and len(tensor) == rows and (match := _ARGUMENT.fullmatch(label))
    ]
    data = ", ".join(f"{name}[idx]" for name in names[:3]) or "x[idx]"
    if found.plate is not None:
        where = f"sits in plate '{found.plate}' of {rows} rows with no subsample_size, so every step evaluates all"
        fix = "give the plate a subsample_size"
    else:
        where = f"has {rows} rows and no plate, so every step evaluates all of them"
        fix = "put the site in a subsampled plate"
    warnings.warn(
        f"{engine}: observed site '{found.site}' {where} (a full-data pass per step, no minibatch). To subsample, "
        f"{fix}: `{found.plate_line()}`, indexing the data with idx ({data}); or pass full_batch=True to {engine} "
        "if a full-batch run is meant.",
        stacklevel=user_stacklevel(),
    )
