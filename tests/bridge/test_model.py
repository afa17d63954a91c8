"""The Pyro bridge: log posterior over unconstrained latents, N/B scaling, full-data mode, transforms, init."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import init_to_median, init_to_value
from torch.distributions import biject_to, constraints

from pyro_scalable import FullDataModel, ModelError
from pyro_scalable.bridge import Batch, ModelBridge, full_data, plate_indices
from pyro_scalable.infer import SGLD, StochasticMCMC

N, B, K = 12, 4, 3
F64 = torch.float64


def _t(value):
    return torch.tensor(value, dtype=F64)


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, K, generator=g, dtype=F64)
    y = torch.randn(N, generator=g, dtype=F64)
    z = torch.randn(N, K, generator=g, dtype=F64)
    counts = torch.poisson(torch.full((N,), 2.0, dtype=F64), generator=g)
    return x, y, z, counts


def constrained_model(x, y, z, counts):
    """One site per kind of support: real vector, positive (two priors), simplex, correlation Cholesky."""
    w = pyro.sample("w", dist.Normal(torch.zeros(K, dtype=F64), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(_t(2.0)))
    rate = pyro.sample("rate", dist.Gamma(_t(2.0), _t(3.0)))
    p = pyro.sample("p", dist.Dirichlet(_t([1.5, 2.0, 3.0])))
    chol = pyro.sample("L", dist.LKJCholesky(K, _t(2.0)))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ (w * p), sigma), obs=y[idx])
        pyro.sample("vec", dist.MultivariateNormal(torch.zeros(K, dtype=F64), scale_tril=chol), obs=z[idx])
        pyro.sample("counts", dist.Poisson(rate), obs=counts[idx])


def _random_latents(bridge, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(site.unconstrained_shape, generator=g, dtype=F64) for name, site in bridge.sites.items()}


def _logdet(transform, u, free):
    """log|det J| of u -> the free coordinates of transform(u), by brute-force autograd."""
    jacobian = torch.func.jacrev(lambda v: free(transform(v)))(u)
    return torch.linalg.slogdet(jacobian.reshape(u.numel(), u.numel())).logabsdet


def _hand_log_joint(latents, x, y, z, counts):
    """Prior + log|det J| + full-data log-likelihood, from torch.distributions and autograd only."""
    u = latents
    w = u["w"]
    sigma, rate = u["sigma"].exp(), u["rate"].exp()  # exp: log|det J| = u
    simplex, corr = biject_to(constraints.simplex), biject_to(constraints.corr_cholesky)
    p, chol = simplex(u["p"]), corr(u["L"])
    lower = torch.tril_indices(K, K, -1)
    td = torch.distributions
    log_prior = (
        td.Normal(torch.zeros(K, dtype=F64), 1.0).log_prob(w).sum()
        + td.HalfNormal(_t(2.0)).log_prob(sigma)
        + u["sigma"]
        + td.Gamma(_t(2.0), _t(3.0)).log_prob(rate)
        + u["rate"]
        + td.Dirichlet(_t([1.5, 2.0, 3.0])).log_prob(p)
        + _logdet(simplex, u["p"], lambda v: v[:-1])
        + td.LKJCholesky(K, _t(2.0)).log_prob(chol)
        + _logdet(corr, u["L"], lambda m: m[lower[0], lower[1]])
    )
    log_lik = (
        td.Normal(x @ (w * p), sigma).log_prob(y).sum()
        + td.MultivariateNormal(torch.zeros(K, dtype=F64), scale_tril=chol).log_prob(z).sum()
        + td.Poisson(rate).log_prob(counts).sum()
    )
    return log_prior + log_lik


# ---------------------------------------------------------------------------------------------------- sites


def test_sites_shapes_and_transforms(data):
    bridge = ModelBridge(constrained_model, data)
    shapes = {name: (tuple(s.shape), tuple(s.unconstrained_shape)) for name, s in bridge.sites.items()}
    assert shapes == {
        "w": ((K,), (K,)),
        "sigma": ((), ()),
        "rate": ((), ()),
        "p": ((K,), (K - 1,)),
        "L": ((K, K), (K * (K - 1) // 2,)),
    }
    assert set(bridge.observed) == {"obs", "vec", "counts"}
    assert bridge.observed["obs"] == {-1: "data"}
    assert bridge.observed["vec"] == {-1: "data"}  # counted from the right of the batch shape
    assert bridge.observed_event_dims == {"obs": 0, "vec": 1, "counts": 0}
    assert bridge.plates["data"].size == N and bridge.plates["data"].subsample_size == B


# ---------------------------------------------------------------------------------------------------- log posterior


@pytest.mark.parametrize("seed", range(3))
def test_full_batch_log_posterior_is_the_hand_computed_log_joint(data, seed):
    bridge = ModelBridge(constrained_model, data)
    latents = _random_latents(bridge, seed)
    value = bridge.log_posterior(latents, bridge.full_batch())
    assert value.dtype == F64 and value.shape == ()
    torch.testing.assert_close(value, _hand_log_joint(latents, *data), rtol=1e-12, atol=1e-10)


def test_log_posterior_gradient_matches_the_hand_computation(data):
    bridge = ModelBridge(constrained_model, data)
    latents = _random_latents(bridge, 7)
    grads = torch.func.grad(bridge.log_posterior)(latents, bridge.full_batch())
    expected = torch.func.grad(lambda u: _hand_log_joint(u, *data))(latents)
    for name in latents:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-10, atol=1e-10)


def _minibatch_log_posteriors(bridge, latents, partition):
    return torch.stack(
        [bridge.log_posterior(latents, Batch({"data": idx}, bridge.args, bridge.kwargs)) for idx in partition]
    )


@pytest.mark.parametrize("shuffle", [False, True])
def test_minibatch_estimates_average_to_the_full_data_log_joint(data, shuffle):
    # Each minibatch scales its log-likelihood by N/B; over a partition of range(N) into N/B minibatches the
    # average of those estimates is exactly the full-data log joint.
    bridge = ModelBridge(constrained_model, data)
    latents = _random_latents(bridge, 3)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0)) if shuffle else torch.arange(N)
    estimates = _minibatch_log_posteriors(bridge, latents, order.split(B))
    assert estimates.std() > 1e-3  # the minibatches really differ
    full = bridge.log_posterior(latents, bridge.full_batch())
    torch.testing.assert_close(estimates.mean(), full, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(full, _hand_log_joint(latents, *data), rtol=1e-12, atol=1e-10)


def test_minibatch_estimate_is_prior_plus_scaled_likelihood(data):
    bridge = ModelBridge(constrained_model, data)
    latents = _random_latents(bridge, 4)
    idx = torch.tensor([7, 0, 3, 11])
    minibatch = bridge.log_posterior(latents, Batch({"data": idx}, bridge.args, bridge.kwargs))
    pointwise = bridge.pointwise_log_likelihood(latents, bridge.full_batch())
    full = bridge.log_posterior(latents, bridge.full_batch())
    log_prior = full - sum(v.sum() for v in pointwise.values())
    expected = log_prior + (N / B) * sum(v[idx].sum() for v in pointwise.values())
    torch.testing.assert_close(minibatch, expected, rtol=1e-12, atol=1e-10)


def test_plate_indices_sets_the_pyro_scale(data):
    idx = torch.tensor([1, 5, 9, 2])
    with plate_indices({"data": idx}):
        trace = pyro.poutine.trace(constrained_model).get_trace(*data)
    assert torch.equal(trace.nodes["obs"]["value"], data[1][idx])
    assert trace.nodes["obs"]["scale"] == N / B
    assert trace.nodes["w"]["scale"] == 1.0


def test_subsample_idx_style_averages_to_the_full_data_log_joint(data):
    x, y = data[0], data[1]

    def model(x, y, idx=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(K, dtype=F64), 1.0).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(_t(2.0)))
        with pyro.plate("data", N, subsample=idx):
            pyro.sample("obs", dist.Normal(x @ w, sigma), obs=y)

    full_bridge = ModelBridge(model, (x, y))
    assert full_bridge.plates == {}  # no subsampling on the full data
    latents = _random_latents(full_bridge, 5)
    full = full_bridge.log_posterior(latents, full_bridge.full_batch())
    estimates = []
    for idx in torch.arange(N).split(B):
        bridge = ModelBridge(model, (x[idx], y[idx], idx))
        estimates.append(bridge.log_posterior(latents, Batch({}, bridge.args, bridge.kwargs)))
    torch.testing.assert_close(torch.stack(estimates).mean(), full, rtol=1e-12, atol=1e-10)
    sigma = latents["sigma"].exp()
    expected = (
        torch.distributions.Normal(torch.zeros(K, dtype=F64), 1.0).log_prob(latents["w"]).sum()
        + torch.distributions.HalfNormal(_t(2.0)).log_prob(sigma)
        + latents["sigma"]
        + torch.distributions.Normal(x @ latents["w"], sigma).log_prob(y).sum()
    )
    torch.testing.assert_close(full, expected, rtol=1e-12, atol=1e-10)


def test_log_posterior_vmaps_over_chains_and_minibatches(data):
    bridge = ModelBridge(constrained_model, data)
    chains = [_random_latents(bridge, s) for s in range(3)]
    stacked = {name: torch.stack([c[name] for c in chains]) for name in chains[0]}
    indices = torch.stack([torch.arange(N)[s : s + B] for s in range(3)])
    batched = torch.func.vmap(lambda u, i: bridge.log_posterior(u, Batch({"data": i}, bridge.args, bridge.kwargs)))(
        stacked, indices
    )
    looped = torch.stack(
        [bridge.log_posterior(c, Batch({"data": i}, bridge.args, bridge.kwargs)) for c, i in zip(chains, indices)]
    )
    torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-10)


def test_pointwise_log_likelihood_is_unscaled_and_covers_the_batch(data):
    x, y, z, counts = data
    bridge = ModelBridge(constrained_model, data)
    latents = _random_latents(bridge, 6)
    values = bridge.constrain(latents)
    pointwise = bridge.pointwise_log_likelihood(latents, bridge.full_batch())
    assert {k: tuple(v.shape) for k, v in pointwise.items()} == {"obs": (N,), "vec": (N,), "counts": (N,)}
    expected = torch.distributions.Normal(x @ (values["w"] * values["p"]), values["sigma"]).log_prob(y)
    torch.testing.assert_close(pointwise["obs"], expected, rtol=1e-12, atol=1e-12)
    idx = torch.tensor([2, 3])
    part = bridge.pointwise_log_likelihood(latents, Batch({"data": idx}, bridge.args, bridge.kwargs))
    torch.testing.assert_close(part["counts"], pointwise["counts"][idx], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------- full data


def _check_full_trace(trace, y):
    assert torch.equal(trace.nodes["obs"]["value"], y)
    assert trace.nodes["obs"]["scale"] == 1.0
    assert trace.nodes["counts"]["value"].shape == (N,)


def test_full_data_model_gives_the_full_data_trace(data):
    full = FullDataModel(constrained_model)
    assert full.model is constrained_model
    assert FullDataModel(full).model is constrained_model  # no double wrapping
    _check_full_trace(pyro.poutine.trace(full).get_trace(*data), data[1])


def test_full_data_context_gives_the_full_data_trace(data):
    with full_data():
        trace = pyro.poutine.trace(constrained_model).get_trace(*data)
    _check_full_trace(trace, data[1])
    outside = pyro.poutine.trace(constrained_model).get_trace(*data)  # the override is gone
    assert outside.nodes["obs"]["value"].shape == (B,)
    assert outside.nodes["obs"]["scale"] == N / B


def test_explicit_indices_win_over_full_data(data):
    idx = torch.tensor([0, 4])
    with full_data(), plate_indices({"data": idx}):
        trace = pyro.poutine.trace(constrained_model).get_trace(*data)
    assert torch.equal(trace.nodes["obs"]["value"], data[1][idx])
    assert trace.nodes["obs"]["scale"] == N / 2


def test_observed_data_is_the_full_data(data):
    bridge = ModelBridge(constrained_model, data)
    observed = bridge.observed_data()
    assert torch.equal(observed["obs"], data[1])
    assert torch.equal(observed["vec"], data[2])
    assert torch.equal(observed["counts"], data[3])


def test_bridge_unwraps_full_data_model(data):
    bridge = ModelBridge(FullDataModel(constrained_model), data)
    assert bridge.model is constrained_model
    assert bridge.plates["data"].subsample_size == B  # still subsampled: the engine controls the plate


# ---------------------------------------------------------------------------------------------------- transforms


def test_constrain_unconstrain_round_trip_with_batch_dims(data):
    bridge = ModelBridge(constrained_model, data)
    g = torch.Generator().manual_seed(2)
    latents = {
        name: torch.randn((4, 5) + tuple(site.unconstrained_shape), generator=g, dtype=F64)
        for name, site in bridge.sites.items()
    }
    values = bridge.constrain(latents)
    assert {k: tuple(v.shape[2:]) for k, v in values.items()} == {k: tuple(s.shape) for k, s in bridge.sites.items()}
    assert (values["sigma"] > 0).all() and (values["rate"] > 0).all()
    torch.testing.assert_close(values["p"].sum(-1), torch.ones(4, 5, dtype=F64))
    assert constraints.corr_cholesky.check(values["L"]).all()
    back = bridge.unconstrain(values)
    for name in latents:
        torch.testing.assert_close(back[name], latents[name], rtol=1e-9, atol=1e-9)


def test_unconstrain_constrain_round_trip_of_prior_draws(data):
    bridge = ModelBridge(constrained_model, data)
    pyro.set_rng_seed(0)
    trace = pyro.poutine.trace(constrained_model).get_trace(*data)
    values = {name: trace.nodes[name]["value"] for name in bridge.sites}
    again = bridge.constrain(bridge.unconstrain(values))
    for name in values:
        torch.testing.assert_close(again[name], values[name], rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------------- init


def test_init_latents_distinct_chains_and_seeded(data):
    bridge = ModelBridge(constrained_model, data)
    first = bridge.init_latents(4, seed=0)
    assert {k: tuple(v.shape) for k, v in first.items()} == {
        k: (4,) + tuple(s.unconstrained_shape) for k, s in bridge.sites.items()
    }
    for name, value in first.items():
        assert value.dtype == F64
        assert torch.isfinite(value).all()
        flat = value.reshape(4, -1)
        assert torch.cdist(flat, flat)[~torch.eye(4, dtype=torch.bool)].min() > 0, name
    again = bridge.init_latents(4, seed=0)
    other = bridge.init_latents(4, seed=1)
    for name in first:
        assert torch.equal(first[name], again[name])
        assert not torch.equal(first[name], other[name])
    for c in range(4):
        chain = {k: v[c] for k, v in first.items()}
        assert torch.isfinite(bridge.log_posterior(chain, bridge.full_batch()))


def test_init_latents_leaves_the_global_rng_alone(data):
    bridge = ModelBridge(constrained_model, data)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    bridge.init_latents(3, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_init_latents_uses_the_init_strategy(data):
    bridge = ModelBridge(constrained_model, data)
    latents = bridge.init_latents(3, init_strategy=init_to_median(num_samples=15), seed=0)
    # the median strategy is deterministic up to its own Monte Carlo: every chain starts near the same point
    assert latents["w"].abs().max() < 1.0


_VALUES = {  # init_to_value's values that no chain can start from: site, value, what the error says of it
    "nan": ("sigma", _t(float("nan")), r"the value nan, which is not finite"),
    "inf": ("w", _t([0.0, float("inf"), 0.0]), r"the value inf \(at 1 of 3 entries\), which is not finite"),
    "outside": ("sigma", _t(-1.0), r"the value -1, outside its support GreaterThanEq\(lower_bound=0\.0\)"),
    "simplex": ("p", _t([0.5, 0.5, 0.5]), r"the value tensor of shape \(3,\), outside its support Simplex\(\)"),
    "shape": ("w", _t([0.0, 1.0]), r"a value of shape \(2,\), but the site's shape is \(3,\)"),
}


@pytest.mark.parametrize("case", list(_VALUES))
def test_an_initial_value_no_chain_can_start_from_is_named_with_the_site(data, case):
    # Before, a NaN or out-of-support value ran to the end with every step divergent (and advice to reparametrise);
    # a wrong shape failed with the model's raw size mismatch.
    site, value, said = _VALUES[case]
    bridge = ModelBridge(constrained_model, data)
    with pytest.raises(ModelError, match=rf"^init_strategy gave latent site '{site}' {said}: give init_to_value") as e:
        bridge.init_latents(2, init_strategy=init_to_value(values={site: value}), seed=0)
    assert "\n" not in str(e.value)  # one line: without the trace's shapes


def test_a_bad_initial_value_stops_a_run_before_its_first_step(data):
    init = init_to_value(values={"sigma": _t(float("nan"))})
    mcmc = StochasticMCMC(
        SGLD(constrained_model, step_size=1e-3, init_strategy=init), num_samples=5, progress_bar=False
    )
    with pytest.raises(ModelError, match=r"latent site 'sigma' the value nan"):
        mcmc.run(*data)
    assert mcmc.results is None  # no draw, no step


def test_valid_initial_values_pass_and_are_used(data):
    bridge = ModelBridge(constrained_model, data)
    latents = bridge.init_latents(2, init_strategy=init_to_value(values={"sigma": _t(0.5), "w": _t([1.0, 2.0, 3.0])}))
    torch.testing.assert_close(latents["sigma"], torch.log(_t([0.5, 0.5])))
    torch.testing.assert_close(latents["w"][1], _t([1.0, 2.0, 3.0]))
