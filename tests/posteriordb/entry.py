"""One posterior of the suite: its Pyro port, its vendored data and reference, and the map to Stan's names."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["DATA", "REFERENCE", "Kind", "Posterior", "batch_size", "load_data", "load_reference", "vector"]

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"  # <data name>.json: the posteriordb zip's one JSON object, byte for byte
REFERENCE = HERE / "reference.json"  # written by scripts/posteriordb_reference.py

Kind = Literal["regression", "logistic", "time-series", "hmm", "gp"]


def batch_size(num_data: int) -> int:
    """The data plate's ``subsample_size``: about a tenth of the data, at least 10."""
    return max(10, round(num_data / 10))


def vector(stan_name: str, size: int) -> tuple[str, ...]:
    """Stan's names of a vector's elements, ``name[1]`` to ``name[size]``."""
    return tuple(f"{stan_name}[{i}]" for i in range(1, size + 1))


@cache
def load_data(data_name: str) -> dict[str, Any]:
    """Stan's data block of ``data_name`` as posteriordb gives it (names as in the Stan model)."""
    return json.loads((DATA / f"{data_name}.json").read_text())


@cache
def load_reference() -> dict[str, Any]:
    """The reference summaries ``scripts/posteriordb_reference.py`` wrote."""
    return json.loads(REFERENCE.read_text())


@dataclass(frozen=True)
class Posterior:
    """A posteriordb posterior and its Pyro port.

    ``stan_names`` maps each latent site to Stan's names of its elements: one name without an index for a scalar
    site, ``beta[1]``... in element order for a vector site. ``derived`` holds the Stan parameters that are no site
    of the port (GARCH's ``beta1``, sampled as a share of ``1 - alpha1``): Stan name -> (the sites it reads, the
    function of their draws).
    """

    name: str  # posteriordb's, "<data name>-<model name>"
    kind: Kind
    model: Callable[..., None]
    make_args: Callable[[Mapping[str, Any], torch.dtype], tuple]  # Stan's data (and transformed data) -> arguments
    stan_names: Mapping[str, tuple[str, ...]]
    priors: str  # each flat Stan prior and the proper one standing in for it, or "none flat: ..."
    batch_size: int | None = None  # the data plate's subsample_size; None: no data plate
    no_data_plate: str | None = None  # why there is no data plate
    derived: Mapping[str, tuple[tuple[str, ...], Callable[..., Tensor]]] = field(default_factory=dict)

    def __post_init__(self):
        if (self.batch_size is None) == (self.no_data_plate is None):
            raise ValueError(f"{self.name}: give either a batch size or the reason there is no data plate")

    @property
    def data_name(self) -> str:
        return self.name.split("-", 1)[0]

    @property
    def has_data_plate(self) -> bool:
        return self.batch_size is not None

    def args(self, dtype: torch.dtype = torch.float64) -> tuple:
        """The model's arguments from the vendored data (real numbers in ``dtype``, float64 by default)."""
        return self.make_args(load_data(self.data_name), dtype)

    def reference(self) -> dict[str, dict[str, float]]:
        """Per Stan parameter, in Stan's order: mean, sd, q05, q50, q95 of posteriordb's reference draws."""
        return load_reference()["posteriors"][self.name]["parameters"]

    def stan_draws(self, samples: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Latent draws by site (any leading draw dimensions) -> draws by Stan parameter name, in Stan's order.

        Sites absent from ``samples`` are left out (a linearised engine holds a noise scale at its MAP), and so is a
        derived parameter whose inputs are.
        """
        draws = {}
        for site, names in self.stan_names.items():
            if site not in samples:
                continue
            value = samples[site]
            if len(names) == 1 and "[" not in names[0]:
                draws[names[0]] = value
            else:
                for i, stan_name in enumerate(names):
                    draws[stan_name] = value[..., i]
        for stan_name, (sites, function) in self.derived.items():
            if all(site in samples for site in sites):
                draws[stan_name] = function(*(samples[site] for site in sites))
        return draws
