"""A model that never subsamples its data, handed to a minibatch engine: named once, with the plate to write."""

from __future__ import annotations

import contextlib
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable import ModelError
from pyro_scalable.bridge import ModelBridge
from pyro_scalable.bridge.records import DataRows
from pyro_scalable.bridge.subsampling import FULL_BATCH_ROWS, warn_full_batch
from pyro_scalable.infer import SGLD, SWAG, AutoLinearizedLaplace, DiagonalEKF, SampleThenOptimize, StochasticMCMC
from pyro_scalable.infer.health import HealthWarning

N = FULL_BATCH_ROWS


def plain_plate(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(w * x, 1.0), obs=y)


def no_plate(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    pyro.sample("obs", dist.Normal(w * x, 1.0).to_event(1), obs=y)


def subsampled(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y), subsample_size=100) as idx:
        pyro.sample("obs", dist.Normal(w * x[idx], 1.0), obs=y[idx])


def _data(rows=N):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, generator=g)
    return x, 0.5 * x + torch.randn(rows, generator=g)


@contextlib.contextmanager
def _quiet():
    """Every warning an error, except the health check's (two draws are never healthy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", HealthWarning)
        yield


def _run(model, data, **options):
    mcmc = StochasticMCMC(SGLD(model, step_size=1e-6), num_samples=2, seed=0, progress_bar=False, **options)
    return mcmc.run(*data)


def test_a_plate_without_subsample_size_is_named_once_with_the_line_to_add():
    with pytest.warns(UserWarning) as record:
        _run(plain_plate, _data())
    named = [w for w in record if "subsample_size" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in record]
    message = str(named[0].message)
    assert message.startswith("StochasticMCMC: observed site 'obs' sits in plate 'data' of 10000 rows")
    line = "`with pyro.plate('data', 10000, subsample_size=100) as idx:`"
    assert f"{line}, indexing the data with idx (x[idx], y[idx])" in message
    assert "full_batch=True" in message
    assert named[0].filename == __file__  # points at the user's run(...) line


def test_a_model_without_a_plate_is_named():
    with pytest.warns(
        UserWarning,
        match=r"observed site 'obs' has 10000 rows and no plate.*put the site in a subsampled "
        r"plate: `with pyro\.plate\('data', 10000, subsample_size=100\) as idx:`",
    ):
        _run(no_plate, _data())


@pytest.mark.parametrize("model", [plain_plate, no_plate])
def test_a_deliberate_full_batch_run_stays_quiet(model):
    with _quiet():
        mcmc = _run(model, _data(), full_batch=True)
    assert mcmc.full_batch is True


@pytest.mark.parametrize("model, rows", [(subsampled, N), (plain_plate, N - 1)])
def test_a_subsampled_model_or_small_data_stays_quiet(model, rows):
    with _quiet():
        _run(model, _data(rows))


def test_full_batch_must_be_a_bool():
    with pytest.raises(TypeError, match=r"full_batch must be True or False, got 1"):
        StochasticMCMC(SGLD(plain_plate, step_size=1e-6), num_samples=2, full_batch=1)


def test_the_suggested_minibatch_is_about_one_percent_between_100_and_1000():
    sizes = [DataRows(rows, "obs", "data").subsample_size for rows in (50, 10_000, 25_000, 56_789, 10**7)]
    assert sizes == [50, 100, 250, 560, 1000]


def test_the_bridge_finds_the_rows_in_one_place():
    x, y = _data()
    assert ModelBridge(plain_plate, (x, y)).data_rows == (N, "obs", "data")
    assert ModelBridge(no_plate, (x, y)).data_rows == (N, "obs", None)
    assert ModelBridge(subsampled, (x, y)).data_rows is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_full_batch(ModelBridge(plain_plate, (x, y)), "Engine", full_batch=True)


def test_sample_then_optimize_names_a_forgotten_subsample_size_and_takes_full_batch():
    data = _data()
    engine = SampleThenOptimize(plain_plate, num_samples=4, num_epochs=2, seed=0, progress_bar=False)
    with pytest.warns(
        UserWarning, match=r"^SampleThenOptimize: observed site 'obs' sits in plate 'data' of 10000 rows"
    ):
        engine.run(*data)
    quiet = SampleThenOptimize(plain_plate, num_samples=4, num_epochs=2, seed=0, progress_bar=False, full_batch=True)
    with _quiet():
        quiet.run(*data)


@pytest.mark.parametrize(
    "engine, purpose",
    [
        (lambda m: SWAG(m, num_epochs=1, progress_bar=False), "SWAG"),
        (lambda m: DiagonalEKF(m, progress_bar=False), "EKF"),
    ],
)
@pytest.mark.parametrize("model", [plain_plate, no_plate])
def test_the_engines_that_need_a_subsampled_plate_write_it_in_their_error(engine, purpose, model):
    x, y = _data(500)  # refused at any size: the plate to write is named with a minibatch for these rows
    with pytest.raises(
        ModelError,
        match=rf"{purpose}.*the model has 0: observed site 'obs' runs on all 500 rows at "
        r"every step\. Write `with pyro\.plate\('data', 500, subsample_size=100\) as idx:`",
    ):
        engine(model).run(x, y)


def test_laplace_reads_the_full_data_by_design_and_says_nothing():
    with _quiet():
        posterior = AutoLinearizedLaplace(plain_plate).laplace_approximation(
            *_data(), map_latents={"w": torch.tensor(0.5)}, check_map=False
        )
    assert posterior.get_samples(2, seed=0)["w"].shape == (2,)
