"""A real SIGKILL in the middle of a checkpoint write, for the checkpoint tests' child processes.

The child calls :func:`arm` before its run; the test (the parent) starts the child with :func:`run_until_killed`
and then resumes the run itself. Only ``os.fsync`` and ``os.replace`` are wrapped (the calls every atomic write
makes), never the library's own functions, so the write under test is the one the library really does.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

MOMENTS = ("mid-data", "before-rename", "after-rename")
ROOT = Path(__file__).parents[2]  # the repository, so that a child imports this checkout's pyro_scalable


def arm(nth: int, moment: str) -> None:
    """SIGKILL this process during its ``nth`` checkpoint write, at ``moment`` (one of :data:`MOMENTS`).

    ``"mid-data"``: half of the temporary file is on disk; ``"before-rename"``: all of it, not yet renamed;
    ``"after-rename"``: the new checkpoint is in place, the folder not yet synced.
    """
    if moment not in MOMENTS:
        raise ValueError(f"moment must be one of {MOMENTS}, got {moment!r}.")
    fsync, replace = os.fsync, os.replace
    writes = []

    def killing_fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # the temporary file (the folder is synced after the rename)
            writes.append(None)
            if len(writes) == nth and moment != "after-rename":
                if moment == "mid-data":
                    os.ftruncate(fd, os.fstat(fd).st_size // 2)
                os.kill(os.getpid(), signal.SIGKILL)
        fsync(fd)

    def killing_replace(source, target) -> None:
        replace(source, target)
        if len(writes) == nth and moment == "after-rename":
            os.kill(os.getpid(), signal.SIGKILL)

    os.fsync, os.replace = killing_fsync, killing_replace


def run_until_killed(script: Path, *args: str, timeout: float = 120) -> None:
    """Run ``python script *args`` and check that it died of SIGKILL (and not of an error)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.run(
        [sys.executable, str(script), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        timeout=timeout,
    )
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()
