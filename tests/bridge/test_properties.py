"""Properties of the Pyro bridge on random models: odd shapes, supports, dtypes, event dims and plates.

Each property compares the bridge with Pyro itself (``poutine.trace`` + ``biject_to``) or with brute force
(autograd Jacobians, enumeration of every minibatch), never with the bridge's own formulas.
"""

from __future__ import annotations

import itertools

import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributions import biject_to

from pyro_scalable import FullDataModel, ModelError
from pyro_scalable.bridge import Batch, ModelBridge
from pyro_scalable.bridge.likelihood import full_data_log_likelihood
from pyro_scalable.bridge.minibatches import EpochSampler
from tests.random_models import ELEMENTWISE, F64, build, data_plates, num_minibatches, specs

# ---------------------------------------------------------------------------------------------------- helpers


def _pyro_trace(model, args, values):
    """Pyro's own trace of the model on the full data, with the latents conditioned on constrained ``values``."""
    return pyro.poutine.trace(pyro.poutine.condition(FullDataModel(model), data=values)).get_trace(*args)


def _latents(bridge, seed, num_chains=1):
    """Unconstrained latents from Pyro's ``init_to_uniform`` (uniform in (-2, 2) in unconstrained space)."""
    latents = bridge.init_latents(num_chains, seed=seed)
    return latents if num_chains > 1 else {k: v[0] for k, v in latents.items()}


def _free(kind, value):
    """The free coordinates of a constrained value, for a brute-force log|det J|."""
    if kind == "simplex":
        return value[..., :-1]
    rows, cols = torch.tril_indices(value.shape[-1], value.shape[-1], -1)
    return value[..., rows, cols]  # a correlation matrix or its Cholesky factor: the strict lower triangle


def _brute_force_log_det(kind, transform, u):
    if kind in ELEMENTWISE:  # elementwise transforms: the Jacobian is diagonal
        leaf = u.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(transform(leaf).sum(), leaf)
        return grad.abs().log().sum()
    jacobian = torch.func.jacrev(lambda v: _free(kind, transform(v)))(u)
    return torch.linalg.slogdet(jacobian.reshape(u.numel(), u.numel())).logabsdet


def _close(actual, expected, spec, scale=1.0):
    tol = spec.tolerance
    torch.testing.assert_close(actual, expected, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale))


# ---------------------------------------------------------------------------------------------------- properties


@given(spec=specs())
def test_sites_have_the_model_shapes_and_dtypes(spec):
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    trace = pyro.poutine.trace(model).get_trace(*args)
    assert list(bridge.sites) == list(spec.kinds)
    for name, site in bridge.sites.items():
        assert site.shape == trace.nodes[name]["value"].shape
    assert set(bridge.plates) == set(data_plates(spec))
    latents = _latents(bridge, spec.seed)
    for name, value in latents.items():
        assert value.dtype == spec.dtype and value.shape == bridge.sites[name].unconstrained_shape


@given(spec=specs(), num_chains=st.integers(1, 3))
def test_constrain_and_unconstrain_are_inverse(spec, num_chains):
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    latents = _latents(bridge, spec.seed, num_chains=max(num_chains, 2))  # with a leading chain dim
    values = bridge.constrain(latents)
    for name, value in values.items():
        support = pyro.poutine.trace(model).get_trace(*args).nodes[name]["fn"].support
        assert bool(support.check(value).all()), name
    back = bridge.unconstrain(values)
    for name in latents:
        _close(back[name], latents[name], spec, scale=10.0)
    # and from the constrained side, on prior draws
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        trace = pyro.poutine.trace(model).get_trace(*args)
    prior = {name: trace.nodes[name]["value"] for name in bridge.sites}
    again = bridge.constrain(bridge.unconstrain(prior))
    for name in prior:
        _close(again[name], prior[name], spec)


@given(spec=specs())
def test_full_batch_log_posterior_is_pyros_log_joint_plus_the_log_det_jacobian(spec):
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    latents = _latents(bridge, spec.seed)
    values = bridge.constrain(latents)
    trace = _pyro_trace(model, args, values)
    expected = trace.log_prob_sum()
    for name, u in latents.items():
        transform = biject_to(trace.nodes[name]["fn"].support)
        expected = expected + _brute_force_log_det(name, transform, u)
    actual = bridge.log_posterior(latents, bridge.full_batch())
    assert actual.dtype == spec.dtype
    _close(actual, expected, spec, scale=float(expected.abs()))


@given(spec=specs(max_size=5))
def test_minibatch_estimates_average_to_the_full_data_value(spec):
    # every minibatch (all B-subsets of every subsampled plate) once: the plate's N/B scaling is unbiased exactly
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    latents = _latents(bridge, spec.seed)
    full = bridge.log_posterior(latents, bridge.full_batch())
    plates = data_plates(spec)
    choices = [[torch.tensor(c) for c in itertools.combinations(range(n), b)] for n, b in plates.values()]
    estimates = [
        bridge.log_posterior(latents, Batch(dict(zip(plates, chosen)), args, {}))
        for chosen in itertools.product(*choices)
    ]
    assert len(estimates) == num_minibatches(spec)
    _close(torch.stack(estimates).mean(), full, spec, scale=float(full.abs()))


@given(spec=specs(layouts=("scalar", "event", "nested", "counts")), seed=st.integers(0, 100))
def test_one_epoch_of_minibatches_averages_to_the_full_data_value(spec, seed):
    # B divides N: the minibatches of one epoch of the engines' sampler partition the data
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    if not bridge.plates or spec.size % spec.subsample:
        return
    latents = _latents(bridge, spec.seed)
    sampler = EpochSampler(bridge.plates, 2, torch.Generator().manual_seed(seed), torch.device("cpu"))
    epoch = [next(sampler) for _ in range(spec.size // spec.subsample)]
    for chain in range(2):
        visited = torch.cat([batch["data"][chain] for batch in epoch])
        assert sorted(visited.tolist()) == list(range(spec.size))
        estimates = [bridge.log_posterior(latents, Batch({"data": b["data"][chain]}, args, {})) for b in epoch]
        full = bridge.log_posterior(latents, bridge.full_batch())
        _close(torch.stack(estimates).mean(), full, spec, scale=float(full.abs()))


@given(spec=specs(), num_draws=st.integers(1, 3), data_chunk=st.integers(1, 7), draws_chunk=st.integers(1, 3))
def test_full_data_pointwise_log_likelihood_is_pyros_per_point_log_prob(spec, num_draws, data_chunk, draws_chunk):
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    draws = _latents(bridge, spec.seed, num_chains=max(num_draws, 2))
    values = full_data_log_likelihood(bridge, draws, data_chunk_size=data_chunk, draws_chunk_size=draws_chunk)
    assert set(values) == {"obs"}
    for s in range(num_draws):
        latents = {k: v[s] for k, v in draws.items()}
        node = _pyro_trace(model, args, bridge.constrain(latents)).nodes["obs"]
        expected = node["fn"].log_prob(node["value"])
        assert values["obs"][s].shape == expected.shape
        _close(values["obs"][s], expected, spec, scale=float(expected.abs().max()))
        pointwise = bridge.pointwise_log_likelihood(latents, bridge.full_batch())["obs"]
        _close(pointwise, expected, spec, scale=float(expected.abs().max()))


@given(spec=specs(layouts=("scalar", "event", "nested")), num_chains=st.integers(1, 3), seed=st.integers(0, 99))
def test_epoch_sampler_draws_disjoint_minibatches_within_an_epoch(spec, num_chains, seed):
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    sampler = EpochSampler(bridge.plates, num_chains, torch.Generator().manual_seed(seed), torch.device("cpu"))
    for plate in bridge.plates.values():
        batches = [next(sampler)[plate.name] for _ in range(plate.size // plate.subsample_size)]
        for c in range(num_chains):
            seen = torch.cat([b[c] for b in batches]).tolist()
            assert len(set(seen)) == len(seen) and all(0 <= i < plate.size for i in seen)


# ---------------------------------------------------------------------------------------------------- plates


@pytest.mark.parametrize("subsample", [None, 0, 1])
def test_an_empty_plate_is_a_model_error_naming_it(subsample):
    def model(y):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("visits", len(y), subsample_size=subsample) as idx:
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])

    with pytest.raises(ModelError, match=r"plate 'visits' has size 0"):
        ModelBridge(model, (torch.zeros(0, dtype=F64),))


def test_an_empty_inner_plate_is_a_model_error_naming_it():
    def model(y):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("data", y.shape[0], subsample_size=2, dim=-2) as idx, pyro.plate("feat", y.shape[1]):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])

    with pytest.raises(ModelError, match=r"plate 'feat' has size 0"):
        ModelBridge(model, (torch.zeros(5, 0, dtype=F64),))


def test_a_column_plate_smaller_than_the_rows_is_not_a_size_error():
    # regression: the row-count check compared every tensor's rows with every subsampled plate, so a subsampled
    # column plate (dim=-1) narrower than the number of rows was reported as "rows would never be visited"
    def model(y):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
        rows = pyro.plate("rows", y.shape[0], subsample_size=2, dim=-2)
        with rows as i, pyro.plate("cols", y.shape[1], subsample_size=1, dim=-1) as j:
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[i][:, j])

    bridge = ModelBridge(model, (torch.randn(5, 2, dtype=F64),))
    assert {p.name: p.size for p in bridge.plates.values()} == {"rows": 5, "cols": 2}


def test_a_subsample_size_larger_than_the_plate_is_a_model_error_naming_it():
    # regression: Pyro's "subsample_size does not match len(subsample), 5 vs 3" named neither plate nor fix
    def model(y):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("visits", len(y), subsample_size=5) as idx:
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])

    with pytest.raises(ModelError, match=r"plate 'visits' has subsample_size 5, more than its size 3"):
        ModelBridge(model, (torch.zeros(3, dtype=F64),))


@given(spec=specs(max_size=1), inner=st.just(1))
def test_size_one_plates_work(spec, inner):
    # N = 1 (B = 1 or none) and a size-1 inner plate: nothing to subsample, the full data is one point
    model, args = build(spec)
    bridge = ModelBridge(model, args)
    assert not bridge.plates or spec.layout == "two_plates"
    latents = _latents(bridge, spec.seed)
    trace = _pyro_trace(model, args, bridge.constrain(latents))
    values = full_data_log_likelihood(bridge, {k: v.unsqueeze(0) for k, v in latents.items()})
    expected = trace.nodes["obs"]["fn"].log_prob(trace.nodes["obs"]["value"])
    _close(values["obs"][0], expected, spec, scale=float(expected.abs().max()))


# ---------------------------------------------------------------------------------------------------- supports


class _FlatMatrixPrior(dist.TorchDistribution):
    """A flat prior over 2x2 matrices with the given support that can still be sampled (at the identity)."""

    arg_constraints: dict = {}

    def __init__(self, support):
        self._support = support
        super().__init__(torch.Size(), torch.Size([2, 2]))

    @property
    def support(self):
        return self._support

    def sample(self, sample_shape=()):
        return torch.eye(2, dtype=F64).expand(torch.Size(sample_shape) + (2, 2))

    def log_prob(self, value):
        return value.new_zeros(value.shape[:-2])


def _model_with(prior):
    def model(y):
        value = pyro.sample("L", prior())
        with pyro.plate("data", len(y), subsample_size=2) as idx:
            pyro.sample("obs", dist.Normal(value.sum(), 1.0), obs=y[idx])

    return model


@pytest.mark.parametrize(
    "prior",
    [
        lambda: _FlatMatrixPrior(dist.constraints.lower_cholesky),
        lambda: _FlatMatrixPrior(dist.constraints.positive_definite),
    ],
    ids=["lower_cholesky", "positive_definite"],
)
def test_a_support_without_a_bijection_is_a_model_error_naming_the_site(prior):
    # regression: biject_to's NotImplementedError escaped from ModelBridge without the site's name
    with pytest.raises(ModelError, match=r"latent site 'L' has support .* no bijection"):
        ModelBridge(_model_with(prior), (torch.randn(6, dtype=F64),))


def test_a_support_that_depends_on_another_latent_is_a_model_error_naming_the_site():
    # regression: the bridge fixed Uniform(0, upper)'s transform at the first trace's upper, so every later value
    # of `upper` got the wrong constrained value and log|det J| (a silently wrong posterior)
    def model(y):
        upper = pyro.sample("upper", dist.HalfNormal(y.new_tensor(2.0)))
        x = pyro.sample("x", dist.Uniform(y.new_tensor(0.0), upper))
        with pyro.plate("data", len(y), subsample_size=2) as idx:
            pyro.sample("obs", dist.Normal(x, 1.0), obs=y[idx])

    with pytest.raises(ModelError, match=r"latent site 'x' has a support that depends on other latents"):
        ModelBridge(model, (torch.randn(6, dtype=F64),))


def test_a_support_bound_fixed_by_the_data_is_fine():
    def model(y):
        x = pyro.sample("x", dist.Uniform(y.new_tensor(0.0), y.abs().max()))
        with pyro.plate("data", len(y), subsample_size=2) as idx:
            pyro.sample("obs", dist.Normal(x, 1.0), obs=y[idx])

    bridge = ModelBridge(model, (torch.randn(6, dtype=F64),))
    assert set(bridge.sites) == {"x"}


@pytest.mark.parametrize("batched", [False, True])
def test_permutations_are_uniform_and_independent_across_rows(batched, device):
    """All 24 orders of 4 items equally often: chi-square on 23 degrees of freedom below its 99.99% point."""
    from pyro_scalable.bridge.minibatches import permutations

    draws = 6000
    orders = permutations(4, draws, torch.Generator(device=device).manual_seed(5), device, batched=batched).cpu()
    assert bool((orders.sort(dim=1).values == torch.arange(4)).all())
    code = (orders * torch.tensor([64, 16, 4, 1])).sum(1)  # one integer per order
    counts = torch.bincount(torch.unique(code, return_inverse=True)[1], minlength=24).double()
    assert len(counts) == 24
    expected = draws / 24
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 57.1  # scipy.stats.chi2.ppf(0.9999, 23)
    # consecutive rows (two chains' orders) are independent: the pair of first items is uniform over 16 cells
    pairs = torch.bincount(orders[::2, 0] * 4 + orders[1::2, 0], minlength=16).double()
    expected = draws / 2 / 16
    assert float(((pairs - expected) ** 2 / expected).sum()) < 44.3  # scipy.stats.chi2.ppf(0.9999, 15)
