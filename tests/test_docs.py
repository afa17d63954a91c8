"""The documentation: the site builds with ``mkdocs build --strict``, and the code the pages show runs.

The strict build fails on a broken link or anchor, a nav entry with no page, a docstring whose Args do not match
its signature and an API reference to a name that does not exist, so this test is what keeps docs/ and the
docstrings honest. It needs the ``docs`` extra (``scripts/test.sh`` installs it); without it, it is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("*.py"))


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # cwd=ROOT: mkdocs.yml names the snippets and the griffe extension relative to the repository root.
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    result = subprocess.run(
        [*command, "--site-dir", str(site_dir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    return site_dir


def test_site_builds_strict(site):
    for page in ("index.html", "getting_started/index.html", "api/infer/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "infer" / "index.html").read_text(encoding="utf-8")
    assert "StochasticMCMC" in api and "PolynomialDecay" in api
    assert ":math:" not in api, "a reST math role reached the HTML (docs/_hooks/rst_math.py)"


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_every_tutorial_is_a_page(site, path):
    page = site / "tutorials" / path.stem / "index.html"
    assert page.is_file(), f"{path.name} was not rendered (mkdocs.yml: mkdocs-jupyter, docs/_hooks/repo_files.py)"


def test_readme_links_resolve():
    """README.md is not part of the site, so its relative links are checked here."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [m for m in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", text) if "://" not in m]
    assert links, "no relative links found in README.md"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_rst_roles_become_markdown():
    pytest.importorskip("griffe", reason="the docs extra is not installed: pip install -e '.[docs]'")
    rst = _load(ROOT / "docs" / "_hooks" / "rst_math.py", "_docs_rst_math")
    text = (
        "Rate :math:`\\epsilon T`, see :func:`~pyro_scalable.infer.sgld.step`."
        "\n\n.. math::\n\n    a &= b \\\\\n    c &= d\n\nAfter."
    )
    out = rst.rst_to_markdown(text)
    assert "$\\epsilon T$" in out and "`step`" in out
    assert "$$\n\\begin{aligned}\na &= b \\\\\nc &= d\n\\end{aligned}\n$$" in out
    assert out.rstrip().endswith("After.")
    assert rst.rst_to_markdown("    Example:\n        >>> 1") == "    Examples:\n        >>> 1"


@pytest.mark.arviz
def test_first_model_runs():
    """docs/getting_started.md shows docs/snippets/first_model.py; its own assertions check the posterior."""
    pytest.importorskip("arviz")
    env = {**os.environ, "FIRST_MODEL_STEPS": "500", "MPLBACKEND": "Agg"}
    path = ROOT / "docs" / "snippets" / "first_model.py"
    result = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# ---------------------------------------------------------------- the copy-me engine skeleton of the developer page


@pytest.fixture(scope="module")
def skeleton():
    return _load(ROOT / "docs" / "snippets" / "engine_skeleton.py", "_docs_engine_skeleton")


CONFORMANCE = [
    "test_state_is_tensors_only",
    "test_step_contract_and_info",
    "test_vmap_over_chains_equals_loop_at_zero_temperature",
    "test_vmapped_noise_is_independent_across_chains",
    "test_shell_exposes_hyperparameters_and_validates",
    "test_divergent_step_is_rejected_and_flagged",
]


@pytest.mark.parametrize("name", CONFORMANCE)
def test_skeleton_passes_the_conformance_suite(skeleton, name):
    """The skeleton honours the contract every engine's tests/infer/sgmcmc/test_conformance.py checks."""
    from tests.infer.sgmcmc import test_conformance as conformance

    getattr(conformance, name)(skeleton, skeleton.Skeleton, {"step_size": 0.05})


def test_skeleton_schedules_pass_the_conformance_suite(skeleton):
    from pyro_scalable.infer import Cyclical, PolynomialDecay
    from tests.infer.sgmcmc import test_conformance as conformance

    for schedule in (PolynomialDecay(a=0.05, b=1.0, gamma=0.55), Cyclical(initial=0.05, cycle_length=3)):
        conformance.test_schedules_are_used_and_reported(skeleton, skeleton.Skeleton, {"step_size": 0.05}, schedule)


def test_skeleton_step_is_sglds(skeleton):
    """The skeleton's update is SGLD's: seeded steps agree exactly, so a change to the contract shows up here."""
    import torch

    from pyro_scalable.infer import sgld
    from tests.infer.sgmcmc.test_conformance import start, target

    ours, theirs = skeleton.init(start()), sgld.init(start())
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for _ in range(3):
        ours, info = skeleton.step(ours, None, target, step_size=0.05, temperature=0.7, generator=g1)
        theirs, reference = sgld.step(theirs, None, target, step_size=0.05, temperature=0.7, generator=g2)
        for name in ours.latents:
            torch.testing.assert_close(ours.latents[name], theirs.latents[name], rtol=0, atol=0)
        assert type(info) is type(reference)


def test_skeleton_runs_under_the_driver(skeleton):
    """The Examples section of the skeleton's class runs, and the run converts to ArviZ."""
    import doctest

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    (test,) = [t for t in finder.find(skeleton.Skeleton, "Skeleton", globs=vars(skeleton)) if t.examples]
    runner.run(test, clear_globs=False)
    assert runner.failures == 0 and runner.tries > 0
    mcmc = test.globs["mcmc"]
    stats = mcmc.sample_stats
    assert {"lp", "grad_norm", "step_size", "temperature", "diverging"} <= set(stats)
    assert mcmc.to_inference_data(log_likelihood=False).posterior["mu"].shape == (2, 100)
