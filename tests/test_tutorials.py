"""Every tutorial runs, in its fast mode, and its own assertions hold (a silently wrong tutorial fails here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.arviz  # run against both ArviZ majors by scripts/test.sh

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("*.py"))


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path, tmp_path):
    env = {**os.environ, "PYRO_SCALABLE_FAST": "1", "PYRO_SCALABLE_IMAGES": str(tmp_path), "MPLBACKEND": "Agg"}
    result = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert any(tmp_path.glob("*.png")), "the tutorial saved no figure"
