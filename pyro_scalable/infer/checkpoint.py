"""Checkpoint files: written atomically, read back safely, refused when written by a different configuration.

The engines' own checkpoints (:mod:`pyro_scalable.infer.sgmcmc.checkpoint` for ``StochasticMCMC``,
:mod:`pyro_scalable.infer.sample_then_optimize.checkpoint`) decide what goes into a file; this module writes and
reads it. Writes are atomic: ``torch.save`` to ``<path>.tmp`` in the same folder, ``fsync``, ``os.replace`` onto
``<path>`` and ``fsync`` of the folder, so a crash during a write leaves the previous checkpoint as it was. A file
holds only tensors and plain containers, and loads with ``torch.load(weights_only=True)``. A fingerprint (one
string per setting, :func:`describe` and :func:`stable_repr` make them) names the configuration a checkpoint
belongs to; :func:`check_fingerprint` refuses another's, naming every setting that differs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["FORMAT", "CheckpointError", "check_fingerprint", "describe", "load", "save", "stable_repr"]

FORMAT = 1  # bumped when the layout of a checkpoint changes; a checkpoint of another format is refused


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: written by a different configuration, or unreadable."""


def save(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically: the old file stays whole until the new one is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    # makes the rename itself durable (POSIX); folders cannot be opened this way on Windows
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def load(path: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (tensors on the CPU), or ``None`` where there is none."""
    if not os.path.exists(path):
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"cannot read the checkpoint {os.fspath(path)!r} ({error}). Delete it, or pass resume=False, to start over."
        ) from error


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
    """Raise :class:`CheckpointError` naming every field where the checkpoint's configuration differs."""
    differences = [
        f"{name} is {saved.get(name, '<missing>')} there and {current.get(name, '<missing>')} here"
        for name in sorted(set(saved) | set(current))
        if saved.get(name) != current.get(name)
    ]
    if differences:
        raise CheckpointError(
            f"the checkpoint {os.fspath(path)!r} was written by a different run: {'; '.join(differences)}. "
            "Run with the same settings to resume from it, or pass resume=False (or delete the file) to start over."
        )
