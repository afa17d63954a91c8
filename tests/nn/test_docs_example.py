"""docs/nn.md shows docs/snippets/nn_first.py: it runs (with fewer steps), as printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_guides_example_runs():
    env = {**os.environ, "NN_EXAMPLE_STEPS": "50", "PYTHONWARNINGS": "ignore"}
    path = ROOT / "docs" / "snippets" / "nn_first.py"
    result = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 random parameters (130 scalars), 4 fixed" in result.stdout
