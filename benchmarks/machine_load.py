"""How much CPU other processes took while a benchmark measured (shared by the benchmark scripts)."""

from __future__ import annotations

import os
import time


class ForeignLoad:
    """CPU used by other processes (and stolen by the hypervisor) since construction, in cores (Linux only)."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system, irq softirq steal
        return time.perf_counter(), busy, int(own[11]) + int(own[12])  # this process: utime + stime

    def cores(self) -> float | None:
        end = self._read()
        if end is None or self._start is None or end[0] <= self._start[0]:
            return None
        ticks = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(0.0, ticks / os.sysconf("SC_CLK_TCK") / (end[0] - self._start[0]))
