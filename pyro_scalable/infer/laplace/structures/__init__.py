r"""The Laplace curvature structures, one class per structure, and the one registry from name to class.

Each class (:class:`~pyro_scalable.infer.laplace.curvature.Structure`) fits itself at the MAP — its part of the one
GGN pass, or for ``"sampled"`` the floor's sample-then-optimise solver
(:mod:`~pyro_scalable.infer.linearized.sampling`) —, holds :math:`G`, and gives the precision
:math:`H = sG + \mathrm{diag}(P)` with its functional covariance. Adding a structure is one module here and one
line in :data:`STRUCTURES`.
"""

from __future__ import annotations

from typing import Literal

from pyro_scalable.infer.laplace.curvature import Structure
from pyro_scalable.infer.laplace.structures.diag import DiagCurvature
from pyro_scalable.infer.laplace.structures.full import FullCurvature
from pyro_scalable.infer.laplace.structures.kron import KronBlock, KronCurvature
from pyro_scalable.infer.laplace.structures.low_rank import LowRankCurvature
from pyro_scalable.infer.laplace.structures.sampled import SampledCurvature

__all__ = [
    "STRUCTURES",
    "DiagCurvature",
    "FullCurvature",
    "KronBlock",
    "KronCurvature",
    "LowRankCurvature",
    "SampledCurvature",
    "StructureName",
    "structure_class",
]

StructureName = Literal["full", "diag", "kron", "low_rank", "sampled"]

STRUCTURES: dict[str, type[Structure]] = {
    "full": FullCurvature,
    "diag": DiagCurvature,
    "kron": KronCurvature,
    "low_rank": LowRankCurvature,
    "sampled": SampledCurvature,
}


def structure_class(name: str) -> type[Structure]:
    """The class registered as ``name``."""
    if name not in STRUCTURES:
        raise ValueError(f"structure must be one of {sorted(STRUCTURES)}, got {name!r}.")
    return STRUCTURES[name]
