"""Vendor the posteriordb suite's data and reference summaries: ``python scripts/posteriordb_reference.py [PATH]``.

Reads a posteriordb checkout at PATH (default ``/work/shared/posteriordb``): either that folder's layout
(``posteriors/``, ``data/``, ``reference_draws/``) or posteriordb's own repository's (``posterior_database/``
with ``posteriors/``, ``data/data/``, ``reference_posteriors/draws/draws/``). For every posterior of
``tests/posteriordb`` it writes

* ``tests/posteriordb/data/<data name>.json``: the data zip's one JSON object, byte for byte;
* ``tests/posteriordb/reference.json``: per Stan parameter, in the draws' order, the mean, sd and 5/50/95%
  quantiles of the reference draws (all chains pooled), with the number of chains and draws.

The draws themselves are not vendored. Seconds to run.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.posteriordb import POSTERIORS  # noqa: E402
from tests.posteriordb.entry import DATA, REFERENCE  # noqa: E402

DEFAULT = Path("/work/shared/posteriordb")
QUANTILES = (0.05, 0.5, 0.95)


def layout(checkout: Path) -> dict[str, Path]:
    """The folders of posterior records, data zips and reference-draw zips in ``checkout``."""
    upstream = checkout / "posterior_database"
    if upstream.is_dir():
        return {
            "posteriors": upstream / "posteriors",
            "data": upstream / "data" / "data",
            "draws": upstream / "reference_posteriors" / "draws" / "draws",
        }
    return {"posteriors": checkout / "posteriors", "data": checkout / "data", "draws": checkout / "reference_draws"}


def zipped_json(path: Path) -> bytes:
    """The one member of a posteriordb zip, as stored."""
    with zipfile.ZipFile(path) as archive:
        (member,) = archive.namelist()
        return archive.read(member)


def summarise(chains: list[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per parameter of the draws (a list of chains, name -> draws): mean, sd, q05, q50, q95 of all chains pooled."""
    summaries = {}
    for name in chains[0]:
        draws = torch.tensor([value for chain in chains for value in chain[name]], dtype=torch.float64)
        quantiles = torch.quantile(draws, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
        summaries[name] = {"mean": float(draws.mean()), "sd": float(draws.std())}
        summaries[name] |= {f"q{round(q * 100):02d}": value for q, value in zip(QUANTILES, quantiles, strict=True)}
    return summaries


def main() -> None:
    """Write the data and the reference summaries of every posterior of the suite."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, default=DEFAULT, help=f"default {DEFAULT}")
    options = parser.parse_args()
    folders = layout(options.checkout)
    DATA.mkdir(exist_ok=True)
    posteriors = {}
    for name in POSTERIORS:
        record = json.loads((folders["posteriors"] / f"{name}.json").read_text())
        data_name, reference_name = record["data_name"], record["reference_posterior_name"]
        (DATA / f"{data_name}.json").write_bytes(zipped_json(folders["data"] / f"{data_name}.json.zip"))
        chains = json.loads(zipped_json(folders["draws"] / f"{reference_name}.json.zip"))
        posteriors[name] = {
            "model_name": record["model_name"],
            "data_name": data_name,
            "chains": len(chains),
            "draws_per_chain": len(next(iter(chains[0].values()))),
            "parameters": summarise(chains),
        }
        print(f"{name}: {len(posteriors[name]['parameters'])} parameters", flush=True)
    reference = {
        "command": "python scripts/posteriordb_reference.py",
        "source": "posteriordb (https://github.com/stan-dev/posteriordb), BSD-3: tests/posteriordb/LICENCE.md",
        "posteriors": posteriors,
    }
    REFERENCE.write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main()
