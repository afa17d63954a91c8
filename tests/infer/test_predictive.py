"""Posterior predictive draws: the shared function, every result's ``posterior_predictive``, and Pyro's Predictive."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive
from torch.utils.data import DataLoader, TensorDataset

import pyro_scalable.bridge.predictive as bridge_predictive
from pyro_scalable import FullDataModel, ModelError
from pyro_scalable.infer import SGLD, AutoLinearizedLaplace, SampleThenOptimize, StochasticMCMC
from pyro_scalable.infer.predictive import sample_posterior_predictive

from ..conftest import LinearRegression
from .linearized.nets import MLP, random_latents

Z = 4.5  # Monte-Carlo standard errors allowed (a 1e-5 chance per comparison for a Gaussian estimate)
F64 = torch.float64


def _exact_draws(problem: LinearRegression, num_draws: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    root = torch.linalg.cholesky(problem.cov)
    noise = torch.randn(num_draws, problem.mean.shape[0], generator=g, dtype=problem.mean.dtype)
    return {"w": problem.mean + noise @ root.T}


def _check_moments(draws: torch.Tensor, mean: torch.Tensor, variance: torch.Tensor) -> None:
    """Mean and variance per point within Z Monte-Carlo standard errors (the draws of y are Gaussian here)."""
    n = draws.shape[0]
    assert ((draws.mean(0) - mean) / (variance / n).sqrt()).abs().max() < Z
    # the sample variance of n Gaussian draws has variance 2 σ⁴ / (n - 1)
    assert ((draws.var(0) - variance) / (2 * variance**2 / (n - 1)).sqrt()).abs().max() < Z


# ---------------------------------------------------------------------------- the shared function


def test_predictive_matches_the_closed_form_at_new_inputs():
    """Conjugate linear-Gaussian model with a subsample_size plate: y* ~ N(x* m, x* Σ x*ᵀ + σ²) at 37 new points."""
    problem = LinearRegression(num_data=200, batch_size=20, noise_scale=0.5, prior_scale=1.0)
    draws = _exact_draws(problem, 4000, seed=1)
    x_new = torch.randn(37, 2, generator=torch.Generator().manual_seed(2), dtype=F64) * 3
    y = sample_posterior_predictive(problem.model, draws, x_new, None, seed=0)["obs"]
    assert y.shape == (4000, 37) and y.dtype == F64
    mean = x_new @ problem.mean
    variance = ((x_new @ problem.cov) * x_new).sum(-1) + problem.noise_scale**2
    _check_moments(y, mean, variance)


def test_seed_makes_draws_repeatable():
    problem = LinearRegression(num_data=50, batch_size=10)
    draws = _exact_draws(problem, 30, seed=0)
    first = sample_posterior_predictive(problem.model, draws, problem.x, None, seed=3)["obs"]
    again = sample_posterior_predictive(problem.model, draws, problem.x, None, seed=3)["obs"]
    other = sample_posterior_predictive(problem.model, draws, problem.x, None, seed=4)["obs"]
    assert torch.equal(first, again) and not torch.equal(first, other)


def _slope_model(x, y=None):
    """Broadcasts over a leading dim of draws (a scalar slope): vectorised."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", len(x), subsample_size=4) as idx:
        pyro.sample("y", dist.Normal(w * x[idx], 1e-6), obs=None if y is None else y[idx])


def _matmul_model(x, y=None):
    """``x @ w`` does not broadcast over a leading dim of draws: run draw by draw."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(x), subsample_size=4) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, 1e-6), obs=None if y is None else y[idx])


@pytest.mark.parametrize(
    ("model", "shape", "vectorized"), [(_slope_model, (), True), (_matmul_model, (2,), False)], ids=["slope", "matmul"]
)
def test_vectorized_and_sequential_draws_follow_each_draw(monkeypatch, model, shape, vectorized):
    """With σ ≈ 0, draw s of y is the model's mean at draw s of w: exact for either path, in chunks of draws."""
    calls = []
    sequential = bridge_predictive._sequential
    monkeypatch.setattr(bridge_predictive, "_sequential", lambda *a: calls.append(1) or sequential(*a))
    x = torch.randn(9, *shape, dtype=F64)
    w = torch.randn(25, *shape, dtype=F64)
    y = bridge_predictive.predictive_draws(model, {"w": w}, (x,), draws_per_chunk=10)["y"]
    expected = w[:, None] * x if not shape else w @ x.T
    assert y.shape == (25, 9)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=0)
    assert calls == ([] if vectorized else [1, 1, 1])  # three chunks of at most ten draws


def test_float32_data_gives_float32_draws_of_the_right_shape():
    problem = LinearRegression(num_data=60, batch_size=16, dtype=torch.float32)
    draws = {"w": _exact_draws(LinearRegression(num_data=60, batch_size=16), 50, seed=0)["w"].float()}
    y = sample_posterior_predictive(problem.model, draws, problem.x[:7], None, seed=0)["obs"]
    assert y.shape == (50, 7) and y.dtype == torch.float32


def test_passing_y_gives_a_draw_of_y_not_y():
    problem = LinearRegression(num_data=80, batch_size=16, noise_scale=0.5)
    draws = _exact_draws(problem, 2000, seed=0)
    y = sample_posterior_predictive(problem.model, draws, problem.x, problem.y, seed=0)["obs"]
    assert y.shape == (2000, 80)
    assert not (y == problem.y).any()
    mean = problem.x @ problem.mean
    variance = ((problem.x @ problem.cov) * problem.x).sum(-1) + problem.noise_scale**2
    _check_moments(y, mean, variance)


def test_return_sites_and_bad_arguments():
    problem = LinearRegression(num_data=30, batch_size=10)
    draws = _exact_draws(problem, 5, seed=0)
    both = sample_posterior_predictive(problem.model, draws, problem.x, None, return_sites=["w", "obs"])
    assert both["w"].shape == (5, 2) and both["obs"].shape == (5, 30)
    with pytest.raises(ValueError, match=r"not sample sites .*\['obs', 'w'\]"):
        sample_posterior_predictive(problem.model, draws, problem.x, None, return_sites=["nope"])
    with pytest.raises(TypeError, match="dict of tensors"):
        sample_posterior_predictive(problem.model, [draws["w"]], problem.x, None)
    with pytest.raises(ValueError, match="same number of draws"):
        sample_posterior_predictive(problem.model, {"w": draws["w"], "v": torch.zeros(3)}, problem.x, None)


# ---------------------------------------------------------------------------- DataLoader-style plates

N_LOADER = 60


def _loader_model(x, y=None, idx=None):
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", N_LOADER, subsample=idx):
        pyro.sample("obs", dist.Normal((x * w.unsqueeze(-2)).sum(-1), 0.5), obs=y)


def test_dataloader_plate_needs_the_new_points_indices():
    draws = {"w": torch.randn(20, 2, dtype=F64)}
    x = torch.randn(N_LOADER, 2, dtype=F64)
    assert sample_posterior_predictive(_loader_model, draws, x)["obs"].shape == (20, N_LOADER)
    x_new = torch.randn(70, 2, dtype=F64)
    with pytest.raises(ModelError, match=r"plate 'data' has size 60.*idx=torch.arange\(70\)"):
        sample_posterior_predictive(_loader_model, draws, x_new)
    y = sample_posterior_predictive(_loader_model, draws, x_new, idx=torch.arange(70))["obs"]
    assert y.shape == (20, 70)


def test_dataloader_run_predicts_on_its_full_data_or_asks_for_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_LOADER, 2, generator=g, dtype=F64)
    y = x @ torch.tensor([1.0, -0.5], dtype=F64) + 0.5 * torch.randn(N_LOADER, generator=g, dtype=F64)
    loader = DataLoader(TensorDataset(x, y, torch.arange(N_LOADER)), batch_size=16, shuffle=True, generator=g)
    mcmc = StochasticMCMC(SGLD(_loader_model, step_size=1e-3), num_samples=5, num_chains=2, seed=0, progress_bar=False)
    mcmc.run(batches=loader)
    with pytest.raises(ValueError, match=r"no full data.*posterior_predictive\(x, idx="):
        mcmc.posterior_predictive()
    assert mcmc.posterior_predictive(x[:7], idx=torch.arange(7))["obs"].shape == (10, 7)
    mcmc.run(x, y, batches=loader)
    assert mcmc.posterior_predictive(group_by_chain=True)["obs"].shape == (2, 5, N_LOADER)


# ---------------------------------------------------------------------------- results


@pytest.fixture(scope="module")
def regression():
    return LinearRegression(num_data=120, batch_size=20, noise_scale=0.5)


@pytest.fixture(scope="module")
def mcmc(regression):
    run = StochasticMCMC(
        SGLD(regression.model, step_size=1e-3), num_samples=20, num_warmup=50, num_chains=3, seed=0, progress_bar=False
    )
    run.run(regression.x, regression.y)
    return run


@pytest.mark.parametrize("length", [7, 20, 250])  # shorter than a minibatch, one minibatch, longer than the data
def test_stochastic_mcmc_predicts_at_new_inputs_of_any_length(mcmc, length):
    x_new = torch.randn(length, 2, dtype=F64)
    flat = mcmc.posterior_predictive(x_new, None, seed=0)
    assert set(flat) == {"obs"} and flat["obs"].shape == (60, length)
    grouped = mcmc.posterior_predictive(x_new, None, seed=0, group_by_chain=True)["obs"]
    assert grouped.shape == (3, 20, length)
    torch.testing.assert_close(grouped.reshape(60, length), flat["obs"])


def test_stochastic_mcmc_predicts_on_its_full_data(mcmc, regression):
    draws = mcmc.posterior_predictive(seed=0)["obs"]
    assert draws.shape == (60, 120)
    assert not (draws == regression.y).any()  # draws of y, not y
    assert (draws.std(0) > 0.2).all()  # the noise scale is 0.5


def test_pyro_predictive_with_the_kernel_model_and_pyros_own_with_the_subsampled_model(mcmc, regression):
    x_new = torch.randn(33, 2, dtype=F64)
    samples = mcmc.get_samples()
    assert Predictive(mcmc.kernel.model, posterior_samples=samples)(x_new, None)["obs"].shape == (60, 33)
    # the model as written is Pyro's business: a random minibatch of 20 of the 33 points, as without the package
    assert Predictive(regression.model, posterior_samples=samples)(x_new, None)["obs"].shape == (60, 20)


@pytest.mark.parametrize("linearized", [True, False])
def test_sample_then_optimize_predicts_at_its_own_draws(linearized):
    """With σ = 1e-3 each draw of y is x w_j for the engine's own draw w_j (either path; the model is linear)."""
    problem = LinearRegression(num_data=120, batch_size=20, noise_scale=1e-3)
    engine = SampleThenOptimize(problem.model, num_samples=16, num_epochs=2, seed=0, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unconverged after 2 epochs: beside the point here
        engine.run(problem.x, problem.y)
    x_new = torch.randn(11, 2, dtype=F64)
    draws = engine.posterior_predictive(x_new, None, seed=0, linearized=linearized, return_sites=["w", "obs"])
    w = engine.get_samples()["w"]
    torch.testing.assert_close(draws["w"], w)
    torch.testing.assert_close(draws["obs"], w @ x_new.T, atol=5e-3, rtol=0)
    again = engine.posterior_predictive(x_new, None, seed=0, linearized=linearized)["obs"]
    assert torch.equal(again, draws["obs"])
    assert engine.posterior_predictive(group_by_chain=True, linearized=linearized)["obs"].shape == (1, 16, 120)


# ---------------------------------------------------------------------------- Laplace


@pytest.fixture(scope="module")
def laplace(regression):
    guide = AutoLinearizedLaplace(regression.model)
    map_latents = {"w": regression.mean}  # the MAP of the linear-Gaussian model
    return guide.laplace_approximation(
        regression.x, regression.y, structure="full", prior_precision=1.0, map_latents=map_latents
    )


@pytest.mark.parametrize("linearized", [True, False])
def test_laplace_posterior_predictive_matches_the_closed_form(laplace, regression, linearized):
    """For a linear-Gaussian model the Laplace posterior is exact, and both predictives are its predictive."""
    x_new = torch.randn(23, 2, generator=torch.Generator().manual_seed(5), dtype=F64) * 2
    draws = laplace.posterior_predictive(x_new, None, num_samples=4000, seed=0, linearized=linearized)
    assert set(draws) == {"obs"} and draws["obs"].shape == (4000, 23)
    mean = x_new @ regression.mean
    variance = ((x_new @ regression.cov) * x_new).sum(-1) + regression.noise_scale**2
    _check_moments(draws["obs"], mean, variance)
    again = laplace.posterior_predictive(x_new, None, num_samples=4000, seed=0, linearized=linearized)
    assert torch.equal(draws["obs"], again["obs"])


def test_laplace_posterior_predictive_on_the_training_data_and_latents(laplace):
    draws = laplace.posterior_predictive(num_samples=10, return_sites=["w", "obs"], seed=0)
    assert draws["w"].shape == (10, 2) and draws["obs"].shape == (10, 120)
    with pytest.raises(ValueError, match="neither the observed site"):
        laplace.posterior_predictive(num_samples=10, return_sites=["nope"])


def test_laplace_guide_through_pyro_predictive(laplace, regression):
    x_new = torch.randn(70, 2, dtype=F64)
    draws = Predictive(FullDataModel(regression.model), guide=laplace, num_samples=12)(x_new, None)
    assert draws["obs"].shape == (12, 70)
    # Pyro returns a guide's latents with the model's plate dims kept (as for AutoNormal): (S, 1, d)
    assert draws["w"].squeeze(-2).shape == (12, 2)
    assert Predictive(FullDataModel(regression.model), guide=laplace, num_samples=12, return_sites=["obs"])(
        x_new, None
    )["obs"].shape == (12, 70)
    assert Predictive(regression.model, guide=laplace, num_samples=12)(x_new, None)["obs"].shape == (12, 20)


@pytest.mark.parametrize("likelihood", ["categorical", "normal"])
def test_laplace_linearized_draws_follow_the_glm_predictive_of_a_network(likelihood):
    """Draws through the linearised network against ``predict`` (Monte Carlo link for classes): within MC error."""
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=g, dtype=F64)
    y = torch.randint(0, 3, (60,), generator=g) if likelihood == "categorical" else torch.randn(60, 3, dtype=F64)
    model = MLP((3, 4, 3), likelihood, batch_size=20)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="kron", map_latents=random_latents(model, x), check_map=False
    )
    x_test = torch.randn(25, 3, generator=g, dtype=F64)
    num_samples = 4000
    draws = posterior.posterior_predictive(x_test, num_samples=num_samples, seed=0)["y"]
    assert draws.shape == (num_samples, 25, *y.shape[1:])
    if likelihood == "categorical":
        probs = posterior.predict(x_test, link_approx="mc", num_samples=20000, seed=1).distribution.probs
        frequencies = torch.nn.functional.one_hot(draws, 3).to(F64).mean(0)
        # binomial standard error of each class frequency, plus that of predict's own Monte-Carlo link (a softmax
        # output in [0, 1] with mean p has variance at most p (1 - p))
        error = (probs * (1 - probs) * (1 / num_samples + 1 / 20000)).sqrt()
        assert ((frequencies - probs) / error).abs().max() < Z
        nn_draws = posterior.posterior_predictive(x_test, num_samples=10, seed=0, linearized=False)["y"]
        assert nn_draws.shape == (10, 25) and nn_draws.dtype == draws.dtype
    else:
        exact = posterior.predict(x_test).distribution
        _check_moments(draws, exact.mean, exact.variance)
