"""Checkpoint and resume: a killed run goes on bitwise as if it had never stopped, and no draw is ever lost."""

from __future__ import annotations

import errno
import os
import pickle
import queue
import signal
import stat
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC
from pyro_scalable.infer.checkpoint import CheckpointError, CheckpointWriteError, load, save
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from pyro_scalable.infer.sgmcmc.checkpoint import unstack_chains

from ...conftest import LinearRegression
from ...model_zoo import zoo_model
from .. import killing
from . import killable_run

# SGLD's warm-up computes Hessian-vector products with torch.func.jvp, whose first call in a process has torch
# script its decompositions and warn that torch.jit.script is deprecated: a torch internal, not ours to act on.
pytestmark = pytest.mark.filterwarnings(r"ignore:.*torch\.jit\.script. is deprecated:DeprecationWarning")


class Killed(Exception):
    """Stands for SIGKILL inside the test process: the run stops between two steps and writes nothing more."""


def sampler(kernel, path=None, **options):
    settings = dict(num_samples=12, num_warmup=6, num_chains=3, seed=5, progress_bar=False, checkpoint_every=4)
    settings.update(options)
    return StochasticMCMC(kernel, checkpoint=path, **settings)


def stop_at(monkeypatch, call, error=Killed, after=False):
    """Make the ``call``-th step (1-based) raise ``error``, before the step or (``after``) once it has run."""
    original = ChainStepper.step
    calls = []

    def step(self, batch, step_index, density):
        calls.append(None)
        if len(calls) == call and not after:
            raise error
        info = original(self, batch, step_index, density)
        if len(calls) == call:
            raise error
        return info

    monkeypatch.setattr(ChainStepper, "step", step)


def assert_same_run(run, reference):
    assert run.num_samples == reference.num_samples
    for name, value in reference.get_unconstrained_samples(group_by_chain=True).items():
        assert torch.equal(run.get_unconstrained_samples(group_by_chain=True)[name], value), name
    assert run.sample_stats.keys() == reference.sample_stats.keys()
    for name, value in reference.sample_stats.items():
        torch.testing.assert_close(run.sample_stats[name], value, rtol=0, atol=0, equal_nan=True, msg=name)
    assert run.num_warmup_divergences == reference.num_warmup_divergences


def small():
    return LinearRegression(num_data=120, batch_size=10)


def test_a_killed_process_resumes_exactly(tmp_path):
    if not hasattr(signal, "SIGKILL"):
        pytest.skip("needs SIGKILL")
    path = tmp_path / "run.pt"
    script = Path(killable_run.__file__)
    root = str(script.parents[3])  # the repository, so that the script imports this checkout's pyro_scalable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, str(script), str(path), "0.05"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if path.exists() and load(path)["step"] >= killable_run.NUM_WARMUP + 5:
                os.kill(process.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        assert process.poll() is None or process.wait() == -signal.SIGKILL, process.communicate()[1].decode()
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
    saved = load(path)
    assert killable_run.NUM_WARMUP < saved["step"] < killable_run.NUM_WARMUP + killable_run.NUM_SAMPLES
    assert saved["kept"] > 0

    resumed = killable_run.sampler(path)
    resumed.run(*killable_run.data())
    reference = killable_run.sampler()
    reference.run(*killable_run.data())
    assert_same_run(resumed, reference)
    assert torch.equal(
        resumed.get_unconstrained_samples(group_by_chain=True)["w"][:, : saved["kept"]], saved["draws"]["w"]
    )


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_real_signal_keeps_the_draws_and_resumes_exactly(tmp_path, name):
    """A child run gets a real Ctrl-C or a scheduler's SIGTERM mid-run: it exits cleanly, with the checkpoint written,
    its lock released and the draws it took, and the run resumed here is bitwise the uninterrupted one."""
    path, kept_file, stderr = tmp_path / "run.pt", tmp_path / "kept.pt", tmp_path / "stderr.txt"
    script = Path(killable_run.__file__)
    with open(stderr, "wb") as errors:
        process = subprocess.Popen(
            [sys.executable, str(script), str(path), "signalled", str(kept_file)],
            stdout=subprocess.PIPE,
            stderr=errors,
            env=child_env(),
        )
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [*map(lines.put, process.stdout), lines.put(None)], daemon=True)
    reader.start()
    try:
        announced = f"step {killable_run.ANNOUNCED}".encode()
        while True:
            try:
                line = lines.get(timeout=120)
            except queue.Empty:
                line = None
            assert line is not None, f"the child never reached {announced}: {stderr.read_text()}"
            if line.strip() == announced:
                break
        os.kill(process.pid, getattr(signal, name))
        assert process.wait(timeout=120) == 0, stderr.read_text()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        reader.join(timeout=60)  # the child's end closed the pipe: the reader is at its end
        process.stdout.close()
    assert "interrupted: keeping the" in stderr.read_text()
    assert sorted(os.listdir(tmp_path)) == ["kept.pt", "run.pt", "stderr.txt"]  # no lock or temporary left
    saved, kept = load(path), torch.load(kept_file)["w"]
    # the child announces a step before the driver's bookkeeping of it: a signal may cut that short (then redone)
    assert killable_run.ANNOUNCED - 1 <= saved["step"] < killable_run.NUM_WARMUP + killable_run.NUM_SAMPLES
    # the draw of a step the signal cut short after it was recorded is kept by the child, and redone on resume
    assert 0 < saved["kept"] <= kept.shape[1] <= saved["kept"] + 1
    reference = killable_run.sampler()
    reference.run(*killable_run.data())
    expected = reference.get_unconstrained_samples(group_by_chain=True)["w"]
    assert torch.equal(kept, expected[:, : kept.shape[1]])
    assert torch.equal(saved["draws"]["w"], expected[:, : saved["kept"]])
    resumed = killable_run.sampler(path)
    resumed.run(*killable_run.data())
    assert_same_run(resumed, reference)


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential", "fallback"])
def test_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch, chain_method):
    data = small()
    model = data.model
    if chain_method == "fallback":

        def model(x, y):
            w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            if bool(w.detach().abs().max() > 1e6):  # Python control flow on a value: vmap cannot batch it
                raise AssertionError
            with pyro.plate("data", len(y), subsample_size=10) as idx:
                pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

    def kernel():
        return SGHMC(model, step_size=1e-3, friction=10.0)

    method = "sequential" if chain_method == "sequential" else "vectorized"
    with pytest.warns(UserWarning, match="one after another") if chain_method == "fallback" else nullcontext():
        reference = sampler(kernel(), chain_method=method)
        reference.run(data.x, data.y)
    path = tmp_path / "run.pt"
    with monkeypatch.context() as patch:
        stop_at(patch, 15)
        with pytest.raises(Killed), pytest.warns(UserWarning) if chain_method == "fallback" else nullcontext():
            sampler(kernel(), path, chain_method=method).run(data.x, data.y)
    saved = load(path)
    assert (saved["step"], saved["kept"]) == (12, 6)
    assert saved["mode"] == ("vectorized" if chain_method == "vectorized" else "sequential")
    resumed = sampler(kernel(), path, chain_method=method)
    resumed.run(data.x, data.y)
    assert_same_run(resumed, reference)


# seven warm-up steps choose a step size too coarsely for calibrated draws (the driver may warn that the gradient
# noise could not be corrected): this test is about resuming that choice exactly, not about its quality
@pytest.mark.filterwarnings("ignore:in .* of the coordinates of the kept steps:UserWarning")
@pytest.mark.parametrize("stop, written", [(6, 4), (8, 7)], ids=["in-warmup", "after-warmup"])
@pytest.mark.parametrize("kernel", [SGLD, SGHMC])  # SGHMC: a friction per coordinate too
def test_the_step_size_chosen_in_warmup_survives(tmp_path, monkeypatch, stop, written, kernel):
    data = small()
    reference = sampler(kernel(data.model), num_warmup=7, num_samples=4)
    reference.run(data.x, data.y)
    path = tmp_path / "run.pt"
    with monkeypatch.context() as patch:
        stop_at(patch, stop)
        with pytest.raises(Killed):
            sampler(kernel(data.model), path, num_warmup=7, num_samples=4).run(data.x, data.y)
    assert load(path)["step"] == written  # every 4 steps, and at the end of warm-up
    resumed = sampler(kernel(data.model), path, num_warmup=7, num_samples=4)
    resumed.run(data.x, data.y)
    assert_same_run(resumed, reference)
    assert bool(torch.isfinite(resumed.sample_stats["step_size"]).all())
    if kernel is SGHMC:
        assert bool(torch.isfinite(resumed.sample_stats["friction"]).all())


def test_keyboard_interrupt_keeps_the_draws_and_a_valid_checkpoint(tmp_path, monkeypatch):
    data = small()
    kernel = SGHMC(data.model, step_size=1e-3)
    reference = sampler(kernel)
    reference.run(data.x, data.y)
    path = tmp_path / "run.pt"
    interrupted = sampler(kernel, path)
    with monkeypatch.context() as patch:
        # the 14th step runs (its noise and minibatch are drawn) and then the interrupt arrives
        stop_at(patch, 14, KeyboardInterrupt, after=True)
        with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning, match="interrupted"):
            interrupted.run(data.x, data.y)
    assert interrupted.num_samples == 7
    expected = reference.get_unconstrained_samples(group_by_chain=True)["w"][:, :7]
    assert torch.equal(interrupted.get_unconstrained_samples(group_by_chain=True)["w"], expected)
    saved = load(path)
    assert (saved["step"], saved["kept"]) == (13, 7)  # the last completed step: the 14th is redone on resume
    assert torch.equal(saved["draws"]["w"], expected)
    resumed = sampler(kernel, path)
    resumed.run(data.x, data.y)
    assert_same_run(resumed, reference)


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs SIGTERM")
def test_sigterm_writes_the_checkpoint_keeps_the_draws_and_releases_the_lock(tmp_path, monkeypatch):
    """A batch scheduler's SIGTERM is handled as Ctrl-C while a checkpointed run steps; the resumed run is the same."""
    data = small()
    kernel = SGHMC(data.model, step_size=1e-3)
    reference = sampler(kernel)
    reference.run(data.x, data.y)
    path = tmp_path / "run.pt"
    original = ChainStepper.step
    calls = []

    def step(self, batch, step_index, density):
        info = original(self, batch, step_index, density)
        calls.append(None)
        if len(calls) == 14:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread at the next bytecode
        return info

    before = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patch:
        patch.setattr(ChainStepper, "step", step)
        with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning, match="interrupted"):
            sampler(kernel, path).run(data.x, data.y)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the run's only while it steps
    assert load(path)["kept"] == 7
    resumed = sampler(kernel, path)  # the same process: the interrupted run gave its lock up
    resumed.run(data.x, data.y)
    assert_same_run(resumed, reference)


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    data = small()
    kernel = SGHMC(data.model, step_size=1e-3)
    reference = sampler(kernel)
    reference.run(data.x, data.y)
    path = tmp_path / "run.pt"
    fsync = os.fsync
    writes = []

    def failing_fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):  # the temporary file, not the folder
            writes.append(None)
            if len(writes) == 3:
                os.ftruncate(fd, os.fstat(fd).st_size // 2)  # half of the file reached the disk
                raise OSError("no space left on device")
        fsync(fd)

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(OSError, match="no space"):
            sampler(kernel, path).run(data.x, data.y)
    assert load(path)["step"] == 6  # the second checkpoint (steps 4 and 6, the end of warm-up), whole
    assert os.listdir(tmp_path) == ["run.pt"]  # no half-written temporary left behind
    resumed = sampler(kernel, path)
    resumed.run(data.x, data.y)
    assert_same_run(resumed, reference)


def test_a_different_configuration_is_refused(tmp_path):
    data = small()
    path = tmp_path / "run.pt"
    sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, data.y)
    other = sampler(SGHMC(data.model, step_size=2e-3), path, num_samples=20)
    with pytest.raises(CheckpointError, match=r"num_samples is 12 there and 20 here.*resume=False") as error:
        other.run(data.x, data.y)
    assert "step_size=0.002" in str(error.value)
    fresh = sampler(SGHMC(data.model, step_size=2e-3), path, num_samples=20, resume=False)
    fresh.run(data.x, data.y)
    assert fresh.num_samples == 20
    assert "num_samples" in load(path)["fingerprint"] and load(path)["kept"] == 20


def test_a_finished_run_is_read_back(tmp_path, monkeypatch):
    data = small()
    path = tmp_path / "run.pt"
    first = sampler(SGHMC(data.model, step_size=1e-3), path)
    first.run(data.x, data.y)
    again = sampler(SGHMC(data.model, step_size=1e-3), path)
    stop_at(monkeypatch, 1)  # no step is taken again
    again.run(data.x, data.y)
    assert_same_run(again, first)


def test_a_loader_run_resumes_by_skipping_the_consumed_minibatches(tmp_path, monkeypatch):
    num_data = 50

    def model(x, y, idx):
        w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", num_data, subsample=idx):
            pyro.sample("obs", dist.Normal(x @ w, 1.0), obs=y)

    data = small()
    dataset = TensorDataset(data.x[:num_data], data.y[:num_data], torch.arange(num_data))

    def loader():  # shuffled, from a seeded generator: iterating it again gives the same minibatches
        return DataLoader(dataset, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(0))

    kernel = SGLD(model, step_size=1e-3)
    reference = sampler(kernel)
    reference.run(batches=loader())
    path = tmp_path / "run.pt"
    with monkeypatch.context() as patch:
        stop_at(patch, 11)
        with pytest.raises(Killed):
            sampler(kernel, path).run(batches=loader())
    resumed = sampler(kernel, path)
    resumed.run(batches=loader())
    assert_same_run(resumed, reference)
    y = data.y[:num_data].clone()
    y[0] += 1e-9  # the loader's dataset is all the data a loader run has: its tensors enter the fingerprint
    changed = DataLoader(TensorDataset(data.x[:num_data], y, torch.arange(num_data)), batch_size=10)
    with pytest.raises(CheckpointError, match="the data's values changed"):
        sampler(kernel, path).run(batches=changed)


def test_resume_on_the_data_device(tmp_path, monkeypatch, device):
    data = LinearRegression(num_data=120, batch_size=10, device=device)
    kernel = SGLD(data.model, step_size=1e-3)
    reference = sampler(kernel)
    reference.run(data.x, data.y)
    path = tmp_path / "run.pt"
    with monkeypatch.context() as patch:
        stop_at(patch, 10)
        with pytest.raises(Killed):
            sampler(kernel, path).run(data.x, data.y)
    assert load(path)["fingerprint"]["device"] == repr(device.type)
    resumed = sampler(kernel, path)
    resumed.run(data.x, data.y)
    assert_same_run(resumed, reference)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.parametrize("moment", killing.MOMENTS)
def test_a_sigkill_during_a_checkpoint_write_resumes_exactly(tmp_path, moment):
    path = tmp_path / "run.pt"
    # checkpoints at steps 5, 10, 15, ...: the child kills itself with a real SIGKILL inside the third write
    killing.run_until_killed(Path(killable_run.__file__), str(path), "0", "3", moment)
    renamed = moment == "after-rename"
    assert load(path)["step"] == (15 if renamed else 10)  # the old checkpoint whole, or the new one whole
    assert (tmp_path / "run.pt.tmp").exists() != renamed
    resumed = killable_run.sampler(path)
    resumed.run(*killable_run.data())
    reference = killable_run.sampler()
    reference.run(*killable_run.data())
    assert_same_run(resumed, reference)
    assert os.listdir(tmp_path) == ["run.pt"]


def edited(kind: str, scale: float = 1.0):
    """A regression model, or the same one edited in one way, always under the same name."""
    if kind == "body":

        def model(x, y):
            w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            with pyro.plate("data", len(y), subsample_size=10) as idx:
                pyro.sample("obs", dist.Normal(x[idx] @ w, 2.0), obs=y[idx])  # 2.0 where the others have 1.0

        return model
    if kind == "default":

        def model(x, y, noise=scale):
            w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
            with pyro.plate("data", len(y), subsample_size=10) as idx:
                pyro.sample("obs", dist.Normal(x[idx] @ w, noise), obs=y[idx])

        return model
    if kind == "module":

        class Regression(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("noise", torch.tensor(scale, dtype=torch.float64))

            def forward(self, x, y):
                w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
                with pyro.plate("data", len(y), subsample_size=10) as idx:
                    pyro.sample("obs", dist.Normal(x[idx] @ w, self.noise), obs=y[idx])

        return Regression()
    noise = torch.tensor(scale, dtype=torch.float64)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", len(y), subsample_size=10) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w, noise), obs=y[idx])

    return model


@pytest.mark.parametrize(
    "before, after",
    [(("closure", 1.0), ("body", 1.0)), (("closure", 1.0), ("closure", 2.0)), (("default", 1.0), ("default", 2.0))]
    + [(("module", 1.0), ("module", 2.0))],
    ids=["body", "closure", "default", "module-buffer"],
)
def test_an_edited_model_is_refused(tmp_path, before, after):
    data = small()
    path = tmp_path / "run.pt"
    sampler(SGHMC(edited(*before), step_size=1e-3), path).run(data.x, data.y)
    same = sampler(SGHMC(edited(*before), step_size=1e-3), path)  # the same code and values, built again
    same.run(data.x, data.y)
    assert same.num_samples == 12
    with pytest.raises(CheckpointError, match="the model's code changed since the checkpoint was written") as error:
        sampler(SGHMC(edited(*after), step_size=1e-3), path).run(data.x, data.y)
    assert "pass a new checkpoint path" in str(error.value) and str(path) in str(error.value)


def test_changed_data_values_are_refused(tmp_path):
    data = small()
    path = tmp_path / "run.pt"
    sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, data.y)
    y = data.y.clone()
    y[3] += 1e-9
    with pytest.raises(CheckpointError, match="the data's values changed since the checkpoint was written"):
        sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, y)


def damage(path: Path, how: str) -> None:
    """Spoil the checkpoint at ``path`` in one way."""
    data = path.read_bytes()
    if how == "flipped-byte":
        spoiled = bytearray(data)
        spoiled[len(data) * 3 // 4] ^= 0x40  # inside the draws
        path.write_bytes(bytes(spoiled))
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "foreign-torch":
        torch.save({"a": 1}, path)
    elif how == "foreign-pickle":
        with open(path, "wb") as file:
            pickle.dump(["not", "a", "checkpoint"], file)
    elif how == "old-format":
        torch.save({"format": 2, "fingerprint": {}, "step": 0}, path)  # as pyro_scalable wrote them before
    else:
        saved = load(path)
        if how == "another-engine":
            saved["kind"] = "SampleThenOptimize"
        else:
            del saved["draws"]
        save(path, saved)


@pytest.mark.parametrize(
    "how, message",
    [
        ("flipped-byte", "is damaged: its contents do not match the checksum"),
        ("truncated", "is truncated"),
        ("empty", "is not a pyro_scalable checkpoint"),
        ("foreign-torch", r"is not a pyro_scalable checkpoint \(a torch file holding a dict\)"),
        ("foreign-pickle", "is not a pyro_scalable checkpoint"),
        ("old-format", "was written by an older pyro_scalable"),
        ("another-engine", "was written by SampleThenOptimize, not by StochasticMCMC"),
        ("missing-key", "lacks 'draws'"),
    ],
)
def test_a_damaged_or_foreign_file_is_a_checkpoint_error(tmp_path, how, message):
    data = small()
    path = tmp_path / "run.pt"
    sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, data.y)
    damage(path, how)
    with pytest.raises(CheckpointError, match=message) as error:
        sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, data.y)
    assert "\n" not in str(error.value)
    assert "Delete it or pass another checkpoint path (or resume=False)" in str(error.value)


def test_a_stray_temporary_is_removed(tmp_path, monkeypatch):
    data = small()
    path = tmp_path / "run.pt"
    first = sampler(SGHMC(data.model, step_size=1e-3), path)
    first.run(data.x, data.y)
    (tmp_path / "run.pt.tmp").write_bytes(b"half a checkpoint")  # as a write killed before its rename leaves it
    again = sampler(SGHMC(data.model, step_size=1e-3), path)
    stop_at(monkeypatch, 1)  # a finished run: read back without a step, and without a write
    again.run(data.x, data.y)
    assert_same_run(again, first)
    assert os.listdir(tmp_path) == ["run.pt"]


# ------------------------------------------------------------------ a changed run is refused, whatever changed

STEP = 1e-3  # read by a schedule as a global


def global_schedule(step):
    return STEP / (1 + step) ** 0.1


@pytest.mark.parametrize(
    "before, after",
    [
        (dict(step_size=lambda t: 1e-3), dict(step_size=lambda t: 2e-3)),  # a lambda: the same repr
        (dict(step_size=global_schedule), dict(step_size=global_schedule, global_step=2e-3)),  # a global it reads
        (dict(step_size=torch.tensor(0.00101)), dict(step_size=torch.tensor(0.00104))),  # prints the same
        (dict(init_strategy="median"), dict(init_strategy="sample")),
        (dict(minibatches="epoch"), dict(minibatches="independent")),
    ],
    ids=["lambda", "global", "tensor", "init-strategy", "minibatches"],
)
def test_any_change_of_the_run_is_refused(tmp_path, monkeypatch, before, after):
    from pyro.infer.autoguide import init_to_median, init_to_sample

    inits = {"median": init_to_median, "sample": init_to_sample}
    data = small()
    path = tmp_path / "run.pt"

    def build(options):
        options = dict(options)
        if "global_step" in options:
            monkeypatch.setitem(globals(), "STEP", options.pop("global_step"))
        kernel = {k: inits.get(v, v) if k == "init_strategy" else v for k, v in options.items() if k != "minibatches"}
        kernel.setdefault("step_size", 1e-3)
        driver = {k: v for k, v in options.items() if k == "minibatches"}
        return sampler(SGLD(data.model, **kernel), path, num_samples=4, num_warmup=2, **driver)

    build(before).run(data.x, data.y)
    build(before).run(data.x, data.y)  # the same run again: read back
    with pytest.raises(CheckpointError, match="was written by a different run"):
        build(after).run(data.x, data.y)


def test_the_same_data_by_keyword_is_the_same_run(tmp_path, monkeypatch):
    data = small()
    path = tmp_path / "run.pt"
    first = sampler(SGLD(data.model, step_size=1e-3), path)
    first.run(data.x, data.y)
    again = sampler(SGLD(data.model, step_size=1e-3), path)
    stop_at(monkeypatch, 1)  # read back, without a step
    again.run(data.x, y=data.y)
    assert_same_run(again, first)


NOISE = torch.Generator().manual_seed(0)  # a model reading it is not a function of its code and data


def noisy_model(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    jitter = 0.0 * NOISE.initial_seed()
    with pyro.plate("data", len(y), subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w + jitter, 1.0), obs=y[idx])


def test_a_component_that_cannot_be_identified_is_refused_and_named(tmp_path):
    data = small()
    path = tmp_path / "run.pt"
    sampler(SGLD(noisy_model, step_size=1e-3), path, num_samples=2, num_warmup=1).run(data.x, data.y)
    with pytest.raises(CheckpointError, match=r"the global 'NOISE' read by noisy_model \(a torch\._C\.Generator"):
        sampler(SGLD(noisy_model, step_size=1e-3), path, num_samples=2, num_warmup=1).run(data.x, data.y)


# ------------------------------------------------------------------ the file system: planted files, faults, locks


def test_a_planted_symlink_at_the_temporary_is_never_followed(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    path = tmp_path / "run.pt"
    (tmp_path / "run.pt.tmp").symlink_to(target)
    with pytest.raises(CheckpointWriteError, match=r"run\.pt\.tmp' appeared while it was being written"):
        save(path, {"a": torch.zeros(3)})
    assert target.read_text() == "keep me" and not path.exists()


def test_an_unusable_path_fails_before_the_first_step(tmp_path, monkeypatch):
    data = small()
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "run.pt"  # a parent that is a file
    stop_at(monkeypatch, 1)  # a step would raise Killed
    with pytest.raises(
        CheckpointWriteError, match=r"cannot write the checkpoint '.*file/run\.pt': '.*file' is a file, not a folder"
    ):
        sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, data.y)
    with pytest.raises(CheckpointWriteError, match="is a folder"):
        sampler(SGHMC(data.model, step_size=1e-3), tmp_path).run(data.x, data.y)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS, errno.EACCES], ids=["full", "read-only", "denied"])
def test_a_failed_write_names_the_path_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, error):
    data = small()
    path = tmp_path / "run.pt"
    replace, calls = os.replace, []

    def failing_replace(source, target):
        calls.append(None)
        if len(calls) == 2:
            raise OSError(error, os.strerror(error))
        replace(source, target)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(CheckpointWriteError) as raised:
        sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, data.y)
    message = str(raised.value)
    assert f"cannot write the checkpoint {str(path)!r}: {os.strerror(error)}" in message
    assert "the previous checkpoint there is intact" in message and raised.value.errno == error
    assert load(path)["step"] == 4 and os.listdir(tmp_path) == ["run.pt"]


def test_a_second_writer_of_the_same_checkpoint_is_refused(tmp_path):
    data = small()
    path = tmp_path / "run.pt"
    holder = subprocess.Popen(  # another process holding the checkpoint's lock
        [sys.executable, "-c", LOCK_HOLDER, str(path)], stdout=subprocess.PIPE, env=child_env()
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(CheckpointError, match=r"the checkpoint '.*run\.pt' is being written by another run"):
            sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, data.y)
    finally:
        holder.kill()
        holder.communicate()
    sampler(SGHMC(data.model, step_size=1e-3), path).run(data.x, data.y)  # free again: the lock died with it
    assert os.listdir(tmp_path) == ["run.pt"]


LOCK_HOLDER = """
import sys, time
from pyro_scalable.infer.checkpoint import CheckpointLock
lock = CheckpointLock(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def child_env() -> dict[str, str]:
    root = str(Path(__file__).parents[3])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


# ------------------------------------------------------------------ bitwise at the defaults


def test_a_saved_state_keeps_the_dtypes_it_had():
    # a leaf a run promoted (a float32 step size turned float64) is put back as it was, not cast to the fresh one's
    template = {"step_size": torch.zeros(4, dtype=torch.float32), "count": torch.zeros(4, dtype=torch.int64)}
    saved = [torch.full((4,), 1 / 3, dtype=torch.float64), torch.arange(4)]
    restored = unstack_chains(saved, template, "vectorized")
    assert torch.equal(restored["step_size"], saved[0]) and restored["step_size"].dtype == torch.float64


def test_the_model_tracing_goes_on_where_it_was(tmp_path, monkeypatch):
    # the model's recorded graph agrees with Pyro's evaluation to rounding, not to the bit: a resumed run replays it
    # from the step the uninterrupted run did (TRACE_AFTER calls of a signature), not TRACE_AFTER steps after resuming
    data = small()

    def graphs(path=None, stop=None):
        seen = []
        original = ChainStepper.step

        def step(self, batch, step_index, density):
            info = original(self, batch, step_index, density)
            seen.append(len(self.bridge.traced.graphs))
            if len(seen) == stop:
                raise KeyboardInterrupt
            return info

        with monkeypatch.context() as patch:
            patch.setattr(ChainStepper, "step", step)
            with pytest.raises(KeyboardInterrupt) if stop else nullcontext():
                sampler(SGHMC(data.model, step_size=1e-3), path, num_samples=30).run(data.x, data.y)
        return seen

    reference = graphs()
    first = reference.index(1)  # the step at which the step's signature was recorded
    assert 4 < first < len(reference) - 1
    path = tmp_path / "run.pt"
    with pytest.warns(UserWarning, match="interrupted"):
        graphs(path, stop=4)
    assert graphs(path) == reference[3:]


def resume_at_the_defaults(tmp_path, monkeypatch, stop):
    # SGHMC(model) at its defaults: the "map" control variate and warm-up's metric, 4 chains, 200 warm-up steps
    model, args = zoo_model("linear-halfnormal-scale", torch.float64)

    def run(path=None):
        return StochasticMCMC(SGHMC(model), 2, 200, 4, seed=7, progress_bar=False, checkpoint=path)

    reference = run()
    reference.run(*args)
    path = tmp_path / "run.pt"
    with monkeypatch.context() as patch:
        stop_at(patch, stop, KeyboardInterrupt, after=True)  # as SIGINT: the step runs, the interrupt arrives
        with pytest.raises(KeyboardInterrupt):
            run(path).run(*args)
    assert load(path)["step"] == stop - 1
    resumed = run(path)
    resumed.run(*args)
    assert_same_run(resumed, reference)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "stop",
    [
        3,
        10,  # in the metric's first stage: the float32 leaves the first steps promote (test_a_saved_state_keeps...)
        30,  # the first stage's last step: the window ends on resume (its Hessian at the window's mean)
        60,  # later stages: the model's recorded graph replays the calls it replayed in the uninterrupted run
        130,
    ],
)
def test_resume_at_the_defaults_is_bitwise(tmp_path, monkeypatch, stop):
    resume_at_the_defaults(tmp_path, monkeypatch, stop)
