"""Install the ArviZ major this Python does not have into a folder of its own, so the tests can run against both.

Usage: ``python scripts/other_arviz.py [FOLDER]`` (default ``.arviz-other``); prints FOLDER's absolute path on the
last line. ``PYTHONPATH=FOLDER python ...`` then imports that ArviZ and everything else from the environment.

Where the environment has ArviZ 0.x (pip's choice on Python < 3.12), FOLDER gets ArviZ 1.3 (arviz, arviz-base,
arviz-stats, arviz-plots); where it has 1.x, FOLDER gets ArviZ 0.23. ArviZ 1.x declares Python >= 3.12 but imports
and works on 3.10/3.11, so it is installed with ``--ignore-requires-python``. Every package goes in with
``--no-deps``, and then only the requirements that neither FOLDER nor the environment satisfies are added (their
own requirements likewise), so torch, numpy and the rest of the environment are used as they are, never replaced.
Idempotent: a second call with everything in place only reads package metadata.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement

# The versions the tests were checked with.
ARVIZ_1 = ["arviz==1.3.0", "arviz-base==1.3.1", "arviz-stats==1.3.3", "arviz-plots==1.3.2"]
ARVIZ_0 = ["arviz==0.23.4"]


def _installed(name: str, folder: Path) -> str | None:
    """The version of distribution ``name`` as ``PYTHONPATH=folder`` would see it (folder first), or None."""
    for dist in md.distributions(name=name, path=[str(folder)]):
        return dist.version
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _missing(specs: list[str], folder: Path) -> list[str]:
    missing = []
    for spec in specs:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        version = _installed(req.name, folder)
        if version is None or not req.specifier.contains(version, prereleases=True):
            missing.append(str(Requirement(f"{req.name}{req.specifier}")))
    return missing


def _install(specs: list[str], folder: Path) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    command += ["--ignore-requires-python", "--upgrade", "--target", str(folder), *specs]
    subprocess.run(command, check=True)


def main() -> None:
    """Install into the folder named on the command line and print its path."""
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".arviz-other").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    major = int(md.version("arviz").split(".")[0])
    wanted = ARVIZ_0 if major >= 1 else ARVIZ_1
    # the other major itself must come from FOLDER, whatever the environment has
    here = {d.metadata["Name"].lower(): d.version for d in md.distributions(path=[str(folder)])}
    todo = [s for s in wanted if not Requirement(s).specifier.contains(here.get(Requirement(s).name.lower(), "0"))]
    for _ in range(10):
        if todo:
            _install(todo, folder)
        requirements = [
            r for d in md.distributions(path=[str(folder)]) for r in (d.requires or []) if not r.startswith("arviz")
        ]
        todo = _missing(requirements, folder)
        if not todo:
            break
    else:
        sys.exit(f"other_arviz.py: could not satisfy {todo}")
    print(folder)


if __name__ == "__main__":
    main()
