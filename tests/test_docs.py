"""The documentation: the site builds with ``mkdocs build --strict``, and the code the pages show runs.

The strict build fails on a broken link or anchor, a nav entry with no page, a docstring whose Args do not match
its signature and an API reference to a name that does not exist, so this test is what keeps docs/ and the
docstrings honest. It needs the ``docs`` extra (``scripts/test.sh`` installs it); without it, it is skipped.
"""

from __future__ import annotations

import importlib.util
import json
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
    # docs/benchmarks.md and benchmarks/README.md both want benchmarks/index.html: each keeps a page of its own
    results = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "Benchmark results" in results, "the benchmark results page was overwritten"
    assert "Install the peers" in (site / "benchmarks" / "readme" / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_every_tutorial_is_a_page(site, path):
    page = site / "tutorials" / path.stem / "index.html"
    assert page.is_file(), f"{path.name} was not rendered (mkdocs.yml: mkdocs-jupyter, docs/_hooks/repo_files.py)"
    html = page.read_text(encoding="utf-8")
    assert "data:image/png;base64," in html, f"the page of {path.name} shows no figure"
    # the highlighted code wraps each token in a span: ">assert<" is the keyword, not the word in a sentence
    for plumbing in ("PYRO_SCALABLE_FAST", "PYRO_SCALABLE_IMAGES", ">assert<", ">FAST<", ">IMAGES<"):
        assert plumbing not in html, f"the page of {path.name} shows test plumbing: {plumbing!r}"


def test_mathjax_is_served_with_the_site(site):
    """Formulas render offline: MathJax 3 and its fonts are files of the site, and no page loads a CDN's copy."""
    mathjax = site / "javascripts" / "mathjax"
    assert (mathjax / "tex-mml-chtml.js").is_file() and any((mathjax / "output/chtml/fonts/woff-v2").glob("*.woff"))
    for page in (
        site / "index.html",
        site / "api/laplace/index.html",
        site / "tutorials/laplace_bnn_regression/index.html",
    ):
        html = page.read_text(encoding="utf-8")
        assert "javascripts/mathjax/tex-mml-chtml.js" in html, page
        assert not re.search(r'src="https?://[^"]*mathjax', html, flags=re.I), f"{page} loads MathJax from the web"


# What a page loads (not what it links to): <link href>, <script src>, <img src>, <source src/srcset>, <iframe src>.
_LOADS = re.compile(
    r"<(?:link|script|img|source|iframe|embed|video|audio)\b[^>]*?\b(?:src|href|srcset)\s*=\s*[\"']([^\"']+)[\"']",
    flags=re.I,
)
# A url() in an inline style or <style> block (a web font's @font-face, an @import).
_CSS_URL = re.compile(r"(?:url\(\s*[\"']?|@import\s+[\"'])((?:https?:)?//[^\"')\s]+)", flags=re.I)


def _external(url: str) -> bool:
    return bool(re.match(r"(?:[a-z][a-z0-9+.-]*:)?//", url.strip(), flags=re.I)) and not url.startswith("data:")


def test_no_page_loads_anything_from_another_host(site):
    """The site works offline: no built page loads a font, script, style sheet or image from an external host.

    mkdocs-material's default ``theme.font`` requests Google Fonts on every page (mkdocs.yml sets ``font: false``);
    a CDN's MathJax or a badge image would be the same fault. Plain ``<a href>`` links to other sites are fine.
    """
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20, "the site looks empty"
    found = []
    for page in pages:
        html = page.read_text(encoding="utf-8")
        urls = [m.group(1) for m in _LOADS.finditer(html)] + [m.group(1) for m in _CSS_URL.finditer(html)]
        found += [f"{page.relative_to(site)}: {url}" for url in urls if _external(url)]
    for css in site.rglob("*.css"):
        text = css.read_text(encoding="utf-8", errors="replace")
        found += [f"{css.relative_to(site)}: {m.group(1)}" for m in _CSS_URL.finditer(text)]
    assert not found, "pages load from other hosts (the site must work offline):\n" + "\n".join(found[:20])
    # the known offender by name, wherever it appears (a <link rel=preconnect> counts too)
    index = (site / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis.com" not in index and "fonts.gstatic.com" not in index


# A guide a user reads: every page at the top of docs/ but the benchmark results, which are rendered tables.
GUIDE_WORDS = 4000
GUIDES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")


@pytest.mark.parametrize("path", GUIDES, ids=[p.stem for p in GUIDES])
def test_guide_is_short(path):
    """A guide is at most 4,000 words: whitespace-separated tokens of the whole Markdown file, code blocks, formulas
    and tables included (what ``wc -w`` counts, as tests/test_readme.py counts the README). It leads with how to use
    the engine and what to expect; measurements go to docs/benchmarks.md, and the guide links to them."""
    words = len(path.read_text(encoding="utf-8").split())
    assert words <= GUIDE_WORDS, (
        f"docs/{path.name} has {words} words; at most {GUIDE_WORDS} (`wc -w`): move measurements to "
        "docs/benchmarks.md and link them, and keep the maths in the module docstrings"
    )


def _render_module():
    return _load(ROOT / "scripts" / "render_tutorials.py", "_render_tutorials")


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_rendered_tutorial_is_current(path):
    """docs/tutorials/<name>.ipynb, the page the site shows, was executed from this version of the script."""
    render = _render_module()
    command = f"python scripts/render_tutorials.py tutorials/{path.name}"
    target = render.rendered_path(path)
    assert target.is_file(), f"{target.relative_to(ROOT)} is missing: run `{command}`"
    assert render.is_current(path), (
        f"tutorials/{path.name} changed since docs/tutorials/{target.name} was rendered from it: run `{command}` "
        "(several minutes; `--fast` for the quick mode, which the page then states)"
    )
    notebook = json.loads(target.read_text(encoding="utf-8"))
    outputs = [o for c in notebook["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"], f"{target.name} holds an error output"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{target.name} holds no figure"


# README links resolve from the checkout: tests/test_readme.py.


def _snippet(spec: str) -> str:
    """The text pymdownx.snippets includes for ``file:section`` (or a whole file)."""
    path, _, section = spec.partition(":")
    text = (ROOT / path).read_text(encoding="utf-8")
    if not section:
        return text
    start, end = f"# --8<-- [start:{section}]", f"# --8<-- [end:{section}]"
    assert start in text and end in text, f"{path} has no snippet section {section!r}"
    return text.split(start, 1)[1].split(end, 1)[0]


def _python_blocks(page: Path) -> list[str]:
    """The page's python code blocks as a reader sees them, snippet includes resolved."""
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    include = re.compile(r'^--8<-- "([^"]+)"$', flags=re.M)
    return [include.sub(lambda m: _snippet(m.group(1)), block) for block in blocks]


def _undefined_names(code: str, known: set[str]) -> tuple[list[str], set[str]]:
    """Names ``code`` reads at module level or in its functions that neither it, ``known`` nor builtins define."""
    import ast
    import builtins

    tree = ast.parse(code)
    defined = set(known) | set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
            args = node.args if not isinstance(node, ast.ClassDef) else None
            if args is not None:
                defined.update(a.arg for a in args.args + args.kwonlyargs + args.posonlyargs)
                defined.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    used = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    return sorted({name for name in used if name not in defined}), defined


def test_getting_started_blocks_define_what_they_use():
    """Copied top to bottom, the python blocks of getting_started.md run: each name is defined by an earlier line."""
    blocks = _python_blocks(ROOT / "docs" / "getting_started.md")
    assert len(blocks) >= 4
    known: set[str] = set()
    for number, block in enumerate(blocks, 1):
        undefined, known = _undefined_names(block, known)
        assert not undefined, f"python block {number} of getting_started.md uses {undefined}, defined nowhere before"


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


def test_architecture_map_names_every_module():
    """docs/developer/architecture.md names every module of the package (its file name, or its stem as a word)."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "developer" / "architecture.md").read_text()
    missing = [
        path.relative_to(root / "pyro_scalable").as_posix()
        for path in sorted((root / "pyro_scalable").rglob("*.py"))
        if path.name != "__init__.py" and path.name not in text and not re.search(rf"\b{path.stem}\b", text)
    ]
    assert not missing, f"modules missing from docs/developer/architecture.md: {missing}"
