"""MkDocs hook: show files that live outside ``docs/`` (the tutorials' overview, the raw benchmark results) as pages.

The Markdown in ``docs/`` links to them by their repository paths (``../tutorials/x.py``), which work when the
files are read on GitHub or in a checkout. MkDocs only resolves links inside ``docs_dir``, so this hook

* adds each file below to the build at its repository path (``tutorials/README.md``, ``benchmarks/results/y.md``);
* expands a glob such as ``tutorials/*.ipynb`` in ``nav`` (so a new tutorial appears with no edit here);
* rewrites every relative link that leaves the Markdown file's own folder for a repository file the site holds,
  so that ``mkdocs build --strict`` checks it like any other link (and still fails on a broken one). A link to a
  tutorial script ``tutorials/x.py`` leads to its page: the executed notebook ``docs/tutorials/x.ipynb`` that
  ``scripts/render_tutorials.py`` writes and mkdocs-jupyter renders;
* does the same for the links in the rendered tutorials (HTML from nbconvert, which MkDocs does not check), and
  logs a warning — a failure under ``--strict`` — for one that points at no file of the site.
"""

from __future__ import annotations

import glob
import logging
import os
import posixpath
import re

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

# Repository files the site shows besides docs/, as globs relative to the repository root.
REPO_GLOBS = ("tutorials/README.md", "benchmarks/README.md", "benchmarks/results/*.md")

_LINK = re.compile(r"(\]\()(\.\./[^)\s#]+)")
_HREF = re.compile(r'(href=")([^"]+)(")')
# nbconvert's own MathJax loader and its MathJax 2 configuration, which every rendered notebook carries: the site
# already loads MathJax 3 on every page (mkdocs.yml, docs/_hooks/mathjax.py), and a second copy would fight it.
_NBCONVERT_MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", flags=re.S)
log = logging.getLogger("mkdocs.hooks.repo_files")  # under "mkdocs": a warning here fails the strict build


def _repo_root(config) -> str:
    return os.path.dirname(os.path.abspath(config.config_file_path))


def _docs_prefix(config) -> str:
    return posixpath.relpath(os.path.abspath(config.docs_dir), _repo_root(config)).replace(os.sep, "/")


def _site_file(files: Files, site_path: str):
    """The site's file at ``site_path``; a tutorial script stands for its rendered notebook."""
    file = files.get_file_from_path(site_path)
    if file is None and site_path.startswith("tutorials/") and site_path.endswith(".py"):
        file = files.get_file_from_path(site_path[: -len(".py")] + ".ipynb")
    return file


def _is_tutorial_page(src: str) -> bool:
    return src.startswith("tutorials/") and src.endswith(".ipynb")


def _repo_files(config) -> list[str]:
    root = _repo_root(config)
    found = set()
    for pattern in REPO_GLOBS:
        found.update(posixpath.relpath(p, root).replace(os.sep, "/") for p in glob.glob(os.path.join(root, pattern)))
    return sorted(found)


def on_config(config):
    """Expand globs in ``nav`` into the files they match, in name order (in ``docs/`` first, else the repository)."""
    root = _repo_root(config)

    def matches(pattern: str) -> list[str]:
        for base in (os.path.abspath(config.docs_dir), root):
            found = glob.glob(os.path.join(base, pattern))
            if found:
                return sorted(posixpath.relpath(p, base).replace(os.sep, "/") for p in found)
        return []

    def expand(items):
        out = []
        for item in items:
            if isinstance(item, str) and any(c in item for c in "*?["):
                out.extend(matches(item))
            elif isinstance(item, dict):
                out.append({k: expand(v) if isinstance(v, list) else v for k, v in item.items()})
            else:
                out.append(item)
        return out

    if config.nav:
        config.nav = expand(config.nav)
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the tutorials as notebook pages
def on_files(files: Files, config) -> Files:
    """Add the repository files of ``REPO_GLOBS`` at their repository paths."""
    root = _repo_root(config)
    for path in _repo_files(config):
        if files.get_file_from_path(path) is None:
            # A real source folder (the repository root), not File.generated: mkdocs-jupyter's wrapper recomputes
            # the source path from src_dir.
            options = dict(src_dir=root, dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls)
            file = File(path, **options)
            taken = {other.dest_uri for other in files}
            if file.dest_uri in taken:
                # a README is its folder's index page, which a docs page of the folder's name also is
                # (benchmarks/README.md and docs/benchmarks.md): the README moves to <folder>/readme/
                folder = posixpath.dirname(path)
                moved = f"{folder}/readme/index.html" if config.use_directory_urls else f"{folder}/readme.html"
                file = File(path, dest_uri=moved, **options)
            files.append(file)
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Point ``../``-links at repository files the site holds to their pages, relative to this page."""
    src = page.file.src_uri
    # Where the Markdown file sits in the repository: docs pages under docs/, the added ones at their own path.
    prefix = _docs_prefix(config) + "/"
    repo_path = src if src in set(_repo_files(config)) else prefix + src
    here = posixpath.dirname(repo_path)

    def rewrite(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(here, match.group(2)))
        site_path = target[len(prefix) :] if target.startswith(prefix) else target
        file = _site_file(files, site_path)
        if file is None:
            return match.group(0)  # left alone: the strict build reports it
        return match.group(1) + posixpath.relpath(file.src_uri, posixpath.dirname(src) or ".")

    return _LINK.sub(rewrite, markdown)


def on_page_content(html: str, page, config, files: Files) -> str:
    """Point a rendered tutorial's relative links at the site's pages, and drop nbconvert's MathJax loader.

    A link that leads to no file of the site is logged as a warning (a failure of the strict build).
    """
    src = page.file.src_uri
    if not _is_tutorial_page(src):
        return html
    html = _NBCONVERT_MATHJAX.sub("", html)
    prefix = _docs_prefix(config) + "/"

    def rewrite(match: re.Match) -> str:
        url = match.group(2)
        if "://" in url or url.startswith(("#", "/", "mailto:", "data:")):
            return match.group(0)
        path, _, fragment = url.partition("#")
        target = posixpath.normpath(posixpath.join(posixpath.dirname(src), path))
        site_path = target[len(prefix) :] if target.startswith(prefix) else target
        file = _site_file(files, site_path)
        if file is None:
            log.warning(f"Tutorial '{src}' links to '{url}', which is not among the site's files.")
            return match.group(0)
        return match.group(1) + file.url_relative_to(page.file) + (f"#{fragment}" if fragment else "") + match.group(3)

    return _HREF.sub(rewrite, html)
