"""Random Pyro models for the property tests: latent supports, shapes, dtypes, event dims and plate layouts.

A :class:`Spec` is drawn by hypothesis; :func:`build` turns it into ``(model, args)``. Every model has global
latents of the chosen kinds, and one observed site inside a data plate of size N (subsampled by B, or not) laid
out as a scalar, an event (``to_event``), a nested plate, or two subsampled plates. Its output depends on every
latent through ``tanh(value).sum()``, which works on unbatched values and under ``torch.func.vmap``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from hypothesis import strategies as st

F64 = torch.float64

# kind -> distribution factory over a tensor maker ``t`` (which fixes the dtype)
LATENTS = {
    "real": lambda t: dist.Normal(t(0.0), t(1.0)),
    "vector": lambda t: dist.Normal(t([0.0, 0.5, -0.5]), t(1.0)).to_event(1),
    "matrix": lambda t: dist.Normal(t([[0.0, 0.1], [0.2, 0.3], [0.4, 0.5]]), t(1.0)).to_event(2),
    "matrix_event1": lambda t: dist.Normal(t([[0.0, 0.1], [0.2, 0.3]]), t(1.0)).to_event(1),
    "batched": lambda t: dist.Normal(t([0.0, 1.0]), t(1.0)),  # a batch dim outside every plate
    "size_one": lambda t: dist.Normal(t([0.5]), t(1.0)).to_event(1),
    "positive": lambda t: dist.HalfNormal(t(2.0)),
    "positive_vector": lambda t: dist.Gamma(t([2.0, 3.0]), t(3.0)).to_event(1),
    "lognormal": lambda t: dist.LogNormal(t(0.0), t(0.5)),
    "unit_interval": lambda t: dist.Beta(t(2.0), t(3.0)),
    "interval": lambda t: dist.Uniform(t(-1.0), t(2.0)),
    "greater_than": lambda t: dist.Pareto(t(1.0), t(3.0)),
    "simplex": lambda t: dist.Dirichlet(t([1.5, 2.0, 3.0])),
    "corr_cholesky": lambda t: dist.LKJCholesky(3, t(2.0)),
    "corr_matrix": lambda t: dist.LKJ(3, t(2.0)),
}
ELEMENTWISE = {
    "real",
    "vector",
    "matrix",
    "matrix_event1",
    "batched",
    "size_one",
    "positive",
    "positive_vector",
    "lognormal",
    "unit_interval",
    "interval",
    "greater_than",
}
LAYOUTS = ("scalar", "event", "nested", "two_plates", "counts")


@dataclass(frozen=True)
class Spec:
    kinds: tuple[str, ...]
    dtype: torch.dtype
    layout: str
    size: int  # N of the data plate
    subsample: int | None  # B, or None: no subsampling
    width: int  # M of the inner plate (nested, two_plates) or the event size (event)
    inner_subsample: int | None  # the second plate's B (two_plates)
    seed: int

    @property
    def tolerance(self) -> dict:
        return {"rtol": 1e-9, "atol": 1e-9} if self.dtype == F64 else {"rtol": 2e-4, "atol": 2e-3}


@st.composite
def specs(draw, layouts=LAYOUTS, max_size: int = 6) -> Spec:
    kinds = tuple(draw(st.lists(st.sampled_from(sorted(LATENTS)), min_size=1, max_size=3, unique=True)))
    layout = draw(st.sampled_from(layouts))
    size = draw(st.integers(1, max_size if layout != "two_plates" else min(max_size, 4)))
    subsample = draw(st.one_of(st.none(), st.integers(1, size)))
    width = draw(st.integers(1, 3))
    inner = draw(st.one_of(st.none(), st.integers(1, width))) if layout == "two_plates" else None
    return Spec(
        kinds=kinds,
        dtype=draw(st.sampled_from([torch.float32, F64])),
        layout=layout,
        size=size,
        subsample=subsample,
        width=width,
        inner_subsample=inner,
        seed=draw(st.integers(0, 2**16)),
    )


def build(spec: Spec):
    """``(model, args)`` for ``spec``; the data is drawn from ``spec.seed``."""
    dtype = spec.dtype

    def t(value):
        return torch.tensor(value, dtype=dtype)

    g = torch.Generator().manual_seed(spec.seed)
    shape = {
        "scalar": (spec.size,),
        "counts": (spec.size,),
        "event": (spec.size, spec.width),
        "nested": (spec.size, spec.width),
        "two_plates": (spec.size, spec.width),
    }[spec.layout]
    y = torch.randn(shape, generator=g, dtype=dtype)
    if spec.layout == "counts":
        y = torch.poisson(torch.full(shape, 2.0, dtype=dtype), generator=g)
    kinds, layout, size, subsample, width = spec.kinds, spec.layout, spec.size, spec.subsample, spec.width

    def model(y):
        loc = y.new_zeros(())
        for kind in kinds:
            value = pyro.sample(kind, LATENTS[kind](t))
            loc = loc + torch.tanh(value).sum()
        if layout == "two_plates":
            rows = pyro.plate("data", size, subsample_size=subsample, dim=-2)
            cols = pyro.plate("cols", width, subsample_size=spec.inner_subsample, dim=-1)
            with rows as i, cols as j:
                pyro.sample("obs", dist.Normal(loc, 1.0), obs=y[i][:, j])
            return
        data = pyro.plate("data", size, subsample_size=subsample, dim=-2 if layout == "nested" else -1)
        with data as idx:
            if layout == "scalar":
                pyro.sample("obs", dist.Normal(loc, 1.0), obs=y[idx])
            elif layout == "counts":
                pyro.sample("obs", dist.Poisson(torch.nn.functional.softplus(loc) + 0.1), obs=y[idx])
            elif layout == "event":
                pyro.sample("obs", dist.Normal(loc + y.new_zeros(width), 1.0).to_event(1), obs=y[idx])
            else:
                with pyro.plate("feat", width, dim=-1):
                    pyro.sample("obs", dist.Normal(loc, 1.0), obs=y[idx])

    return model, (y,)


def data_plates(spec: Spec) -> dict[str, tuple[int, int]]:
    """``{plate: (N, B)}`` of the plates that are really subsampled (B < N)."""
    plates = {"data": (spec.size, spec.subsample)}
    if spec.layout == "two_plates":
        plates["cols"] = (spec.width, spec.inner_subsample)
    return {k: (n, b) for k, (n, b) in plates.items() if b is not None and b < n}


def num_minibatches(spec: Spec) -> int:
    return math.prod(math.comb(n, b) for n, b in data_plates(spec).values())
