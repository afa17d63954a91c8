"""Optional dependencies: a missing one is named together with the extra that installs it.

The core (torch, pyro-ppl, arviz, numpy, tqdm) is always installed; the demo's data set (scikit-learn) and plots
(matplotlib) come with the ``demo`` extra. Importing one of those through :func:`import_optional` turns Python's
bare ``ModuleNotFoundError: No module named 'sklearn'`` into one that says what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# import name -> (distribution name on PyPI, extra of pyro-scalable that installs it)
OPTIONAL = {
    "sklearn": ("scikit-learn", "demo"),
    "matplotlib": ("matplotlib", "demo"),
}


def missing_extra_message(names: list[str], purpose: str) -> str:
    """The message for the optional modules ``names`` (import names) that ``purpose`` needs and cannot import."""
    packages = ", ".join(OPTIONAL[name][0] for name in names)
    extras = sorted({OPTIONAL[name][1] for name in names})
    install = " ".join(f'pip install "pyro-scalable[{extra}]"' for extra in extras)
    hint = " (from a checkout: bash scripts/demo.sh)" if extras == ["demo"] else ""
    verb = "is" if len(names) == 1 else "are"
    extra = ", ".join(extras)
    return f"{purpose} needs {packages}, which {verb} not installed. Install the {extra} extra: {install}{hint}"


def import_optional(name: str, purpose: str) -> ModuleType:
    """Import the optional module ``name``, or raise ``ModuleNotFoundError`` naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] != name.split(".")[0]:
            raise  # the module is there but one of its own imports failed: Python's message says which
        raise ModuleNotFoundError(missing_extra_message([name.split(".")[0]], purpose), name=name) from error


def missing(names: list[str]) -> list[str]:
    """Those of the optional modules ``names`` that cannot be imported."""
    absent = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            absent.append(name)
    return absent
