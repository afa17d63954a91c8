"""A run's fingerprint: what a checkpoint's run was, and the refusal that names every setting where it differs.

A fingerprint is one string per setting of a run: data by dtype and shape (:func:`describe`), settings by their
``repr`` without memory addresses (:func:`stable_repr`), and :func:`pyro_scalable.infer.digest.digest` of the model's
code and the data's values. :func:`check_fingerprint` resumes a checkpoint only for the same run, and refuses one
whose run has a component that cannot be identified (:data:`UNIDENTIFIED`): equal strings would not show that the
two runs compute the same.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from pyro_scalable.infer.checkpoint import CheckpointError

__all__ = ["UNIDENTIFIED", "check_fingerprint", "describe", "stable_repr"]

UNIDENTIFIED = "unidentified"  # the fingerprint's field naming what could not be identified (refused on resume)

_LABELS = {
    "model_code": "the model's code",
    "data_values": "the data's values",
    "kernel_values": "the kernel's settings (a schedule's code, closure or globals, a tensor's values, ...)",
}

_WHAT = {"model_code": " (its code, closure, defaults, globals, or a module's parameters and buffers)"}


def describe(value: Any) -> str:
    """A one-line description of data for a fingerprint: tensors by dtype and shape, containers recursively."""
    if isinstance(value, Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def stable_repr(value: Any) -> str:
    """``repr`` without memory addresses (a lambda's ``at 0x7f...`` changes from one process to the next)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` naming every field where the checkpoint's run differs from this one.

    A field whose values are digests (``"sha256:..."``) is named as changed, without the digests. A fingerprint with
    an :data:`UNIDENTIFIED` field (a component with no content to read: :func:`~pyro_scalable.infer.digest.identify`)
    on either side is refused, naming it: equal fingerprints would not show that the two runs compute the same.
    """
    unknown = current.get(UNIDENTIFIED) or saved.get(UNIDENTIFIED)
    if unknown:
        where = repr(os.fspath(path))
        raise CheckpointError(
            f"the checkpoint {where} cannot be matched to this run: {unknown} cannot be identified (it has no "
            "content to compare), so resuming could mix two different runs. Give it as a value that can be compared "
            f"(a number, a tensor, a function, an object with attributes), or delete {where} or pass resume=False to "
            "start over."
        )
    differences = []
    for name in sorted(set(saved) | set(current)):
        before, now = saved.get(name, "<missing>"), current.get(name, "<missing>")
        if before == now:
            continue
        if str(before).startswith("sha256:") and str(now).startswith("sha256:"):
            differences.append(
                f"{_LABELS.get(name, name)} changed since the checkpoint was written{_WHAT.get(name, '')}"
            )
        else:
            differences.append(f"{name} is {before} there and {now} here")
    if differences:
        where = repr(os.fspath(path))
        raise CheckpointError(
            f"the checkpoint {where} was written by a different run: {'; '.join(differences)}. Delete {where} or "
            "pass a new checkpoint path (or resume=False) to start over; run with the same settings to resume it."
        )
