"""The package as pip sees it: one version, the licence, and a clear message where an optional extra is missing."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

import pyro_scalable

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parent.parent


def test_one_version_source():
    """pyproject.toml reads the version from pyro_scalable.__version__; the installed metadata agrees."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pyro_scalable.__version__"}
    assert importlib.metadata.version("pyro-scalable") == pyro_scalable.__version__


def test_license_file_is_apache_2():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


@pytest.fixture
def without_sklearn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)


def test_demo_names_its_extra(without_sklearn):
    from pyro_scalable import demo

    with pytest.raises(SystemExit) as exit_info:
        demo.main([])
    message = str(exit_info.value)
    assert "scikit-learn" in message and 'pip install "pyro-scalable[demo]"' in message
    assert "bash scripts/demo.sh" in message


def test_demo_data_names_its_extra(without_sklearn):
    from pyro_scalable import demo

    with pytest.raises(ModuleNotFoundError, match=r"scikit-learn.*pyro-scalable\[demo\]"):
        demo.load_data()


def test_missing_modules_are_listed_together(monkeypatch):
    from pyro_scalable._optional import missing, missing_extra_message

    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    absent = missing(["sklearn", "matplotlib"])
    assert absent == ["sklearn", "matplotlib"]
    assert missing_extra_message(absent, "x").startswith("x needs scikit-learn, matplotlib, which are not installed")
