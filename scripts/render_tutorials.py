"""Run the tutorials and write them, with their outputs and figures, as the notebooks the documentation site shows.

Each ``tutorials/<name>.py`` (a jupytext "percent" script) becomes ``docs/tutorials/<name>.ipynb``: converted by
jupytext, executed cell by cell by nbclient in the repository root, in full mode unless ``--fast`` is given. A
tutorial saves its figures as PNG files (``PYRO_SCALABLE_IMAGES``; ``docs/images/`` on a full run, which this
refreshes); every PNG a cell writes is attached to that cell as an output, so the page shows the figure where the
code draws it. The notebook's metadata records the SHA-256 of the source script, the mode and the run time;
``tests/test_docs.py`` fails when a script no longer matches its rendered notebook.

Usage (the ``render`` extra: ``pip install -e ".[render]"``)::

    python scripts/render_tutorials.py                      # every tutorial, full mode (tens of minutes)
    python scripts/render_tutorials.py tutorials/x.py       # one
    python scripts/render_tutorials.py --fast tutorials/x.py  # the quick mode CI runs; the page says so
    python scripts/render_tutorials.py --check              # list the tutorials whose notebook is out of date
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
RENDERED = ROOT / "docs" / "tutorials"
METADATA_KEY = "pyro_scalable"
# Cells tagged so (``# %% tags=["remove-cell"]`` in the script) run but are left out of the page (mkdocs.yml,
# mkdocs-jupyter's remove_tag_config): the fast-mode switch, the figure files, the tutorial's own checks.
HIDDEN = "remove-cell"


def source_hash(path: Path) -> str:
    """SHA-256 of a tutorial script's bytes, as recorded in its rendered notebook."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rendered_path(path: Path) -> Path:
    """Where the site reads the rendered notebook of ``path``."""
    return RENDERED / f"{path.stem}.ipynb"


def is_current(path: Path) -> bool:
    """Whether ``docs/tutorials/<name>.ipynb`` was rendered from this version of ``path``."""
    target = rendered_path(path)
    if not target.is_file():
        return False
    meta = json.loads(target.read_text(encoding="utf-8")).get("metadata", {}).get(METADATA_KEY, {})
    return meta.get("source_sha256") == source_hash(path)


_PROGRESS = re.compile(r"^\r?[^\n]*\d+%\|[^\n]*\|[^\n]*$|^\s*$")  # a tqdm progress line, or only whitespace


def _is_environment_noise(output) -> bool:
    """What the rendering kernel adds, not the tutorial: tqdm's warning without ipywidgets, and progress bars.

    A progress bar helps a user watching a long step; on a rendered page it is a red block of stale percentages.
    """
    if output.get("output_type") != "stream" or output.get("name") != "stderr":
        return False
    text = output["text"]
    return "TqdmWarning" in text or all(_PROGRESS.match(line) for line in text.split("\n"))


def tidy(notebook) -> None:
    """Drop the rendering environment's noise from the outputs; give cells stable ids and no run-specific metadata."""
    for index, cell in enumerate(notebook.cells):
        cell.id = f"cell-{index}"  # stable ids: a re-render changes only what the run changed
        cell.metadata.pop("lines_to_next_cell", None)
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = [output for output in cell.outputs if not _is_environment_noise(output)]


def _pngs(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.glob("*.png")} if folder.is_dir() else {}


def _note(fast: bool, seconds: float) -> str:
    minutes = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    source = "the script `tutorials/{name}.py`"
    if fast:
        return (
            f"> **Rendered in the quick mode** the tests run (less data and fewer steps, so the numbers and figures "
            f"are rougher than a full run's), from {source}, in {minutes} on a CPU: a full run took too long for "
            f"the machine that rendered it. `python tutorials/{{name}}.py` runs it in full."
        )
    return f"> Rendered from {source} (full run, {minutes} on a CPU) by `python scripts/render_tutorials.py`."


def render(path: Path, fast: bool) -> float:
    """Execute ``path`` as a notebook and write ``docs/tutorials/<name>.ipynb``; return the run time in seconds."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    digest = source_hash(path)
    notebook = jupytext.read(path, fmt="py:percent")
    notebook.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    notebook.metadata.pop("jupytext", None)

    env = {"MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    scratch = None
    if fast:
        scratch = tempfile.TemporaryDirectory()
        env.update(PYRO_SCALABLE_FAST="1", PYRO_SCALABLE_IMAGES=scratch.name)
        images = Path(scratch.name)
    else:
        os.environ.pop("PYRO_SCALABLE_FAST", None)
        os.environ.pop("PYRO_SCALABLE_IMAGES", None)
        images = ROOT / "docs" / "images"
    os.environ.update(env)  # the kernel inherits this process's environment

    client = NotebookClient(
        notebook, timeout=None, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(ROOT)}}
    )
    start = time.perf_counter()
    shown = None  # the last code cell the page shows: a hidden cell's figures are attached to it
    try:
        with client.setup_kernel():
            for index, cell in enumerate(notebook.cells):
                before = _pngs(images)
                client.execute_cell(cell, index)
                if cell.cell_type != "code":
                    continue
                if HIDDEN not in cell.metadata.get("tags", []):
                    shown = cell
                written = sorted(p for p, mtime in _pngs(images).items() if before.get(p) != mtime)
                for png in written:
                    data = base64.b64encode(png.read_bytes()).decode("ascii")
                    output = nbformat.v4.new_output("display_data", data={"image/png": data, "text/plain": png.name})
                    (shown or cell).outputs.append(output)
    finally:
        if scratch is not None:
            scratch.cleanup()
    seconds = time.perf_counter() - start

    title_at = next((i for i, c in enumerate(notebook.cells) if c.cell_type == "markdown"), -1)
    note = nbformat.v4.new_markdown_cell(_note(fast, seconds).format(name=path.stem))
    notebook.cells.insert(title_at + 1, note)
    tidy(notebook)
    notebook.metadata[METADATA_KEY] = {
        "source": f"tutorials/{path.name}",
        "source_sha256": digest,
        "mode": "fast" if fast else "full",
        "seconds": round(seconds),
        "command": f"python scripts/render_tutorials.py {'--fast ' if fast else ''}tutorials/{path.name}",
    }
    nbformat.validate(notebook)
    RENDERED.mkdir(parents=True, exist_ok=True)
    with open(rendered_path(path), "w", encoding="utf-8") as handle:
        nbformat.write(notebook, handle)
    return seconds


def main(argv: list[str] | None = None) -> int:
    """Render the named tutorials (all by default), or with ``--check`` list the stale ones."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="tutorial scripts (default: tutorials/*.py)")
    parser.add_argument("--fast", action="store_true", help="PYRO_SCALABLE_FAST=1: the quick mode CI runs")
    parser.add_argument("--check", action="store_true", help="only report the notebooks that are out of date")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.paths] or sorted(TUTORIALS.glob("*.py"))
    if args.check:
        stale = [p for p in paths if not is_current(p)]
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)} (run: python scripts/render_tutorials.py {p.relative_to(ROOT)})")
        return 1 if stale else 0
    for path in paths:
        print(f"rendering {path.relative_to(ROOT)} ({'fast' if args.fast else 'full'} mode) ...", flush=True)
        seconds = render(path, args.fast)
        print(f"  wrote {rendered_path(path).relative_to(ROOT)} in {seconds / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
