"""The README's claims that are cheap to check, and its first example as printed (slow tier).

What the README says and where it is tested: its links and commands here; the first example's engine calls by
docs/snippets/first_model.py (tests/test_docs.py); the converter by tests/test_to_inference_data.py; `Predictive`
on a subsampled model by tests/bridge/test_plates.py. The comparison page's rows name their own tests.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_WORDS = 1200
TUTORIALS = ROOT / "tutorials"
# The documentation site and the repository's home are not published: a link to them would lead nowhere.
PLACEHOLDER = re.compile(r"pyro[-_]scalable\.(github\.io|readthedocs)|github\.com/pyro[-_]scalable", flags=re.I)


def _text(path: Path = README) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(language: str, text: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"<(https?://[^>\s]+)>", text)


def test_readme_is_short():
    words = len(_text().split())  # what `wc -w README.md` counts
    assert words <= MAX_WORDS, f"README.md has {words} words; at most {MAX_WORDS} (move detail to docs/)"


def test_readme_links_resolve_in_the_repository():
    """Every relative link names a file of this checkout; no link points at the unpublished site."""
    links = _links(_text())
    assert links, "no links found in README.md"
    missing = [link for link in links if "://" not in link and not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to files this checkout does not have: {missing}"
    placeholders = [link for link in links if PLACEHOLDER.search(link)]
    assert not placeholders, f"README.md links to a site that is not published: {placeholders}"


@pytest.mark.parametrize(
    "page", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")) + ["tutorials/README.md"]
)
def test_docs_do_not_link_to_the_unpublished_site(page):
    placeholders = [link for link in _links(_text(ROOT / page)) if PLACEHOLDER.search(link)]
    assert not placeholders, f"{page} links to a site that is not published: {placeholders}"


def _github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file: its headings' slugs (lower case, punctuation dropped, spaces as
    hyphens, a repeat numbered) and its ``<a name>``/``<a id>`` tags. Not the site's ``{#id}`` attributes, which
    GitHub prints as text."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)
    anchors, seen = set(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", text)), {}
    for heading in re.findall(r"^#{1,6} +(.+?)(?: +#+)? *$", text, flags=re.M):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"<[^>]+>", "", heading)).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_anchors_work_where_github_renders_the_markdown():
    """Every link to a heading of a Markdown page (the README, docs/, the tutorials' and benchmarks' READMEs) names
    an anchor GitHub makes too; mkdocs build --strict checks the site's (tests/test_docs.py)."""
    pages = sorted((ROOT / "docs").rglob("*.md")) + [README, TUTORIALS / "README.md", ROOT / "benchmarks" / "README.md"]
    broken = []
    for page in pages:
        for link in _links(_text(page)):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if "://" in link or not anchor or target.suffix != ".md" or not target.is_file():
                continue
            if anchor not in _github_anchors(_text(target)):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, f"links to anchors GitHub does not make (use <a name=...> in the heading): {broken}"


def test_readme_test_command_is_the_one_ci_runs():
    """The README's test command is the one .ci/run calls, and both set-up scripts exist."""
    ci = _text(ROOT / ".ci" / "run")
    ci_commands = [line.split()[:2] for line in ci.splitlines() if line.startswith("bash ")]
    assert ["bash", "scripts/test.sh"] in ci_commands, ci
    commands = [line.split("#")[0].strip() for block in _blocks("bash", _text()) for line in block.splitlines()]
    assert "bash scripts/test.sh" in commands and "bash scripts/demo.sh" in commands, commands
    for script in ("scripts/test.sh", "scripts/demo.sh"):
        assert (ROOT / script).is_file(), script


def test_readme_installs_from_the_checkout():
    """The package is not on an index: the README installs it from the checkout, and the torch pin it names is the
    one the set-up scripts use."""
    text = _text()
    commands = [line.split("#")[0].strip() for block in _blocks("bash", text) for line in block.splitlines()]
    assert "pip install -e ." in commands, commands
    assert not re.search(r"pip install [\"']?pyro-scalable", text), "the package is not published on an index"
    pin = re.search(r"torch==[0-9.]+", text).group(0)
    assert pin in _text(ROOT / "scripts" / "install.sh"), pin


def _undefined_names(code: str) -> list[str]:
    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(used - defined)


def test_first_example_defines_what_it_uses():
    first = _blocks("python", _text())[0]
    assert not _undefined_names(first), _undefined_names(first)
    assert "SGHMC(model)" in first, "the first example runs at the defaults"


def test_engine_table_names_existing_engines():
    """Every class the "which engine when" table names is importable from pyro_scalable.infer."""
    import pyro_scalable.infer as infer

    section = _text().split("## Which engine when", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names = {name for row in rows for name in re.findall(r"`([A-Z][A-Za-z]+)`", row.split("|")[1])}
    assert {"SGHMC", "StochasticMCMC", "AutoLinearizedLaplace", "SampleThenOptimize", "SWAG", "EKF"} <= names
    missing = sorted(name for name in names if not hasattr(infer, name))
    assert not missing, f"the README's engine table names {missing}, which pyro_scalable.infer does not export"
    assert any("NUTS" in row for row in section.splitlines()), "the table says when full-batch NUTS is the choice"


def test_comparison_page_names_existing_tests():
    """docs/comparison.md's "tested in" column names test files that exist (a bare name is in the folder before it)."""
    missing = []
    for line in _text(ROOT / "docs" / "comparison.md").splitlines():
        if not line.startswith("|"):
            continue
        folder = None
        for path in re.findall(r"`([^`]+\.py)`", line.rstrip("|").split("|")[-1]):
            if "/" in path:
                folder = Path(path).parent
            elif folder is not None:
                path = (folder / path).as_posix()
            if not (ROOT / path).is_file():
                missing.append(path)
    assert not missing, f"docs/comparison.md names tests that do not exist: {missing}"


def test_tutorials_index_links_every_tutorial_in_the_nav_order():
    """tutorials/README.md links each rendered tutorial once, in the order mkdocs.yml's nav lists them."""
    import yaml

    class _Loader(yaml.SafeLoader):  # mkdocs.yml holds !!python/name tags elsewhere; the nav needs none
        pass

    _Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    nav = yaml.load(_text(ROOT / "mkdocs.yml"), Loader=_Loader)["nav"]
    (section,) = [item["Tutorials"] for item in nav if isinstance(item, dict) and "Tutorials" in item]
    pages = [entry if isinstance(entry, str) else next(iter(entry.values())) for entry in section]
    in_nav = [Path(page).stem for page in pages if page.endswith(".ipynb")]
    linked = re.findall(r"\(\.\./docs/tutorials/([a-z_0-9]+)\.ipynb\)", _text(TUTORIALS / "README.md"))
    scripts = sorted(path.stem for path in TUTORIALS.glob("*.py"))
    assert sorted(linked) == scripts, (linked, scripts)
    assert linked == in_nav, (linked, in_nav)
    assert linked[0] == "sgmcmc_logistic_regression", "the introductory tutorial comes first"
    for stem in linked:
        assert (ROOT / "docs" / "tutorials" / f"{stem}.ipynb").is_file(), stem


def test_citation_and_changelog_match_the_package():
    import yaml

    import pyro_scalable

    citation = yaml.safe_load(_text(ROOT / "CITATION.cff"))
    assert citation["cff-version"] == "1.2.0"
    assert {"message", "title", "authors"} <= set(citation)
    assert str(citation["version"]) == pyro_scalable.__version__
    license = re.search(r'^license = "([^"]+)"', _text(ROOT / "pyproject.toml"), re.M).group(1)
    assert citation["license"] == license
    assert f"Licence: {license}" in _text(), "the README names the licence pyproject.toml declares"
    assert f"## [{pyro_scalable.__version__}]" in _text(ROOT / "CHANGELOG.md")


@pytest.mark.arviz
def test_from_pyro_claim():
    """The README sends users to pyro_scalable.to_inference_data: ArviZ 1.x has no az.from_pyro, and 0.x's leaves
    out the log-likelihood of a model that does not vectorise over draws, such as the README's (`x[idx] @ w`)."""
    az = pytest.importorskip("arviz")
    if int(az.__version__.split(".")[0]) >= 1:
        assert not hasattr(az, "from_pyro")
        return
    import pyro
    import pyro.distributions as dist
    import torch

    from pyro_scalable.infer import SGHMC, StochasticMCMC

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(400, 3, generator=generator)
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.5, -2.0, 0.5])), generator=generator)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", len(x), subsample_size=100) as idx:
            pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])

    mcmc = StochasticMCMC(SGHMC(model), num_samples=20, num_warmup=50, num_chains=2, seed=0, progress_bar=False)
    mcmc.run(x, y)
    with pytest.warns(UserWarning, match="log_likelihood group will be omitted"):
        theirs = az.from_pyro(mcmc)
    assert "posterior" in theirs.groups() and "log_likelihood" not in theirs.groups()
    assert "log_likelihood" in mcmc.to_inference_data().groups()


@pytest.mark.slow
@pytest.mark.arviz
def test_first_example_runs_as_printed_without_a_warning():
    """The README's first example, as printed, in a fresh process: no warning, every r_hat <= 1.01 and every bulk
    ESS above 100 per chain (what the README says it prints). About a minute on two cores."""
    pytest.importorskip("arviz")
    code = _blocks("python", _text())[0]
    check = (
        "\nimport json as _json\n_s = az.summary(idata)\n"
        "print('README-CHECK', _json.dumps({'r_hat': float(_s['r_hat'].max()), 'ess': float(_s['ess_bulk'].min()),"
        " 'shape': list(y_new.shape)}))\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    result = subprocess.run(
        [sys.executable, "-c", code + check], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # tqdm's progress bar writes to stderr too; a warning is a line "<file>:<line>: SomethingWarning: ..."
    warnings = [line for line in result.stderr.splitlines() if re.search(r"\b\w*Warning\b:", line)]
    assert not warnings, warnings
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("README-CHECK")]
    found = json.loads(line.split(" ", 1)[1])
    assert found["shape"] == [4 * 3000, 5], found
    assert found["r_hat"] <= 1.01 and found["ess"] > 4 * 100, found
