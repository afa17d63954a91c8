"""SampleThenOptimize checkpoints: a run stopped mid-solve resumes to bitwise the draws of an uninterrupted run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import SampleThenOptimize
from pyro_scalable.infer.checkpoint import CheckpointError, load, save
from pyro_scalable.infer.linearized.sampling import core
from tests.conftest import LinearRegression
from tests.infer import killing
from tests.infer.sample_then_optimize import killable_run


class Killed(Exception):
    """Stands for SIGKILL in this process: the run stops between two optimiser steps and writes nothing more.

    ``test_a_sigkill_during_a_checkpoint_write_resumes_exactly`` kills a child process with a real SIGKILL.
    """


def engine(problem, path=None, **options):
    settings = dict(num_samples=4, num_epochs=3, em_steps=2, em_epochs=2, seed=1, progress_bar=False)
    settings.update(options)
    return SampleThenOptimize(problem.model, checkpoint=path, **settings)


def kill_at(monkeypatch, call):
    original, calls = core.step, []

    def step(*args, **kwargs):
        calls.append(None)
        if len(calls) == call:
            raise Killed
        return original(*args, **kwargs)

    monkeypatch.setattr(core, "step", step)


def assert_same_run(run, reference):
    for name, value in reference.get_unconstrained_samples(group_by_chain=True).items():
        assert torch.equal(run.get_unconstrained_samples(group_by_chain=True)[name], value), name
    for name, value in reference.sample_stats.items():
        assert torch.equal(run.sample_stats[name], value), name
    for name in reference.em_history.keys() - {"groups"}:  # the prior precision, gamma (and the noise scale)
        assert torch.equal(run.em_history[name], reference.em_history[name]), name
    for name, values in reference.trace.items():
        assert torch.equal(torch.stack(run.trace[name]), torch.stack(values)), name


# steps per epoch: 200 // 50 = 4; solves of 3, 2 and 2 epochs: steps 1-12, 13-20 and 21-28. Killed at step 23, the
# run goes back to the end of the second solve (before its EM update).
@pytest.mark.parametrize(
    "kill, step_size, em_step, em_noise",
    [(7, None, 0, False), (18, None, 1, False), (23, 0.3, 1, False), (23, None, 1, True)],
    ids=["first-solve", "em-solve", "end-of-solve", "em-noise"],  # a given step size: for the preconditioned gradient
)
def test_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch, kill, step_size, em_step, em_noise):
    problem = LinearRegression(num_data=200, dim=3, batch_size=50)
    reference = engine(problem, step_size=step_size, em_noise=em_noise)
    reference.run(problem.x, problem.y)
    path = tmp_path / "run.pt"
    with monkeypatch.context() as patch:
        kill_at(patch, kill)
        with pytest.raises(Killed):
            engine(problem, path, step_size=step_size, em_noise=em_noise).run(problem.x, problem.y)
    assert load(path)["em_step"] == em_step
    resumed = engine(problem, path, step_size=step_size, em_noise=em_noise)
    resumed.run(problem.x, problem.y)
    assert_same_run(resumed, reference)
    if em_noise:  # the noise the killed run had fitted is put back: the resumed run's draws equal the reference's
        assert float(resumed.noise_scale) != 1.0 and torch.equal(resumed.noise_scale, reference.noise_scale)


@pytest.mark.filterwarnings("ignore:the samples have not converged:UserWarning")  # a few epochs: not the point here
def test_a_different_configuration_is_refused(tmp_path):
    problem = LinearRegression(num_data=200, dim=3, batch_size=50)
    path = tmp_path / "run.pt"
    engine(problem, path).run(problem.x, problem.y)
    with pytest.raises(CheckpointError, match="num_epochs is 3 there and 4 here"):
        engine(problem, path, num_epochs=4).run(problem.x, problem.y)
    engine(problem, path, num_epochs=4, resume=False).run(problem.x, problem.y)
    assert load(path)["fingerprint"]["num_epochs"] == "4"


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.parametrize("moment", killing.MOMENTS)
def test_a_sigkill_during_a_checkpoint_write_resumes_exactly(tmp_path, moment):
    path = tmp_path / "run.pt"
    # one checkpoint per epoch (3 + 2 + 2 epochs): a real SIGKILL inside the 4th write, in the second solve
    killing.run_until_killed(Path(killable_run.__file__), str(path), "4", moment)
    renamed = moment == "after-rename"
    assert load(path)["em_step"] == (1 if renamed else 0)  # the old checkpoint whole, or the new one whole
    assert (tmp_path / "run.pt.tmp").exists() != renamed
    resumed = killable_run.engine(path)
    resumed.run(*killable_run.data())
    reference = killable_run.engine()
    reference.run(*killable_run.data())
    assert_same_run(resumed, reference)
    assert os.listdir(tmp_path) == ["run.pt"]


def noisier_model(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    with pyro.plate("data", len(y), subsample_size=50) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, 2.0), obs=y[idx])


noisier_model.__qualname__ = noisier_model.__name__ = "model"  # the same name: only the code tells them apart


@pytest.mark.filterwarnings("ignore:the samples have not converged:UserWarning")
def test_an_edited_model_or_changed_data_is_refused(tmp_path):
    path = tmp_path / "run.pt"
    x, y = killable_run.data()
    killable_run.engine(path).run(x, y)
    with pytest.raises(CheckpointError, match="the model's code changed since the checkpoint was written"):
        killable_run.engine(path, noisier_model).run(x, y)
    y = y.clone()
    y[7] += 1e-9
    with pytest.raises(CheckpointError, match="the data's values changed since the checkpoint was written"):
        killable_run.engine(path).run(x, y)


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"a": 1}, r"is not a pyro_scalable checkpoint \(a torch file holding a dict\)"),
        ({"kind": "StochasticMCMC", "format": 3}, "was written by StochasticMCMC, not by SampleThenOptimize"),
        ({"kind": "SampleThenOptimize", "format": 2}, "checkpoint format 2 .*this version reads format 4"),
    ],
    ids=["foreign", "another-engine", "old-format"],
)
def test_a_foreign_file_is_a_checkpoint_error(tmp_path, payload, message):
    path = tmp_path / "run.pt"
    if "kind" in payload:
        save(path, payload)
    else:
        torch.save(payload, path)
    with pytest.raises(CheckpointError, match=message):
        killable_run.engine(path).run(*killable_run.data())


@pytest.mark.filterwarnings("ignore:the samples have not converged:UserWarning")
def test_a_drawn_seed_is_recorded_and_reused_on_resume(tmp_path, monkeypatch):
    # seed=None draws from torch's global generator: the resumed run must go on with the interrupted run's seed
    problem = LinearRegression(num_data=200, dim=3, batch_size=50)
    torch.manual_seed(11)
    reference = engine(problem, seed=None)
    reference.run(problem.x, problem.y)
    path = tmp_path / "run.pt"
    torch.manual_seed(11)
    with monkeypatch.context() as patch:
        kill_at(patch, 18)
        with pytest.raises(Killed):
            engine(problem, path, seed=None).run(problem.x, problem.y)
    torch.manual_seed(12)  # another process, another global seed
    resumed = engine(problem, path, seed=None)
    resumed.run(problem.x, problem.y)
    assert_same_run(resumed, reference)


@pytest.mark.filterwarnings("ignore:the samples have not converged:UserWarning")
def test_settings_by_content_and_data_by_keyword(tmp_path):
    problem = LinearRegression(num_data=200, dim=3, batch_size=50)
    path = tmp_path / "run.pt"
    engine(problem, path, prior_precision=torch.tensor(1.001)).run(problem.x, problem.y)
    engine(problem, path, prior_precision=torch.tensor(1.001)).run(problem.x, y=problem.y)  # the same run
    with pytest.raises(CheckpointError, match="prior_precision"):
        engine(problem, path, prior_precision=torch.tensor(1.002)).run(problem.x, problem.y)
