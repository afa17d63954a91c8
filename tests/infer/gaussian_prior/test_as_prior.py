"""A Gaussian posterior as the next episode's prior (``as_prior``): gold tests against closed forms.

* the chain of per-site conditionals has the joint's log-density, for every form, with a constrained site;
* its draws have the joint's mean and covariance (Monte-Carlo tolerances);
* two episodes — the first's Laplace posterior as the second's prior — give the posterior on both episodes' data,
  to rounding (``full``, ``kron`` where K-FAC is exact, ``low_rank`` at full rank), and ``diag`` gives EWC;
* SWAG's and MultiSWAG's prior has their (mixture's) mean and covariance; the engines read the prior (NUTS).
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS
from pyro.nn import PyroModule, PyroSample
from torch.distributions import biject_to, constraints

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer import SWAG, AutoLinearizedLaplace, SampleThenOptimize
from pyro_scalable.infer.gaussian_prior import GaussianPriorModel, JointGaussian, SiteSpec
from pyro_scalable.infer.gaussian_prior.shrinkage import shrink_to_diagonal, shrinkage_intensity

D = torch.float64

# three sites: a real vector, a positive scalar (a Jacobian), a real matrix
SPECS = [
    SiteSpec("a", torch.Size([3]), torch.Size([3]), constraints.independent(constraints.real, 1)),
    SiteSpec("s", torch.Size([]), torch.Size([]), constraints.positive),
    SiteSpec("m", torch.Size([2, 2]), torch.Size([2, 2]), constraints.independent(constraints.real, 2)),
]


def three_sites():
    pyro.sample("a", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
    pyro.sample("s", dist.LogNormal(torch.tensor(0.0, dtype=D), 1.0))
    pyro.sample("m", dist.Normal(torch.zeros(2, 2, dtype=D), 1.0).to_event(2))


def random_joint(kind: str, seed: int = 0) -> tuple[JointGaussian, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = 8
    mean = torch.randn(d, generator=g, dtype=D)
    diag = torch.rand(d, generator=g, dtype=D) + 0.2
    factor = torch.randn(d, 3, generator=g, dtype=D)
    if kind == "dense":
        root = torch.randn(d, d, generator=g, dtype=D)
        covariance = root @ root.T / d + torch.diag(diag)
        return JointGaussian.dense(SPECS, mean, covariance), covariance
    if kind == "diagonal":
        return JointGaussian.diagonal(SPECS, mean, diag), torch.diag(diag)
    if kind == "low_rank_covariance":
        return JointGaussian.low_rank_covariance(SPECS, mean, diag, factor), torch.diag(diag) + factor @ factor.T
    precision = torch.diag(diag) + factor @ factor.T
    return JointGaussian.low_rank_precision(SPECS, mean, diag, factor), torch.linalg.inv(precision)


KINDS = ["dense", "diagonal", "low_rank_covariance", "low_rank_precision"]


def flat_unconstrained(values: dict) -> torch.Tensor:
    parts = [
        biject_to(spec.support)
        .inv(values[spec.name])
        .reshape(values[spec.name].shape[: -len(spec.shape) or None] + (-1,))
        for spec in SPECS
    ]
    return torch.cat(parts, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_the_chain_of_conditionals_is_the_joint_density(kind):
    joint, covariance = random_joint(kind)
    prior = GaussianPriorModel(three_sites, joint)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        values = {"a": torch.randn(3, generator=g, dtype=D), "s": torch.rand((), generator=g, dtype=D) + 0.1}
        values["m"] = torch.randn(2, 2, generator=g, dtype=D)
        trace = pyro.poutine.trace(pyro.poutine.condition(prior, values)).get_trace()
        total = trace.log_prob_sum()
        u = flat_unconstrained(values)
        # the Gaussian in unconstrained space, less log|det J| of the positive site (u_s = log s)
        expected = dist.MultivariateNormal(joint.mean, covariance).log_prob(u) - values["s"].log()
        assert torch.allclose(total, expected, rtol=1e-10, atol=1e-10)
    assert torch.allclose(joint.covariance_matrix(), covariance, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_drawing_the_sites_in_turn_draws_the_joint(kind):
    joint, covariance = random_joint(kind, seed=2)
    prior = GaussianPriorModel(three_sites, joint)
    n = 4000
    pyro.set_rng_seed(0)
    draws = pyro.infer.Predictive(prior, num_samples=n, parallel=True)()  # vectorised: expand() works
    u = flat_unconstrained(draws)
    sd = covariance.diagonal().sqrt()
    # means within 4.5 Monte-Carlo standard errors; covariances within 4.5 of their standard errors
    assert ((u.mean(0) - joint.mean).abs() <= 4.5 * sd / math.sqrt(n)).all()
    empirical = torch.cov(u.T)
    error = (covariance.diagonal()[:, None] * covariance.diagonal()[None, :] + covariance**2).sqrt() / math.sqrt(n)
    assert ((empirical - covariance).abs() <= 4.5 * error).all()


# ---------------------------------------------------------------------------- two episodes, Laplace
P, SIGMA, PRIOR_W, PRIOR_B = 3, 0.5, 1.3, 2.0


def linear_model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=x.dtype), PRIOR_W).to_event(1))
    b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=x.dtype), PRIOR_B))
    with pyro.plate("data", x.shape[0], subsample_size=20) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w + b, SIGMA), obs=None if y is None else y[idx])


def episodes(dtype=D):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(160, P, generator=g, dtype=D)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=D) + 0.7 + SIGMA * torch.randn(160, generator=g, dtype=D)
    x[80:] += 1.5  # the second episode's inputs are shifted
    return (x[:80].to(dtype), y[:80].to(dtype)), (x[80:].to(dtype), y[80:].to(dtype))


def exact_posterior(*data):
    precision = torch.diag(torch.tensor([PRIOR_W**-2] * P + [PRIOR_B**-2], dtype=D))
    rhs = torch.zeros(P + 1, dtype=D)
    for x, y in data:
        design = torch.cat([x.to(D), torch.ones(len(x), 1, dtype=D)], 1)
        precision = precision + design.T @ design / SIGMA**2
        rhs = rhs + design.T @ y.to(D) / SIGMA**2
    return torch.linalg.solve(precision, rhs), precision


def at(mean):
    return {"w": mean[:P], "b": mean[P]}


@pytest.mark.parametrize("structure", ["full", "kron", "low_rank"])
def test_two_episodes_give_the_posterior_on_both(structure):
    first, second = episodes()
    mean1, _ = exact_posterior(first)
    options = {"rank": P + 1} if structure == "low_rank" else {}
    posterior1 = AutoLinearizedLaplace(linear_model).laplace_approximation(
        *first, structure=structure, map_latents=at(mean1), **options
    )
    prior = posterior1.as_prior()
    # started away from the answer: the full structure's Newton-moved mean is exact for a linear-Gaussian model
    posterior2 = AutoLinearizedLaplace(prior).laplace_approximation(
        *second, structure="full", map_latents=at(torch.zeros(P + 1, dtype=D)), check_map=False
    )
    mean, precision = exact_posterior(first, second)
    assert torch.allclose(posterior2.mean, mean, rtol=1e-9, atol=1e-9)
    assert torch.allclose(posterior2.precision.to_dense(), precision, rtol=1e-9, atol=1e-9)


def test_two_episodes_in_float32():
    first, second = episodes(torch.float32)
    mean1, _ = exact_posterior(first)
    posterior1 = AutoLinearizedLaplace(linear_model).laplace_approximation(
        *first, structure="full", map_latents=at(mean1.float())
    )
    posterior2 = AutoLinearizedLaplace(posterior1.as_prior()).laplace_approximation(
        *second, structure="full", map_latents=at(torch.zeros(P + 1)), check_map=False
    )
    mean, precision = exact_posterior(first, second)
    sd = torch.linalg.inv(precision).diagonal().sqrt()
    assert posterior2.mean.dtype == torch.float32
    assert ((posterior2.mean.double() - mean).abs() / sd).max() < 1e-3


def test_diag_as_prior_is_the_ewc_update():
    first, second = episodes()
    mean1, _ = exact_posterior(first)
    posterior1 = AutoLinearizedLaplace(linear_model).laplace_approximation(
        *first, structure="diag", map_latents=at(mean1)
    )
    posterior2 = AutoLinearizedLaplace(posterior1.as_prior()).laplace_approximation(
        *second, structure="diag", map_latents=at(mean1), check_map=False
    )
    # the second prior is N(mean1, diag(H1)^-1); the second precision the diagonal of the joint Hessian
    assert torch.allclose(posterior2.prior_precision, posterior1.precision.diagonal, rtol=1e-12)
    assert torch.allclose(posterior2.prior_mean, mean1, rtol=1e-12)
    _, precision = exact_posterior(first, second)
    assert torch.allclose(posterior2.precision.diagonal, precision.diagonal(), rtol=1e-10)


def test_a_correlated_prior_needs_a_structure_that_holds_it():
    first, second = episodes()
    mean1, _ = exact_posterior(first)
    posterior1 = AutoLinearizedLaplace(linear_model).laplace_approximation(
        *first, structure="full", map_latents=at(mean1)
    )
    prior = posterior1.as_prior()
    with pytest.raises(ModelError, match="structure='full'"):
        AutoLinearizedLaplace(prior).laplace_approximation(*second, structure="diag", map_latents=at(mean1))
    posterior2 = AutoLinearizedLaplace(prior).laplace_approximation(
        *second, structure="full", map_latents=at(mean1), check_map=False
    )
    with pytest.raises(ModelError, match="previous posterior"):
        posterior2.optimize_prior_precision()
    engine = SampleThenOptimize(prior, num_samples=4, num_epochs=1)
    with pytest.raises(ModelError, match="factorised prior"):
        engine.run(*second)


def test_the_next_model_must_sample_the_same_sites_in_order():
    first, second = episodes()
    mean1, _ = exact_posterior(first)
    posterior1 = AutoLinearizedLaplace(linear_model).laplace_approximation(
        *first, structure="full", map_latents=at(mean1)
    )

    def swapped(x, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), PRIOR_B))
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=D), PRIOR_W).to_event(1))
        pyro.sample("obs", dist.Normal(x @ w + b, SIGMA).to_event(1), obs=y)

    def wider(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(P + 1, dtype=D), PRIOR_W).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), PRIOR_B))
        pyro.sample("obs", dist.Normal(x @ w[:P] + b, SIGMA).to_event(1), obs=y)

    with pytest.raises(ModelError, match="came in the model before 'w'"):
        posterior1.as_prior(swapped)(*second)
    with pytest.raises(ModelError, match="same latent sites"):
        posterior1.as_prior(wider)(*second)


def test_nuts_on_the_prior_model_samples_the_posterior_on_both_episodes():
    first, second = episodes()
    mean1, _ = exact_posterior(first)
    posterior1 = AutoLinearizedLaplace(linear_model).laplace_approximation(
        *first, structure="full", map_latents=at(mean1)
    )

    def episode_two(x, y):  # NUTS reads the likelihood on all of the data: no subsampled plate
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=D), PRIOR_W).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), PRIOR_B))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(x @ w + b, SIGMA), obs=y)

    pyro.set_rng_seed(0)
    n = 600
    mcmc = MCMC(NUTS(posterior1.as_prior(episode_two)), num_samples=n, warmup_steps=300, disable_progbar=True)
    mcmc.run(*second)
    samples = mcmc.get_samples()
    draws = torch.cat([samples["w"], samples["b"][:, None]], 1)
    mean, precision = exact_posterior(first, second)
    sd = torch.linalg.inv(precision).diagonal().sqrt()
    # NUTS on a Gaussian is near-independent; allow an ESS of n/3 per coordinate
    assert ((draws.mean(0) - mean).abs() <= 4.5 * sd / math.sqrt(n / 3)).all()
    assert ((draws.std(0) / sd - 1).abs() < 0.2).all()


def test_the_bridge_reads_the_prior_under_vmap():
    joint, covariance = random_joint("low_rank_covariance", seed=4)

    def model(y):
        three_sites()
        pyro.sample("obs", dist.Normal(torch.tensor(0.0, dtype=D), 1.0), obs=y)

    bridge = ModelBridge(GaussianPriorModel(model, joint), (torch.tensor(0.3, dtype=D),))
    u = torch.randn(5, 8, dtype=D, generator=torch.Generator().manual_seed(5))

    def log_joint(flat):
        latents = {"a": flat[:3], "s": flat[3], "m": flat[4:].reshape(2, 2)}
        return bridge.log_posterior(latents, bridge.full_batch())

    values = torch.func.vmap(log_joint)(u)
    expected = dist.MultivariateNormal(joint.mean, covariance).log_prob(u) + dist.Normal(0.0, 1.0).log_prob(
        torch.tensor(0.3, dtype=D)
    )
    assert torch.allclose(values, expected, rtol=1e-10)


# ---------------------------------------------------------------------------- SWAG
def test_swag_and_multiswag_priors_keep_their_mean_and_covariance():
    first, _ = episodes()
    for runs in (1, 3):
        posterior = SWAG(linear_model, num_epochs=6, rank=5, num_runs=runs, seed=0, progress_bar=False).run(*first)
        joint = posterior.as_prior().joint
        means = posterior.mean
        mixture = sum(posterior.covariance_matrix(r) for r in range(runs)) / runs
        spread = means - means.mean(0)
        mixture = mixture + spread.T @ spread / runs
        assert torch.allclose(joint.mean, means.mean(0).to(joint.mean.dtype), rtol=1e-6, atol=1e-8)
        assert torch.allclose(joint.covariance_matrix().double(), mixture.double(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", KINDS)
def test_precision_diagonal(kind):
    joint, covariance = random_joint(kind, seed=6)
    assert torch.allclose(joint.precision_diagonal(), torch.linalg.inv(covariance).diagonal(), rtol=1e-9)


def test_swag_gives_unmoved_coordinates_the_prior_variance():
    first, _ = episodes()
    x = torch.cat([first[0], torch.zeros(len(first[0]), 1, dtype=D)], 1)  # a fourth input that is always zero

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(P + 1, dtype=x.dtype), PRIOR_W).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=x.dtype), PRIOR_B))
        with pyro.plate("data", x.shape[0], subsample_size=20) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w + b, SIGMA), obs=None if y is None else y[idx])

    posterior = SWAG(model, num_epochs=4, rank=5, seed=0, progress_bar=False).run(x, first[1])
    assert float(posterior.variance[0, P]) < 1e-6 * PRIOR_W**2  # SGD never moved the weight of the zero input
    joint = posterior.as_prior().joint
    assert posterior.stats["prior_coordinates"] == 1
    assert torch.allclose(joint.covariance_matrix()[P, P], torch.tensor(PRIOR_W**2, dtype=joint.mean.dtype))


def test_swag_as_prior_warns_when_its_step_was_capped():
    """A stiff direction without noise (a sharp prior on b) caps lr='auto'; the narrowed Gaussian is named."""
    first, _ = episodes()

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=x.dtype), PRIOR_W).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1e-3))
        with pyro.plate("data", x.shape[0], subsample_size=20) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w + b, SIGMA), obs=None if y is None else y[idx])

    with pytest.warns(UserWarning, match="lr='auto': Mandt's rate"):
        posterior = SWAG(model, num_epochs=4, rank=5, seed=0, progress_bar=False).run(*first)
    assert posterior.stats["lr"] < posterior.stats["lr_noise"] / 10
    with pytest.warns(UserWarning, match="as_prior: SWAG ran at lr="):
        posterior.as_prior()


# ---------------------------------------------------------------------------- kron, without d x d
class _TwoLayer(PyroModule):
    """2-5-1 tanh net in float64, weights sampled before biases (one layer with a bias prior of its own), and a
    scalar ``shift`` outside any layer."""

    def __init__(self):
        super().__init__()
        zero = torch.tensor(0.0, dtype=D)
        self.hidden = PyroModule[torch.nn.Linear](2, 5)
        self.hidden.weight = PyroSample(dist.Normal(zero, 1.0).expand([5, 2]).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(zero, 2.0).expand([5]).to_event(1))  # a prior of its own
        self.out = PyroModule[torch.nn.Linear](5, 1)
        self.out.weight = PyroSample(dist.Normal(zero, 0.7).expand([1, 5]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(zero, 0.7).expand([1]).to_event(1))

    def forward(self, x, y=None):
        shift = pyro.sample("shift", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        hidden_weight, hidden_bias = self.hidden.weight, self.hidden.bias
        out_weight, out_bias = self.out.weight, self.out.bias
        with pyro.plate("data", x.shape[0], subsample_size=min(16, x.shape[0])) as idx:
            hidden = torch.tanh(torch.nn.functional.linear(x[idx], hidden_weight, hidden_bias))
            f = torch.nn.functional.linear(hidden, out_weight, out_bias)
            pyro.sample("y", dist.Normal(f.squeeze(-1) + shift, 0.3), obs=None if y is None else y[idx])


def _kron_posterior():
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 2, generator=g, dtype=D)
    y = torch.sin(x[:, 0]) + 0.3 * torch.randn(64, generator=g, dtype=D)
    net = _TwoLayer()
    bridge = ModelBridge(net, (x, y))
    point = {name: 0.5 * torch.randn(site.shape, generator=g, dtype=D) for name, site in bridge.sites.items()}
    posterior = AutoLinearizedLaplace(net).laplace_approximation(
        x, y, structure="kron", map_latents=point, check_map=False
    )
    return net, posterior


def test_kron_as_prior_is_the_kfac_gaussian_without_a_dense_matrix():
    """The chain of per-site conditionals (weight marginal, bias given weight, the diagonal rest) is N(μ, H⁻¹)."""
    net, posterior = _kron_posterior()
    prior = posterior.as_prior()
    joint = prior.joint
    assert joint.kind == "kron" and len(joint.splits) == 2  # each layer's weight and bias: a marginal, a conditional
    precision = posterior.precision.to_dense().double()
    assert torch.allclose(joint.precision_matrix(), precision, rtol=1e-10, atol=1e-12)
    assert torch.allclose(joint.precision_diagonal(), precision.diagonal(), rtol=1e-10, atol=1e-12)
    names = [site.name for site in joint.sites]
    assert names == ["shift", "hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    g = torch.Generator().manual_seed(9)
    reference = dist.MultivariateNormal(joint.mean, precision_matrix=precision)
    x = torch.randn(3, 2, dtype=D)
    for _ in range(3):
        u = reference.sample() + 0.3 * torch.randn(joint.num_params, generator=g, dtype=D)
        values = {site.name: u[rows].reshape(site.shape) for site, rows in zip(joint.sites, joint.slices)}
        trace = pyro.poutine.trace(pyro.poutine.condition(prior, values)).get_trace(x)
        total = sum(site["fn"].log_prob(site["value"]).sum() for name, site in trace.nodes.items() if name in values)
        assert torch.allclose(total, reference.log_prob(u), rtol=1e-10, atol=1e-10)


def test_kron_as_prior_draws_and_vmap():
    net, posterior = _kron_posterior()
    prior = posterior.as_prior()
    joint = prior.joint
    covariance = joint.covariance_matrix()
    n = 2000
    pyro.set_rng_seed(0)
    x = torch.randn(3, 2, dtype=D)
    # one model run per draw (the net does not broadcast over draws): each site from its conditional in turn
    draws = pyro.infer.Predictive(prior, num_samples=n, return_sites=[s.name for s in joint.sites])(x)
    u = torch.cat([draws[s.name].reshape(n, -1) for s in joint.sites], -1)
    sd = covariance.diagonal().sqrt()
    assert ((u.mean(0) - joint.mean).abs() <= 4.5 * sd / math.sqrt(n)).all()
    error = (covariance.diagonal()[:, None] * covariance.diagonal()[None, :] + covariance**2).sqrt() / math.sqrt(n)
    assert ((torch.cov(u.T) - covariance).abs() <= 4.5 * error).all()
    # the bridge reads the prior under vmap: the same log joint as one point at a time
    bridge = ModelBridge(prior, (x, torch.zeros(3, dtype=D)))
    flats = dist.MultivariateNormal(joint.mean, covariance).sample((4,))

    def log_joint(flat):
        latents = {s.name: flat[rows].reshape(s.shape) for s, rows in zip(joint.sites, joint.slices)}
        return bridge.log_posterior(latents, bridge.full_batch())

    values = torch.func.vmap(log_joint)(flats)
    one_by_one = torch.stack([log_joint(flat) for flat in flats])
    assert torch.allclose(values, one_by_one, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------- sample-then-optimise
def test_sample_then_optimize_diagonal_prior_is_the_draws_variances_and_feeds_the_next_run():
    """N(mean, diag(mean ζ²)): the exact mean, the marginal variances within Monte-Carlo error; read by the next run."""
    first, second = episodes()
    num_samples = 1000
    options = {"num_epochs": 150, "variance_reduction": "all", "seed": 0, "progress_bar": False}
    engine = SampleThenOptimize(linear_model, num_samples=num_samples, **options)
    engine.run(*first)
    mean1, precision1 = exact_posterior(first)
    joint = engine.as_prior(correlations="diagonal").joint
    assert joint.kind == "diagonal"
    assert torch.allclose(joint.mean, mean1, rtol=1e-9, atol=1e-9)
    variance = joint.covariance_matrix().diagonal()
    assert torch.allclose(variance, engine.sample_offsets.square().mean(0), rtol=1e-12)
    exact = torch.linalg.inv(precision1).diagonal()
    assert ((variance - exact).abs() <= 4.5 * exact * math.sqrt(2 / num_samples)).all(), variance / exact
    # the next episode's run reads it as the model's prior: its mean is the conjugate posterior under that prior
    engine2 = SampleThenOptimize(engine.as_prior(correlations="diagonal"), num_samples=4, **options)
    engine2.run(*second)
    x, y = second
    design = torch.cat([x, torch.ones(len(x), 1, dtype=D)], 1)
    precision = torch.diag(variance.reciprocal()) + design.T @ design / SIGMA**2
    expected = torch.linalg.solve(precision, mean1 / variance + design.T @ y / SIGMA**2)
    got = engine2.get_mean()
    assert torch.allclose(torch.cat([got["w"], got["b"].reshape(1)]), expected, rtol=1e-8, atol=1e-9)


def test_shrinkage_intensity_is_schafer_strimmer_by_its_definition():
    """rho = sum_{i!=j} Var(s_ij) / sum_{i!=j} s_ij^2 from an explicit d x d loop; the covariance it gives."""
    g = torch.Generator().manual_seed(5)
    num, d = 9, 6
    x = torch.randn(num, d, generator=g, dtype=D) @ torch.randn(d, d, generator=g, dtype=D)
    s = x.T @ x / num
    variance_sum, square_sum = 0.0, 0.0
    for i in range(d):
        for j in range(d):
            if i != j:
                w = x[:, i] * x[:, j]
                variance_sum += float(((w - s[i, j]) ** 2).sum()) / (num * (num - 1))
                square_sum += float(s[i, j] ** 2)
    expected = variance_sum / square_sum
    assert shrinkage_intensity(x) == pytest.approx(expected, rel=1e-12)
    shrunk = shrink_to_diagonal(x)
    assert shrunk.rho == pytest.approx(min(1.0, max(expected, 1 / num)), rel=1e-12)
    covariance = torch.diag(shrunk.diag) + shrunk.factor @ shrunk.factor.T
    target = shrunk.rho * torch.diag(s.diagonal()) + (1 - shrunk.rho) * s
    assert torch.allclose(covariance, target, rtol=1e-12, atol=1e-12)
    # chunked float64 sums in float32 input give the same intensity
    assert shrinkage_intensity(x.float()) == pytest.approx(expected, rel=1e-5)
    # independent coordinates: the correlations are noise, rho is about one (the diagonal); a rank-one
    # covariance seen through many draws: rho near zero
    assert shrinkage_intensity(torch.randn(4000, 5, generator=g, dtype=D)) > 0.5
    line = torch.randn(4000, 1, generator=g, dtype=D) * torch.ones(1, 5, dtype=D)
    assert shrinkage_intensity(line + 0.01 * torch.randn(4000, 5, generator=g, dtype=D)) < 0.01


def correlated_episodes():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(160, P, generator=g, dtype=D)
    x[:, 1] = x[:, 0] + 0.3 * x[:, 1]  # two nearly collinear features: a strongly correlated posterior
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=D) + 0.7 + SIGMA * torch.randn(160, generator=g, dtype=D)
    return (x[:80], y[:80]), (x[80:] + 1.0, y[80:] + torch.tensor([1.0, -2.0, 0.5], dtype=D).sum())


def test_sample_then_optimize_shrinkage_prior_keeps_the_correlations_and_feeds_the_next_episode():
    """With K = 1,000 draws of a correlated 4-d posterior the shrunk covariance is H^{-1} within Monte-Carlo error
    (correlations included); the full Laplace of episode 2 reads it exactly; it beats the diagonal prior."""
    first, second = correlated_episodes()
    num_samples = 1000
    options = {"num_epochs": 150, "variance_reduction": "all", "seed": 0, "progress_bar": False}
    engine = SampleThenOptimize(linear_model, num_samples=num_samples, **options)
    engine.run(*first)
    mean1, precision1 = exact_posterior(first)
    exact = torch.linalg.inv(precision1)
    assert exact[0, 1] / (exact[0, 0] * exact[1, 1]).sqrt() < -0.9  # the case this is about
    joint = engine.as_prior().joint
    assert joint.kind == "low_rank_covariance" and 0 < joint.shrinkage < 0.05
    assert torch.allclose(joint.mean, mean1, rtol=1e-9, atol=1e-9)
    covariance = joint.covariance_matrix()
    # the Monte-Carlo sd of each entry of S, plus the shrinkage's own pull rho |S_ij| off the diagonal
    sd = ((exact.diagonal()[:, None] * exact.diagonal()[None, :] + exact.square()) / num_samples).sqrt()
    pull = joint.shrinkage * covariance.abs() * (1 - torch.eye(P + 1, dtype=D)) / (1 - joint.shrinkage)
    assert ((covariance - exact).abs() <= 4.5 * sd + pull).all(), (covariance - exact) / sd
    # episode 2 under this prior: the conjugate posterior, to rounding (the full Laplace reads the dense prior)
    prior = engine.as_prior()
    x, y = second
    design = torch.cat([x, torch.ones(len(x), 1, dtype=D)], 1)
    precision = torch.linalg.inv(covariance) + design.T @ design / SIGMA**2
    expected = torch.linalg.solve(precision, torch.linalg.solve(covariance, mean1) + design.T @ y / SIGMA**2)
    posterior2 = AutoLinearizedLaplace(prior).laplace_approximation(
        *second, structure="full", map_latents=at(mean1), check_map=False
    )
    got = posterior2.mean
    assert torch.allclose(got, expected, rtol=1e-8, atol=1e-8)
    # against the posterior on both episodes' data: the shrunk prior errs by Monte-Carlo error, the diagonal far more
    both, both_precision = exact_posterior(first, second)
    sds = torch.linalg.inv(both_precision).diagonal().sqrt()
    diagonal = AutoLinearizedLaplace(engine.as_prior(correlations="diagonal")).laplace_approximation(
        *second, structure="full", map_latents=at(mean1), check_map=False
    )
    shrunk_error = ((got - both) / sds).abs().max()
    diagonal_error = ((diagonal.mean - both) / sds).abs().max()
    assert shrunk_error < 0.25 < diagonal_error, (shrunk_error, diagonal_error)
