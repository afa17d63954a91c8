"""Checkpoint files: written atomically, checksummed, read back safely, refused when written by another run.

The engines' own checkpoints (:mod:`pyro_scalable.infer.sgmcmc.checkpoint` for ``StochasticMCMC``,
:mod:`pyro_scalable.infer.sample_then_optimize.checkpoint`) decide what goes into a file; this module writes and
reads it. A file is one header line — ``pyro_scalable checkpoint <FORMAT> sha256=<hex> size=<bytes>`` — then the
payload as ``torch.save`` writes it. Writes are atomic: the file goes to ``<path>.tmp`` in the same folder,
``fsync``, ``os.replace`` onto ``<path>`` and ``fsync`` of the folder, so a crash or a SIGKILL at any moment leaves
either the previous checkpoint or the new one, whole; a ``.tmp`` left by a killed write is removed when the next
run starts (:func:`remove_partial_write`). :func:`load` checks the header, the length and the SHA-256 of the
payload before it unpickles anything, and unpickles only tensors and plain containers
(``torch.load(weights_only=True)``): a truncated, damaged or foreign file, one of an older format or of another
engine is a :class:`CheckpointError` that says what is wrong and what to do, never a bare ``KeyError``.

A fingerprint (one string per setting: :func:`describe`, :func:`stable_repr`, and
:func:`pyro_scalable.infer.digest.digest` for the model's code and the data's values) names the run a checkpoint
belongs to; :func:`check_fingerprint` refuses another's, naming every setting that differs.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import first_line

__all__ = [
    "FORMAT",
    "CheckpointError",
    "check_fingerprint",
    "describe",
    "load",
    "remove_partial_write",
    "save",
    "stable_repr",
]

FORMAT = 2  # the file's layout (2: a header with the payload's length and SHA-256); another format is refused
_HEADER = re.compile(rb"pyro_scalable checkpoint (\d+) sha256=([0-9a-f]{64}) size=(\d+)")
_START_OVER = "Delete it or pass another checkpoint path (or resume=False) to start over."
_LABELS = {"model_code": "the model's code", "data_values": "the data's values"}
_WHAT = {"model_code": " (its code, closure, defaults, globals, or a module's parameters and buffers)"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: written by a different run, of another kind, or unreadable."""


def save(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically: the old file stays whole until the new one is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getbuffer()
    header = f"pyro_scalable checkpoint {FORMAT} sha256={hashlib.sha256(data).hexdigest()} size={len(data)}\n"
    temporary = _temporary(path)
    try:
        with open(temporary, "wb") as file:
            file.write(header.encode())
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def remove_partial_write(path: str | os.PathLike) -> None:
    """Remove the ``<path>.tmp`` that a write killed before its rename left behind (never a whole checkpoint)."""
    _temporary(Path(path)).unlink(missing_ok=True)


def _temporary(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


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


def load(
    path: str | os.PathLike, *, kind: str | None = None, version: int | None = None, keys: Iterable[str] = ()
) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (tensors on the CPU), or ``None`` where there is none.

    Args:
        kind: the engine that must have written it (its payload's ``"kind"``), if any.
        version: the engine's payload format (its ``"format"``) it must have, if any.
        keys: the entries the payload must hold.

    Raises:
        CheckpointError: the file is unreadable, truncated, damaged, not a checkpoint of this format, of another
            kind or format, or lacks one of ``keys``.

    """
    if not os.path.exists(path):
        return None
    where = repr(os.fspath(path))

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"the checkpoint {where} {what}. {_START_OVER}")

    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise refuse(f"cannot be read ({error})") from error
    line, newline, body = data[:256].partition(b"\n")
    header = _HEADER.fullmatch(line) if newline else None
    if header is None:
        raise refuse(_foreign(data))
    if int(header[1]) != FORMAT:
        raise refuse(f"has file format {int(header[1])}; this version of pyro_scalable reads format {FORMAT}")
    body = memoryview(data)[len(line) + 1 :]
    if len(body) != int(header[3]):
        raise refuse(f"is truncated or padded: it holds {len(body)} of the {int(header[3])} bytes it was written with")
    if hashlib.sha256(body).hexdigest() != header[2].decode():
        raise refuse("is damaged: its contents do not match the checksum it was written with")
    try:
        saved = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as error:
        raise refuse(f"cannot be read ({first_line(error)})") from error
    if not isinstance(saved, dict):
        raise refuse(f"holds a {type(saved).__name__}, not a checkpoint")
    if kind is not None and saved.get("kind") != kind:
        raise refuse(f"was written by {saved.get('kind', 'an unknown engine')}, not by {kind}")
    if version is not None and saved.get("format") != version:
        raise refuse(
            f"was written in {kind or 'its engine'}'s checkpoint format {saved.get('format')} (an older or newer "
            f"pyro_scalable); this version reads format {version}"
        )
    missing = [key for key in keys if key not in saved]
    if missing:
        raise refuse(f"lacks {', '.join(map(repr, missing))}")
    return saved


def _foreign(data: bytes) -> str:
    """What a file without a checkpoint header is, as far as can be told."""
    try:
        content = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:
        return "is not a pyro_scalable checkpoint (no checkpoint header, and not a file torch.load reads)"
    if isinstance(content, dict) and {"format", "fingerprint"} <= set(content):
        return (
            f"was written by an older pyro_scalable (checkpoint format {content['format']}, without a checksum); "
            f"this version writes file format {FORMAT}"
        )
    return f"is not a pyro_scalable checkpoint (a torch file holding a {type(content).__name__})"


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

    A field whose values are digests (``"sha256:..."``) is named as changed, without the digests.
    """
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
