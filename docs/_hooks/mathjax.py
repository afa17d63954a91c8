r"""MkDocs hook: serve MathJax 3 with the site, so that formulas render offline and without a CDN.

MathJax is not committed here: the ``docs`` extra installs ``django-static-mathjax`` (MathJax 3.2.2 as the
upstream ``es5`` build, Apache-2.0, no dependencies -- Django is needed only to use it as a Django app, not to
install it or read its files), and this hook adds the files the pages need to the build under
``javascripts/mathjax/``:

* ``tex-mml-chtml.js``, the combined TeX input and CommonHTML output that ``mkdocs.yml`` loads;
* ``output/chtml/fonts/woff-v2/``, the fonts it fetches relative to its own address;
* ``input/tex/extensions/``, the TeX packages it autoloads on first use (``\boldsymbol``, ``\cancel``, ...);
* MathJax's ``LICENSE``.

About 2.3 MB in the built site. Without the package the build fails with a message that names it.
"""

from __future__ import annotations

import importlib.util
import os

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

SITE_DIR = "javascripts/mathjax"
# Relative to MathJax's es5/ folder: a file or a folder whose files are all added.
PARTS = ("tex-mml-chtml.js", "output/chtml/fonts/woff-v2", "input/tex/extensions")


def _es5() -> str:
    spec = importlib.util.find_spec("mathjax")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        es5 = os.path.join(location, "static", "mathjax", "es5")
        if os.path.isfile(os.path.join(es5, "tex-mml-chtml.js")):
            return es5
    raise PluginError(
        "MathJax 3 is not installed: the site serves it itself (docs/_hooks/mathjax.py). "
        'Install the docs extra: pip install -e ".[docs]" (it brings django-static-mathjax).'
    )


def on_files(files: Files, config) -> Files:
    """Add MathJax's script, fonts, autoloaded TeX extensions and licence to the site's files."""
    es5 = _es5()
    sources = [(os.path.join(es5, os.pardir, "LICENSE"), "LICENSE")]
    for part in PARTS:
        path = os.path.join(es5, part)
        if os.path.isfile(path):
            sources.append((path, part))
            continue
        for folder, _, names in os.walk(path):
            for name in sorted(names):
                full = os.path.join(folder, name)
                sources.append((full, os.path.relpath(full, es5).replace(os.sep, "/")))
    for source, relative in sources:
        files.append(File.generated(config, f"{SITE_DIR}/{relative}", abs_src_path=os.path.normpath(source)))
    return files
