"""One JSON object per cell, appended to ``benchmarks/results/<suite>/cells.jsonl``; the latest of each cell wins.

A record holds the cell (``suite``, ``problem``, ``n``, ``engine``), ``status`` (``ok``, ``skipped`` or ``failed``,
with a ``reason``), the engine's ``metrics``, ``peak_mb``, ``seed`` and ``budget``, and the stamp: ``commit``
(with ``dirty`` when ``pyro_scalable/`` had uncommitted changes), ``machine`` (CPU, cores, device, threads,
versions), ``load`` (the 1/5/15-minute load averages at the start and the end of the cell), ``foreign_cores``
(the CPU other processes used during the cell), ``date`` and ``provenance`` ("measured", or "transcribed from
<file> at <commit>" for a figure carried over from an older results file).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from benchmarks.harness import cpu_name, git

__all__ = ["RESULTS", "append", "latest", "load", "path", "read", "stamp", "write"]

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent


def path(suite: str) -> Path:
    return RESULTS / suite / "cells.jsonl"


def stamp(threads: int, device: str) -> dict:
    """The fields every measured record of this run shares."""
    import pyro
    import torch

    return {
        "commit": git("rev-parse", "--short", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain", "pyro_scalable")),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "device": device,
            "threads": threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pyro": pyro.__version__,
        },
        "provenance": "measured",
    }


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write(target: Path, record: dict) -> None:
    """Append ``record`` to the JSON-lines file ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read(target: Path) -> list[dict]:
    """Every record of the JSON-lines file ``target`` (none if it is absent)."""
    if not target.is_file():
        return []
    return [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines() if line.strip()]


def append(suite: str, record: dict) -> None:
    write(path(suite), record)


def load(suite: str) -> list[dict]:
    return read(path(suite))


def _key(record: dict) -> tuple:
    return record["problem"], record["n"], record["engine"], record.get("machine", {}).get("device", "cpu")


def latest(suite: str) -> list[dict]:
    """The last record of each cell (problem, n, engine, device), in the order the cells first appear."""
    found: dict[tuple, dict] = {}
    for record in load(suite):
        found[_key(record)] = record
    return list(found.values())
