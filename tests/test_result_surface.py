"""One result surface: every engine's result answers the same calls (the table in docs/getting_started.md).

``run`` (or ``laplace_approximation``) returns the result; each one gives ``get_samples(num_samples=None,
group_by_chain=False)``, ``summary()``, ``diagnostics()``, ``to_inference_data()`` and ``posterior_predictive(...)``;
the linearised and Gaussian ones also ``predict(...)`` and ``as_prior()``; all of them ``uncertainty(...)``.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import (
    EKF,
    SGLD,
    SWAG,
    AutoLinearizedLaplace,
    DiagonalEKF,
    SampleThenOptimize,
    StochasticMCMC,
)

F64 = torch.float64


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=20) as idx:
        return pyro.sample("obs", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 2, generator=g, dtype=F64)
    return x, x @ torch.tensor([1.0, -0.5], dtype=F64) + 0.5 * torch.randn(60, generator=g, dtype=F64)


def _run(name):
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short runs: unhealthy or unconverged on purpose
        if name == "StochasticMCMC":
            return StochasticMCMC(
                SGLD(model, step_size=1e-3), num_samples=20, num_warmup=0, num_chains=2, seed=0, progress_bar=False
            ).run(x, y)
        if name == "Laplace":
            w = torch.linalg.solve(x.T @ x / 0.25 + torch.eye(2, dtype=F64), x.T @ y / 0.25)
            return AutoLinearizedLaplace(model).laplace_approximation(x, y, structure="full", map_latents={"w": w})
        if name == "SampleThenOptimize":
            return SampleThenOptimize(model, num_samples=8, num_epochs=2, seed=0, progress_bar=False).run(x, y)
        if name == "SWAG":
            return SWAG(model, num_epochs=4, rank=2, num_runs=2, seed=0, progress_bar=False).run(x, y)
        if name == "DiagonalEKF":
            return DiagonalEKF(model, seed=0, progress_bar=False).run(x, y)
        return EKF(model, seed=0, progress_bar=False).run(x, y)


ENGINES = ["StochasticMCMC", "Laplace", "SampleThenOptimize", "SWAG", "EKF", "DiagonalEKF"]
LINEARISED = {"Laplace", "SampleThenOptimize", "SWAG", "EKF", "DiagonalEKF"}  # predict(...) and as_prior()


@pytest.fixture(scope="module", params=ENGINES)
def result(request):
    return request.param, _run(request.param)


def test_get_samples(result):
    name, res = result
    pooled = res.get_samples()
    assert set(pooled) == {"w"} and pooled["w"].ndim == 2 and pooled["w"].shape[-1] == 2
    grouped = res.get_samples(group_by_chain=True)
    assert grouped["w"].ndim == 3 and grouped["w"].shape[0] == res.num_chains
    assert res.get_samples(num_samples=5, seed=0)["w"].shape == (5, 2)
    assert torch.equal(res.get_samples(num_samples=5, seed=0)["w"], res.get_samples(num_samples=5, seed=0)["w"])


def test_summary_and_diagnostics(result, capsys):
    name, res = result
    res.summary()
    out = capsys.readouterr().out
    assert "w[0]" in out
    # only Markov chains have an r_hat to read; the other engines' draws are independent, and the table says so
    header = next(line.split() for line in out.splitlines() if line.strip())
    assert ("r_hat" in header) == (name == "StochasticMCMC"), out
    assert ("independent draws" in out) == (name != "StochasticMCMC"), out
    diagnostics = res.diagnostics()
    assert {"n_eff", "r_hat"} <= set(diagnostics["w"]) and "divergences" in diagnostics


@pytest.mark.arviz
def test_summary_and_diagnostics_show_the_r_hat_of_az_summary_and_the_warning(capsys):
    """One rank-normalised r_hat in summary(), diagnostics(), az.summary and the HealthWarning: on short chains,
    far from converged, where Pyro's plain split r_hat reads lower."""
    az = pytest.importorskip("arviz")
    from pyro.ops.stats import split_gelman_rubin

    from pyro_scalable.infer.health import HealthWarning

    x, y = _data()
    mcmc = StochasticMCMC(
        SGLD(model, step_size=1e-3), num_samples=41, num_warmup=0, num_chains=3, seed=0, progress_bar=False
    )
    with pytest.warns(HealthWarning) as caught:
        mcmc.run(x, y)
    theirs = az.summary(mcmc.to_inference_data(), var_names=["w"], kind="diagnostics", round_to="none")
    theirs = torch.tensor(theirs["r_hat"].to_numpy(dtype=float), dtype=F64)
    ours = mcmc.diagnostics()["w"]["r_hat"].double()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5), (ours, theirs)
    assert (ours - split_gelman_rubin(mcmc.get_samples(group_by_chain=True)["w"])).abs().max() > 1e-3
    mcmc.summary()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("w[")]
    assert [float(row[-1]) for row in rows] == [round(float(r), 2) for r in theirs], rows
    worst = f"'w' ({float(theirs.max()):.3g})"  # the warning's figure for the site: its worst coordinate
    assert worst in str(caught[0].message), caught[0].message


def test_to_inference_data_and_posterior_predictive(result):
    _, res = result
    idata = res.to_inference_data()
    assert "posterior" in idata.groups() and "w" in idata.posterior
    x_new = torch.randn(7, 2, dtype=F64)
    draws = res.posterior_predictive(x_new)
    assert draws["obs"].shape[-1] == 7


def test_predict_and_as_prior_where_the_result_is_gaussian(result):
    name, res = result
    if name not in LINEARISED:
        assert not hasattr(res, "predict") and not hasattr(res, "as_prior")
        return
    per_run = {"run": 0} if name == "SWAG" else {}  # MultiSWAG's runs have one linearisation point each
    prediction = res.predict(torch.randn(7, 2, dtype=F64), **per_run)
    assert prediction.mean.shape[0] == 7
    prior = res.as_prior()
    trace = pyro.poutine.trace(prior).get_trace(*_data())
    assert trace.nodes["w"]["value"].shape == (2,)


def test_uncertainty_splits_off_the_known_noise_on_every_result(result):
    name, res = result
    x_new = torch.randn(7, 2, dtype=F64)
    split = res.uncertainty(x_new)  # the draws, or the linearised predictive where that is the result's default
    assert torch.allclose(split.aleatoric, torch.full((7,), 0.25, dtype=F64), rtol=1e-6)
    assert torch.equal(split.total, split.aleatoric + split.epistemic) and bool((split.epistemic > 0).all())
    if name in LINEARISED:
        per_run = {"run": 0} if name == "SWAG" else {}
        linear = res.uncertainty(x_new, linearized=True, **per_run)
        assert torch.allclose(linear.aleatoric, split.aleatoric, rtol=1e-6)
