"""Properties of the result surface (``Draws``) and the ArviZ adapter on random models and draws.

A run is faked by filling a :class:`~pyro_scalable.infer.results.Draws` with random unconstrained draws, as an
engine would; then every group's shape, dims, dtype and values are checked against the bridge and Pyro.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pyro
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_scalable import FullDataModel
from pyro_scalable.bridge import ModelBridge
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.infer.results import Draws
from pyro_scalable.inference_data import draws_to_inference_data, to_inference_data
from tests.arviz_compat import group_names, needs_from_pyro
from tests.random_models import build, specs

pytestmark = pytest.mark.arviz  # run against both ArviZ majors by scripts/test.sh


class FakeRun(Draws):
    """What an engine leaves behind: unconstrained draws ``(chains, draws, *shape)`` and per-draw statistics."""

    def __init__(self, bridge: ModelBridge, num_chains: int, num_samples: int, seed: int):
        self.kernel = SimpleNamespace(model=FullDataModel(bridge.model))
        self.num_chains, self.num_samples = num_chains, num_samples
        self.draws_device = torch.device("cpu")
        g = torch.Generator().manual_seed(seed)
        draws = {
            name: torch.rand((num_chains, num_samples, *site.unconstrained_shape), generator=g).to(
                next(iter(bridge.args)).dtype
            )
            * 4
            - 2
            for name, site in bridge.sites.items()
        }
        stats = {
            "lp": torch.randn(num_chains, num_samples, generator=g),
            "diverging": torch.rand(num_chains, num_samples, generator=g) < 0.1,
            "step_size": torch.full((num_chains, num_samples), 0.01),
        }
        self.results = RunRecord(bridge, bridge, bridge.args, bridge.kwargs, draws, stats)


def _plate_dims(spec):
    return {
        "scalar": ["data"],
        "counts": ["data"],
        "event": ["data", "obs_dim_1"],
        "nested": ["data", "feat"],
        "two_plates": ["data", "cols"],
    }[spec.layout]


@given(spec=specs(), num_chains=st.integers(1, 3), num_samples=st.integers(1, 4), data_chunk=st.integers(1, 7))
def test_draws_to_inference_data_shapes_dims_dtypes_and_values(spec, num_chains, num_samples, data_chunk):
    model, args = build(spec)
    run = FakeRun(ModelBridge(model, args), num_chains, num_samples, spec.seed)
    idata = to_inference_data(run, data_chunk_size=data_chunk, draws_chunk_size=2)
    assert group_names(idata) == {"posterior", "sample_stats", "log_likelihood", "observed_data"}
    numpy_dtype = np.float32 if spec.dtype == torch.float32 else np.float64
    samples = run.get_samples(group_by_chain=True)
    for name, site in run.bridge.sites.items():
        var = idata.posterior[name]
        assert var.shape == (num_chains, num_samples, *site.shape)
        assert var.dims[:2] == ("chain", "draw")
        assert var.dtype == numpy_dtype
        np.testing.assert_array_equal(var.values, samples[name].numpy())
    for name in ("lp", "diverging", "step_size"):
        assert idata.sample_stats[name].dims == ("chain", "draw")
    assert idata.sample_stats["diverging"].dtype == bool
    y = args[0]
    observed = idata.observed_data["obs"]
    assert list(observed.dims) == _plate_dims(spec)
    np.testing.assert_array_equal(observed.values, y.numpy())
    log_lik = idata.log_likelihood["obs"]
    batch_shape = y.shape[:1] if spec.layout == "event" else y.shape
    assert log_lik.shape == (num_chains, num_samples, *batch_shape)
    assert list(log_lik.dims) == ["chain", "draw", *_plate_dims(spec)[: len(batch_shape)]]
    assert log_lik.dtype == np.float64  # whatever the model's dtype: ArviZ's PSIS overflows in float32
    flat = run.get_unconstrained_samples()
    for c, s in [(0, 0), (num_chains - 1, num_samples - 1)]:
        latents = {k: v[c * num_samples + s] for k, v in flat.items()}
        node = (
            pyro.poutine.trace(pyro.poutine.condition(FullDataModel(model), data=run.bridge.constrain(latents)))
            .get_trace(*args)
            .nodes["obs"]
        )
        expected = node["fn"].log_prob(node["value"]).numpy()
        np.testing.assert_allclose(log_lik.values[c, s], expected, **spec.tolerance)


@given(spec=specs(layouts=("scalar", "nested")), num_chains=st.integers(1, 3), num_samples=st.integers(1, 3))
def test_coords_and_dims_name_the_plate_dimension(spec, num_chains, num_samples):
    model, args = build(spec)
    run = FakeRun(ModelBridge(model, args), num_chains, num_samples, spec.seed)
    labels = [f"point {i}" for i in range(spec.size)]
    first = next(iter(run.bridge.sites))
    site_shape = run.bridge.sites[first].shape
    extra = {}
    if len(site_shape):
        extra = {first: [f"{first}_axis_{k}" for k in range(len(site_shape))]}
    idata = run.to_inference_data(log_likelihood=False, coords={"data": labels}, dims=extra)
    assert list(idata.observed_data["data"].values) == labels
    assert "log_likelihood" not in group_names(idata)
    assert idata.posterior[first].dims == ("chain", "draw", *extra.get(first, []))


@given(spec=specs(), num_chains=st.integers(1, 3), num_draws=st.integers(1, 3))
def test_laplace_style_draws_to_inference_data(spec, num_chains, num_draws):
    # draws_to_inference_data: {site: (chains * draws, *shape)} unconstrained, as LaplacePosterior passes them
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    latents = {k: v for k, v in bridge.init_latents(num_chains * num_draws, seed=spec.seed).items()}
    idata = draws_to_inference_data(bridge, latents, num_chains=num_chains, data_chunk_size=2)
    constrained = bridge.constrain(latents)
    for name, site in bridge.sites.items():
        assert idata.posterior[name].shape == (num_chains, num_draws, *site.shape)
        np.testing.assert_array_equal(
            idata.posterior[name].values.reshape((-1, *site.shape)), constrained[name].detach().numpy()
        )
    assert idata.log_likelihood["obs"].shape[:2] == (num_chains, num_draws)


@needs_from_pyro
def test_arviz_reads_a_fake_run_with_from_pyro():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing", category=FutureWarning)
        import arviz as az
    from tests.random_models import Spec

    spec = Spec(("vector", "positive"), torch.float64, "scalar", 6, 2, 1, None, 0)
    model, args = build(spec)
    run = FakeRun(ModelBridge(model, args), 2, 3, 0)
    assert run._args == args and run._kwargs == {}  # what from_pyro reads, from the record
    result = az.from_pyro(run, log_likelihood=False)
    assert result.posterior["vector"].shape == (2, 3, 3)
