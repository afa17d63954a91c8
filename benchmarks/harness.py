"""What every benchmark measures the same way: machine load, peak memory, step timing, the report stamp.

The harness imports it as ``benchmarks.harness``, a study as ``import harness`` (``benchmarks/`` on ``sys.path``).
Linux only for the ``/proc`` readings; elsewhere they return ``None`` (load) or fail loudly (memory).

- **Load**: :class:`ForeignLoad` is the CPU other processes used (and the hypervisor stole) while something was
  measured, in cores; a measurement is *clean* below :data:`CLEAN_LIMIT`.
- **Memory**: :func:`rss_mb`, :func:`peak_mb` (``VmHWM``), :func:`reset_peak` (through ``/proc/self/clear_refs``),
  :func:`release_free_memory` (so that the next peak counts its own pages); differences below
  :data:`RESOLUTION_MB` are not resolved.
- **Timing**: :class:`Timed` times a block and records its warnings instead of showing them;
  :func:`time_per_step` times ``(T(long) - T(short)) / (long - short)`` so that setup cancels, interleaving runners
  and recording the load of each repetition (:class:`StepTiming`); :func:`median_ratio` compares two runners over
  the repetitions clean for both.
- **Report**: :func:`machine` (code, CPU, versions), :func:`load_average`, :func:`write_report`, :func:`log`.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "CLEAN_LIMIT",
    "RESOLUTION_MB",
    "ForeignLoad",
    "StepTiming",
    "Timed",
    "clean_note",
    "is_clean",
    "load_average",
    "log",
    "machine",
    "median_ratio",
    "peak_mb",
    "release_free_memory",
    "reset_peak",
    "rss_mb",
    "time_per_step",
    "warm_up_torch",
    "write_report",
]

CLEAN_LIMIT = 0.3  # cores used by other processes during a measurement, at or above which it is not "clean"
RESOLUTION_MB = 16.0  # peak-RSS differences below this are not resolved (memory the process already holds)
ROOT = Path(__file__).resolve().parent.parent


def log(*parts: object) -> None:
    """Print progress to stderr (stdout carries only the report)."""
    print(*parts, file=sys.stderr, flush=True)


# ====================================================================================== load
class ForeignLoad:
    """CPU used by other processes (and stolen by the hypervisor) since construction, in cores (Linux only).

    Args:
        children: also leave out the CPU of this process's finished children (a benchmark that launches workers).
    """

    def __init__(self, children: bool = False) -> None:
        self._children = children
        self._start = self._read()

    def _read(self) -> tuple[float, int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system, irq softirq steal
        mine = int(own[11]) + int(own[12])  # this process: utime + stime
        if self._children:
            mine += int(own[13]) + int(own[14])  # cutime + cstime of waited-for children
        return time.perf_counter(), busy, mine

    def cores(self) -> float | None:
        """Average cores used by others since construction, or ``None`` where ``/proc`` cannot be read."""
        end = self._read()
        if end is None or self._start is None or end[0] <= self._start[0]:
            return None
        ticks = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(0.0, ticks / os.sysconf("SC_CLK_TCK") / (end[0] - self._start[0]))


def is_clean(foreign: float | None) -> bool:
    """Whether a measurement ran while others used less than ``CLEAN_LIMIT`` cores (unknown load counts as clean)."""
    return foreign is None or foreign < CLEAN_LIMIT


# ====================================================================================== memory
def rss_mb() -> float:
    """This process's resident memory now, in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """This process's peak resident memory (``VmHWM``) since start or the last :func:`reset_peak`, in MB."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS; ``False`` where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Give glibc's cached free memory back to the system, so that the next call's peak RSS counts its own pages."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ====================================================================================== timing
class Timed:
    """``with Timed() as timed:`` times its block (``timed.seconds``) and records its warnings (``timed.caught``)
    instead of showing them: each engine's figures judge its draws, its warnings are no part of a cell's output."""

    def __enter__(self) -> Timed:
        self._catcher = warnings.catch_warnings(record=True)
        self.caught = self._catcher.__enter__()
        warnings.simplefilter("always")
        self._start = time.perf_counter()
        return self

    def __exit__(self, *error) -> None:
        self.seconds = time.perf_counter() - self._start
        self._catcher.__exit__(*error)


@dataclass
class StepTiming:
    """One runner's repetitions from :func:`time_per_step`."""

    per_step: list[float] = field(default_factory=list)  # seconds, one per repetition
    setup: list[float] = field(default_factory=list)  # seconds, what the short run spent outside its steps
    foreign: list[float | None] = field(default_factory=list)  # cores used by other processes during the repetition

    def clean(self) -> list[int]:
        """Indices of the clean repetitions, or of all of them if fewer than two are clean."""
        good = [i for i, f in enumerate(self.foreign) if is_clean(f)]
        return good if len(good) >= 2 else list(range(len(self.foreign)))

    @property
    def median(self) -> float:
        return statistics.median(self.per_step[i] for i in self.clean())

    @property
    def median_setup(self) -> float:
        return statistics.median(self.setup[i] for i in self.clean())


def time_per_step(
    runners: dict[str, tuple[Callable[[int, int], tuple[float, float]], int, int]], reps: int
) -> dict[str, StepTiming]:
    """``(T(long) - T(short)) / (long - short)`` per runner ``(fn, short, long)``, ``reps`` times, interleaved.

    Args:
        runners: ``fn(num_steps, seed)`` returns ``(seconds, final log posterior)``.
    """
    results = {name: StepTiming() for name in runners}
    names = list(runners)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            run, short, long = runners[name]
            probe = ForeignLoad()
            t_short, _ = run(short, rep)
            t_long, _ = run(long, rep)
            foreign = probe.cores()
            per_step = (t_long - t_short) / (long - short)
            results[name].per_step.append(per_step)
            results[name].setup.append(t_short - short * per_step)
            results[name].foreign.append(foreign)
            load = "n/a" if foreign is None else f"{foreign:.2f}"
            log(
                f"    rep {rep}: {name:<28} {per_step * 1e3:9.3f} ms/step  (setup {t_short - short * per_step:6.3f} s; "
                f"other processes {load} cores)"
            )
    return results


def median_ratio(a: StepTiming, b: StepTiming) -> float:
    """Median over the repetitions clean for both of ``a``'s time / ``b``'s time (all, if fewer than two)."""
    both = sorted(set(a.clean()) & set(b.clean()))
    both = both if len(both) >= 2 else list(range(len(a.per_step)))
    return statistics.median(a.per_step[i] / b.per_step[i] for i in both)


def clean_note(timings: dict[str, StepTiming]) -> str:
    """``"clean/all"`` repetitions over all runners, for a table cell."""
    total = sum(len(t.per_step) for t in timings.values())
    good = sum(1 for t in timings.values() for f in t.foreign if is_clean(f))
    return f"{good}/{total} clean"


def warm_up_torch() -> None:
    """The first ``torch.func`` gradient in a process imports ``torch._dynamo`` (seconds); pay it before timing."""
    torch.func.grad_and_value(lambda v: v.square().sum())(torch.ones(3))
    torch.func.vmap(torch.func.grad(lambda v: v.square().sum()))(torch.ones(2, 3))


# ====================================================================================== report
def load_average() -> str:
    """The 1, 5 and 15 minute load averages, for a report line."""
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


START_LOAD = load_average()  # when the benchmark's process imported this module: its start


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def git(*args: str) -> str:
    """``git <args>``'s output in the repository ("" outside a checkout)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _code_version() -> str:
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    dirty = git("status", "--porcelain", "pyro_scalable")
    return f"git {commit}" + (" with uncommitted changes in pyro_scalable/" if dirty else "")


def machine(threads: int, peers: str = "") -> list[str]:
    """The report's stamp: code version and time, CPU and load, versions (``peers`` appended, e.g. posteriors)."""
    import pyro

    versions = f"python {platform.python_version()}, torch {torch.__version__}, pyro-ppl {pyro.__version__}"
    return [
        f"- code: {_code_version()}; {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"- machine: {cpu_name()}, {os.cpu_count()} CPU cores, torch threads {threads}; load average at start "
        f"{START_LOAD}, at this report {load_average()}",
        f"- {versions}" + (f", {peers}" if peers else ""),
    ]


def write_report(text: str, out: Path) -> None:
    """Print the report to stdout and write it to ``out``."""
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"written to {out}")
