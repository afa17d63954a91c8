"""Checkpoint files: written atomically, checksummed, read back safely, refused when written by another run.

The engines' own checkpoints (:mod:`pyro_scalable.infer.sgmcmc.checkpoint` for ``StochasticMCMC``,
:mod:`pyro_scalable.infer.sample_then_optimize.checkpoint`) decide what goes into a file; this module writes and
reads it. A file is one header line — ``pyro_scalable checkpoint <FORMAT> sha256=<hex> size=<bytes>`` — then the
payload as ``torch.save`` writes it. Writes are atomic: the file goes to ``<path>.tmp`` in the same folder, created
exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``: a file or symlink planted under that name is never followed or
overwritten), ``fsync``, ``os.replace`` onto ``<path>`` and ``fsync`` of the folder, so a crash or a SIGKILL at any
moment leaves either the previous checkpoint or the new one, whole; a ``.tmp`` left by a killed write is removed
when the next run starts (:func:`remove_partial_write`). A failed write (disk full, read-only, permission denied) is
a :class:`CheckpointWriteError` naming the path and saying that the previous checkpoint is intact; :func:`check_path`
finds an unusable path before a run's first step, and :class:`CheckpointLock` (an ``flock`` on ``<path>.lock``)
keeps a second process from writing the same checkpoint. :func:`load` checks the header, the length and the SHA-256
of the payload before it unpickles anything, and unpickles only tensors and plain containers
(``torch.load(weights_only=True)``): a truncated, damaged or foreign file, one of an older format or of another
engine is a :class:`CheckpointError` that says what is wrong and what to do, never a bare ``KeyError``.

Which run a checkpoint belongs to is :mod:`pyro_scalable.infer.fingerprint`'s.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import io
import os
import re
import signal
import threading
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: checkpoints are not locked there
    fcntl = None

from pyro_scalable.bridge.checks import first_line

__all__ = [
    "FORMAT",
    "CheckpointError",
    "CheckpointLock",
    "CheckpointWriteError",
    "check_path",
    "load",
    "remove_partial_write",
    "save",
    "terminate_as_interrupt",
]

FORMAT = 2  # the file's layout (2: a header with the payload's length and SHA-256); another format is refused
_HEADER = re.compile(rb"pyro_scalable checkpoint (\d+) sha256=([0-9a-f]{64}) size=(\d+)")
_START_OVER = "Delete it or pass another checkpoint path (or resume=False) to start over."


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: written by a different run, of another kind, or unreadable."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (its path named; the previous checkpoint, if any, left intact)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


def save(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically: the old file stays whole until the new one is complete.

    Raises:
        CheckpointWriteError: the write failed (disk full, read-only, permission denied, ...); ``path`` then holds
            the previous checkpoint, whole, or nothing.

    """
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getbuffer()
    header = f"pyro_scalable checkpoint {FORMAT} sha256={hashlib.sha256(data).hexdigest()} size={len(data)}\n"
    temporary = _temporary(path)
    created = opening = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        opening = True
        handle = os.open(temporary, _CREATE, 0o666)  # exclusively: a planted file or symlink is refused, not followed
        created = True
        with open(handle, "wb") as file:
            file.write(header.encode())
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        if created:
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            planted = opening and not created and isinstance(error, FileExistsError)
            raise _write_error(path, error, planted=planted) from error
        raise
    _fsync_folder(path.parent)


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _write_error(path: Path, error: OSError, *, planted: bool = False) -> CheckpointWriteError:
    """The error of a failed write: what failed, that the previous checkpoint is intact, what to do."""
    where = repr(os.fspath(path))
    if planted:
        reason = f"{str(_temporary(path))!r} appeared while it was being written (another program made it)"
    elif any(parent.is_file() for parent in path.parents):
        reason = f"{str(next(p for p in path.parents if p.is_file()))!r} is a file, not a folder"
    else:
        reason = os.strerror(error.errno) if error.errno else str(error)
        reason = f"{reason} ({error})" if str(error) and str(error) != reason else reason
    previous = (
        "the previous checkpoint there is intact"
        if os.path.isfile(path)
        else "there was no earlier checkpoint there, and none was half-written"
    )
    message = (
        f"cannot write the checkpoint {where}: {reason}; {previous}. Free some space or make its folder writable "
        "and run again to resume, or pass another checkpoint path."
    )
    result = CheckpointWriteError(message)
    result.errno, result.filename = error.errno, os.fspath(path)
    return result


def check_path(path: str | os.PathLike) -> None:
    """Check, before a run's first step, that a checkpoint can be written at ``path`` (its folder made if missing).

    Raises:
        CheckpointWriteError: ``path`` is a folder, its folder cannot be made (a parent is a file) or written to.

    """
    path = Path(path)
    where = repr(os.fspath(path))
    if path.is_dir():
        example = repr(os.fspath(path / "run.pt"))
        raise CheckpointWriteError(f"the checkpoint path {where} is a folder: pass a file name, such as {example}.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = os.open(path.parent / f".{path.name}.{os.getpid()}.probe", _CREATE, 0o666)
        os.close(probe)
        os.unlink(path.parent / f".{path.name}.{os.getpid()}.probe")
    except OSError as error:
        raise _write_error(path, error) from error


class CheckpointLock:
    """An exclusive lock on writing the checkpoint at ``path``: an ``flock`` on ``<path>.lock``, held until released.

    A second process (or a second run in this one) asking for the same path gets a :class:`CheckpointError` naming
    it. The lock file is removed on release; a process that dies releases the lock with it (the kernel drops the
    ``flock``), and the file it leaves is taken over by the next run. A lock never released is dropped with its
    object: a run in this process that ended with an error and is no longer referenced does not keep the next one
    out (the garbage collector is asked before refusing).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(os.fspath(path) + ".lock")
        self._handle: int | None = None
        if fcntl is None:  # no flock (Windows): no lock
            return
        while True:
            try:
                handle = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except OSError as error:
                raise _write_error(Path(path), error) from error
            try:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if self.path not in _HELD.values():
                        raise
                    gc.collect()  # held in this process: by a run that ended with an error and awaits collection?
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = os.read(handle, 64).decode(errors="replace").strip() or "another process"
                os.close(handle)
                if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise _write_error(Path(path), error) from error
                raise CheckpointError(
                    f"the checkpoint {os.fspath(path)!r} is being written by another run ({holder}, which holds "
                    f"{str(self.path)!r}). Wait for it to finish, or pass another checkpoint path."
                ) from None
            if _same_file(handle, self.path):  # not a lock file a releasing run removed meanwhile
                break
            os.close(handle)
        os.ftruncate(handle, 0)
        os.write(handle, f"process {os.getpid()}".encode())
        self._handle = handle
        self._finalizer = weakref.finalize(self, os.close, handle)  # a lock never released is dropped with the object
        _HELD[self] = self.path

    def release(self) -> None:
        """Give the lock up and remove the lock file (a no-op the second time)."""
        if self._handle is None:
            return
        _HELD.pop(self, None)
        self.path.unlink(missing_ok=True)  # before unlocking: a run waiting for this file then takes a new one
        self._finalizer()
        self._handle = None


_HELD: weakref.WeakKeyDictionary[CheckpointLock, Path] = weakref.WeakKeyDictionary()  # this process's locks


def _same_file(handle: int, path: Path) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(handle)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


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


@contextlib.contextmanager
def terminate_as_interrupt(active: bool) -> Iterator[None]:
    """While ``active``, SIGTERM (a scheduler's stop) is Ctrl-C: the driver writes the checkpoint, keeps the draws."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
