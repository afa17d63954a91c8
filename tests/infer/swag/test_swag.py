"""SWAG: the moments against batch formulas, the snapshots against SGD's stationary covariance, the result surface.

The gold test solves the discrete Lyapunov equation of SGD with momentum on a quadratic whose minibatch gradient
noise does not depend on θ (a multivariate Normal location model, minibatches drawn with replacement), so the
iterates' stationary covariance is known exactly; SWAG's moments from many independent runs must match it within
4.5 standard errors of the across-run spread.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive
from pyro.nn import PyroModule, PyroSample

from pyro_scalable.bridge import FullDataModel
from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer import SWAG, SWAGPosterior
from pyro_scalable.infer.swag.moments import MomentAccumulator, dense_covariance, sample_flat
from pyro_scalable.inference_data import ARVIZ_MAJOR

F64 = torch.float64
Z = 4.5


# ---------------------------------------------------------------------------------------------------- the moments


def test_accumulator_equals_the_batch_formulas():
    """Welford's running moments and the ring buffer give the batch mean, variance and last-K deviations."""
    snapshots = torch.randn(37, 3, 5, dtype=F64) * torch.tensor([1.0, 10.0, 0.1], dtype=F64)[:, None] + 100.0
    accumulator = MomentAccumulator(snapshots[0], rank=6)
    for theta in snapshots:
        accumulator.add(theta)
    moments = accumulator.finish()
    mean = snapshots.mean(0)
    torch.testing.assert_close(moments.mean, mean, rtol=1e-13, atol=1e-12)
    torch.testing.assert_close(moments.variance, snapshots.var(0, unbiased=False), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(moments.deviations, (snapshots[-6:] - mean).transpose(0, 1), rtol=1e-13, atol=1e-12)
    assert moments.num_snapshots == 37


def test_draws_have_the_swag_covariance():
    """Draws of ½ diag(σ²) + DDᵀ/(2(K−1)) (and of the diagonal form), within Monte-Carlo error."""
    generator = torch.Generator().manual_seed(0)
    snapshots = torch.randn(12, 1, 4, dtype=F64, generator=generator) @ torch.randn(
        4, 4, dtype=F64, generator=generator
    )
    accumulator = MomentAccumulator(snapshots[0], rank=5)
    for theta in snapshots:
        accumulator.add(theta)
    moments = accumulator.finish()
    S = 40_000
    for covariance in ("low_rank", "diagonal"):
        exact = dense_covariance(moments, covariance)
        draws = sample_flat(moments, S, covariance, generator)
        centred = draws - moments.mean[0]
        estimate = centred.T @ centred / S
        # the sd of a product-moment estimate: sqrt((C_ii C_jj + C_ij²) / S)
        scale = ((exact.diagonal()[:, None] * exact.diagonal()[None, :] + exact**2) / S).sqrt()
        assert ((estimate - exact).abs() <= Z * scale + 1e-12).all(), covariance
    low = dense_covariance(moments, "low_rank")
    D = moments.deviations[0]
    torch.testing.assert_close(low, 0.5 * torch.diag(moments.variance[0]) + D.T @ D / (2 * (D.shape[0] - 1)))


# ---------------------------------------------------------------------------------------------------- gold


def _location_problem():
    generator = torch.Generator().manual_seed(1)
    N, B = 1000, 50
    root = torch.tensor([[1.0, 0.0, 0.0], [0.6, 1.2, 0.0], [-0.4, 0.3, 1.8]], dtype=F64)
    y = torch.randn(N, 3, dtype=F64, generator=generator) @ root.T + torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    cov_y = root @ root.T
    prior_scale = 10.0

    def model(y):
        theta = pyro.sample("theta", dist.Normal(torch.zeros(3, dtype=F64), prior_scale).to_event(1))
        with pyro.plate("data", y.shape[0], subsample_size=B) as idx:
            pyro.sample("y", dist.MultivariateNormal(theta, covariance_matrix=cov_y), obs=y[idx])

    precision_y = torch.linalg.inv(cov_y)
    H = N * precision_y + torch.eye(3, dtype=F64) / prior_scale**2
    mode = torch.linalg.solve(H, precision_y @ y.sum(0))
    centred = y - y.mean(0)
    S = N**2 / B * precision_y @ (centred.T @ centred / N) @ precision_y  # iid-index minibatch noise
    return model, y, H, S, mode


def _stationary_covariance(H: torch.Tensor, S: torch.Tensor, lr: float, momentum: float) -> torch.Tensor:
    """θ's block of the solution of C = A C Aᵀ + Q for torch SGD: b' = μb + g, θ' = θ − η b', g = Hθ + ξ."""
    d = H.shape[0]
    eye = torch.eye(d, dtype=F64)
    A = torch.cat([torch.cat([eye - lr * H, -lr * momentum * eye], 1), torch.cat([H, momentum * eye], 1)])
    B = torch.cat([-lr * eye, eye])
    Q = B @ S @ B.T
    vec = torch.linalg.solve(torch.eye(4 * d * d, dtype=F64) - torch.kron(A, A), Q.reshape(-1))
    return vec.reshape(2 * d, 2 * d)[:d, :d]


def test_snapshots_have_the_stationary_covariance_of_sgd():
    """SWAG's σ² and DDᵀ/(K−1), averaged over 64 runs, equal SGD's closed-form stationary covariance."""
    model, y, H, S, mode = _location_problem()
    lr, momentum, runs = 2e-5, 0.9, 64
    posterior = SWAG(
        model,
        lr=lr,
        momentum=momentum,
        start={"theta": mode},
        burn_in_epochs=10,
        num_epochs=200,
        snapshot_every=25,
        rank=20,
        num_runs=runs,
        minibatches="independent",
        seed=0,
        progress_bar=False,
    ).run(y)
    exact = _stationary_covariance(H, S, lr, momentum)
    assert posterior.stats["num_snapshots"] == 200 * 20 // 25
    variance = posterior.moments.variance  # (runs, 3)
    error = variance.mean(0) - exact.diagonal()
    assert (error.abs() <= Z * variance.std(0) / runs**0.5).all(), (variance.mean(0), exact.diagonal())
    D = posterior.moments.deviations
    low = D.transpose(1, 2) @ D / (D.shape[1] - 1)  # (runs, 3, 3)
    error = low.mean(0) - exact
    assert (error.abs() <= Z * low.std(0) / runs**0.5).all(), (low.mean(0), exact)
    # the SWA mean is the mode, to the Monte-Carlo error of 64 runs' means
    means = posterior.mean
    assert ((means.mean(0) - mode).abs() <= Z * means.std(0) / runs**0.5).all()


# ---------------------------------------------------------------------------------------------------- statistics


def _regression(N=2000, d=4, dtype=torch.float32):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(N, d, generator=generator, dtype=dtype)
    y = x @ torch.linspace(-1, 1, d, dtype=dtype) + 0.5 * torch.randn(N, generator=generator, dtype=dtype)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(d, dtype=dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=100) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])

    X, Y = x.double(), y.double()
    precision = X.T @ X / 0.25 + torch.eye(d, dtype=F64)
    cov = torch.linalg.inv(precision)
    return model, x, y, cov @ X.T @ Y / 0.25, cov


def test_auto_learning_rate_matches_an_isotropic_posterior():
    """lr='auto' (Mandt et al.'s KL-optimal constant step) on a regression with isotropic features, float32 data.

    There H ≈ (N/σ²) I and the minibatch noise ≈ (N/B) H, so SGD's stationary covariance with that step is H⁻¹ up
    to the features' sample anisotropy (±2√(d/N) ≈ 9 % in H's eigenvalues) and the estimate's Monte-Carlo error
    (4 runs x 200 snapshots): the sds must be within 20 %, and the mean within 4.5 Monte-Carlo errors.
    """
    model, x, y, mean, cov = _regression()
    posterior = SWAG(model, num_epochs=200, rank=20, num_runs=4, seed=0, progress_bar=False).run(x, y)
    draws = posterior.get_samples(4000, seed=1)["w"].double()
    sd = cov.diagonal().sqrt()
    ratio = draws.std(0) / sd
    assert ((ratio - 1).abs() < 0.2).all(), ratio
    spread = posterior.mean.double().std(0)  # the runs' SWA means: independent estimates of the mean
    assert ((posterior.mean.double().mean(0) - mean).abs() <= Z * spread / 2 + 0.05 * sd).all()


# ---------------------------------------------------------------------------------------------------- surface


class _Net(PyroModule):
    def __init__(self):
        super().__init__()
        self.hidden = PyroModule[torch.nn.Linear](2, 8)
        self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([8, 2]).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([8]).to_event(1))
        self.out = PyroModule[torch.nn.Linear](8, 1)
        self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 8]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        scale = pyro.sample("scale", dist.HalfNormal(1.0))
        hidden_weight, hidden_bias = self.hidden.weight, self.hidden.bias  # sampled here, outside the plate
        out_weight, out_bias = self.out.weight, self.out.bias
        with pyro.plate("data", x.shape[0], subsample_size=64) as idx:
            f = (torch.tanh(x[idx] @ hidden_weight.T + hidden_bias) @ out_weight.T + out_bias).squeeze(-1)
            pyro.sample("y", dist.Normal(f, scale), obs=None if y is None else y[idx])


def _net_data():
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(512, 2, generator=generator) * 4 - 2
    return x, torch.sin(x[:, 0]) * x[:, 1] + 0.1 * torch.randn(512, generator=generator)


def test_multiswag_on_a_pyromodule_gives_the_result_surface():
    """Float32 PyroModule with a constrained scale, 3 runs from their own MAPs: draws, guide, predictive, ArviZ."""
    pyro.clear_param_store()
    net = _Net()
    x, y = _net_data()
    posterior = SWAG(net, num_epochs=10, rank=5, num_runs=3, seed=0, progress_bar=False).run(x, y)
    assert isinstance(posterior, SWAGPosterior) and posterior.num_runs == 3
    assert len(posterior.stats["mode_searches"]) == 3
    samples = posterior.get_samples(30, seed=0)
    assert samples["hidden.weight"].shape == (30, 8, 2) and samples["scale"].shape == (30,)
    assert bool((samples["scale"] > 0).all()) and all(bool(torch.isfinite(v).all()) for v in samples.values())
    assert samples["scale"].dtype == torch.float32
    grouped = posterior.get_samples(5, group_by_chain=True, seed=0)
    assert grouped["out.bias"].shape == (3, 5, 1)
    predictive = posterior.posterior_predictive(x[:7], num_samples=11, seed=0)
    assert predictive["y"].shape == (11, 7)
    guided = Predictive(FullDataModel(net), guide=posterior, num_samples=4)(x[:9])
    assert guided["y"].shape[-1] == 9
    idata = posterior.to_inference_data(num_samples=30, seed=0)
    posterior_group = idata["posterior"] if ARVIZ_MAJOR >= 1 else idata.posterior
    assert posterior_group.sizes["chain"] == 3 and posterior_group.sizes["draw"] == 10
    log_likelihood = idata["log_likelihood"] if ARVIZ_MAJOR >= 1 else idata.log_likelihood
    assert log_likelihood["y"].shape == (3, 10, 512)
    # seeded draws repeat
    torch.testing.assert_close(posterior.get_samples(4, seed=9)["scale"], posterior.get_samples(4, seed=9)["scale"])


def test_epoch_minibatches_shrink_the_spread():
    """Shuffled epochs cancel the noise over an epoch: SGD's spread is smaller than with independent minibatches."""
    model, x, y, _, cov = _regression(N=500, d=2)
    sds = {}
    for minibatches in ("independent", "epoch"):
        posterior = SWAG(
            model, num_epochs=100, rank=10, num_runs=2, minibatches=minibatches, seed=0, progress_bar=False
        ).run(x, y)
        sds[minibatches] = posterior.get_samples(2000, seed=0)["w"].double().std(0)
    assert (sds["epoch"] < 0.8 * sds["independent"]).all(), sds


def test_cyclical_learning_rate_snapshots_at_cycle_ends():
    model, x, y, _, _ = _regression(N=500, d=2)
    swag = SWAG(model, cycle_length=15, num_epochs=30, rank=5, seed=0, progress_bar=False)
    posterior = swag.run(x, y)
    assert swag.stats["snapshot_every"] == 15 and swag.stats["burn_in_steps"] % 15 == 0
    assert posterior.moments.num_snapshots == 30 * 5 // 15
    assert bool(torch.isfinite(posterior.mean).all())


# ---------------------------------------------------------------------------------------------------- bad input


def test_errors_name_the_argument_or_site():
    model, x, y, _, _ = _regression(N=200, d=2)

    def unplated(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)

    with pytest.raises(ModelError, match="not subsampled|exactly one subsampled plate"):
        SWAG(unplated, progress_bar=False).run(x, y)
    with pytest.raises(ValueError, match="rank >= 2"):
        SWAG(model, rank=1)
    with pytest.raises(ValueError, match="momentum"):
        SWAG(model, momentum=1.0)
    with pytest.raises(ValueError, match="lr"):
        SWAG(model, lr=-1.0)
    with pytest.raises(TypeError, match="start"):
        SWAG(model, start=3)
    with pytest.raises(ModelError, match="'w'"):
        SWAG(model, start={"v": torch.zeros(2)}, progress_bar=False).run(x, y)
    with pytest.raises(FloatingPointError, match="smaller lr"):
        SWAG(model, lr=10.0, start={"w": torch.zeros(2)}, num_epochs=3, progress_bar=False).run(x, y)
