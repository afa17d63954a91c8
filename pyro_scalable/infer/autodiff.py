"""Forward-mode differentiation shared by the engines (the Laplace curvature, sample-then-optimise, SG-MCMC warm-up)."""

from __future__ import annotations

import warnings

import torch

__all__ = ["jvp"]


def jvp(func, primals, tangents):
    """``torch.func.jvp``, without torch's one-time notice about its TorchScript decompositions."""
    # The first forward-mode call in a process makes torch script its jvp decompositions, which warns about
    # torch.jit.script being deprecated (a torch internal, nothing the user can act on).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script. is deprecated", category=DeprecationWarning)
        return torch.func.jvp(func, primals, tangents)
