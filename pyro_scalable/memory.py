"""Memory checked before a large allocation: a clear refusal that names the figures, never a dead process.

A result's largest arrays have one value per draw and data point (chains × draws × N): the full-data
log-likelihood ``az.loo`` reads, the posterior predictive draws, the prior predictive ones. At N = 10⁶ and
4 × 1,000 draws one float64 array is 32 GB. Such an allocation is checked first against the memory available where
it will live, and refused above :data:`MEMORY_FRACTION` of it with a :class:`MemoryLimitError` that says what it
would need and what works instead. Nothing already computed is lost: the check runs before the allocation.

The memory available is read portably: on the CPU, ``MemAvailable`` of ``/proc/meminfo`` (Linux), lowered to what
the process's cgroup limit leaves where one is set (a container, a batch scheduler's job), or ``psutil`` where it is
installed (other systems); on a CUDA device, ``torch.cuda.mem_get_info`` plus what torch's caching allocator holds
unused. Where it cannot be read, nothing is refused.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = [
    "MEMORY_FRACTION",
    "MemoryLimitError",
    "MemoryLimitWarning",
    "available_memory",
    "check_memory",
    "format_bytes",
]

#: The largest share of the memory available that one checked allocation may take (the rest is the process's work,
#: copies such as ArviZ's, and other processes). Set ``pyro_scalable.memory.MEMORY_FRACTION = 1.0`` to allow all of
#: it, or ``float("inf")`` to switch the check off.
MEMORY_FRACTION = 0.5

_UNLIMITED = 2**60  # a cgroup limit this large (v1's "no limit" is 2^63 rounded to a page) sets none


class MemoryLimitError(MemoryError):
    """An allocation refused before it was made: more than ``MEMORY_FRACTION`` of the memory available."""


class MemoryLimitWarning(UserWarning):
    """An allocation that fits, but whose next use (``az.loo`` on a ``log_likelihood`` group) would not."""


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in decimal units, e.g. ``"32.0 GB"``."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{int(num_bytes)} bytes"


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes that an allocation on ``device`` can take now, or ``None`` where that cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    available = _meminfo_available()
    if available is None and importlib.util.find_spec("psutil") is not None:
        import psutil

        available = int(psutil.virtual_memory().available)
    limit = _cgroup_available()
    if available is None or limit is None:
        return available if limit is None else limit
    return min(available, limit)


def check_memory(
    num_bytes: int,
    device: torch.device | str,
    what: str,
    remedies: Sequence[str] | Callable[[int], Sequence[str]] = (),
    *,
    fraction: float | None = None,
) -> None:
    """Raise :class:`MemoryLimitError` if ``num_bytes`` on ``device`` exceed ``fraction`` of the memory available.

    Example:
        >>> check_memory(8 * 10**6, "cpu", "a million float64 values")  # 8 MB: passes on any machine
        >>> check_memory(8 * 10**6, "cpu", "a million float64 values", fraction=1e-9)
        Traceback (most recent call last):
        ...
        pyro_scalable.memory.MemoryLimitError: a million float64 values would need 8.0 MB, more than 1e-07% of ...

    Args:
        what: the allocation, as the message's subject ("the log_likelihood group (4 chains × ...)").
        remedies: what works instead, one clause each; or a function of the factor by which the allocation must
            shrink to fit (2 or more) that returns them.
        fraction: default :data:`MEMORY_FRACTION`, read when called.

    """
    fraction = MEMORY_FRACTION if fraction is None else fraction
    available = available_memory(device)
    if available is None or num_bytes <= fraction * available:
        return
    if callable(remedies):
        remedies = remedies(max(2, math.ceil(num_bytes / max(fraction * available, 1))))
    where = "" if torch.device(device).type == "cpu" else f" on {device}"
    ways = "".join(f"\n  - {remedy}" for remedy in remedies)
    raise MemoryLimitError(
        f"{what} would need {format_bytes(num_bytes)}, more than {100 * fraction:g}% of the "
        f"{format_bytes(available)} of memory available{where} (the share pyro_scalable.memory.MEMORY_FRACTION "
        f"sets); refused before allocating, so nothing computed is lost.{' What works instead:' if ways else ''}{ways}"
    )


def _meminfo_available() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_available() -> int | None:
    """What this process's cgroup limit leaves (limit less the non-reclaimable usage), or ``None`` without one."""
    for folder, limit_file, usage_file in (
        (Path("/sys/fs/cgroup"), "memory.max", "memory.current"),  # v2
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"),  # v1
    ):
        try:
            limit = (folder / limit_file).read_text().strip()
            usage = int((folder / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= _UNLIMITED:
            return None
        # the page cache counts in the usage, but the kernel drops its inactive part before refusing memory
        try:
            stats = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
            usage -= int(stats.get("inactive_file", stats.get("total_inactive_file", 0)))
        except (OSError, ValueError):
            pass
        return max(int(limit) - usage, 0)
    return None
