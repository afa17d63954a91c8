"""Sample- and data-parallel sample-then-optimise on 2 gloo ranks (torchrun) against one process, float64.

The runs are in ``distributed_worker.py``, launched once for the module. Sample-parallel ranks solve their block of
rows with the very noise one process draws for those rows, on the same minibatches with the same step size, so
they differ from one process only in how many rows share a batched product (at most the last bits); data-parallel
ranks differ only in the order of the floating-point sums over points (each rank sums its share, the all-reduce
adds the shares). The solves are contractions, so ``rtol=1e-10`` leaves orders of magnitude of room and still
catches a missing share (a factor 2 in M), a redrawn noise or an EM step on one rank's samples only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pyro_scalable.infer import SampleThenOptimize

from . import distributed_worker as worker

WORKER = Path(__file__).with_name("distributed_worker.py")
RANKS = 2
TOLERANCE = dict(rtol=1e-10, atol=1e-12)

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is unavailable",
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distributed_sto")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    done = subprocess.run([*command, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return out


def load(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / f"{name}.rank{rank}.pt")


def one_process(name: str) -> dict:
    mode, model, options = worker.scenarios()[name]
    kind = "classification" if model is worker.classification else "regression"
    return worker.result(worker.run(None, model, options, kind))


def assert_same_run(got: dict, expected: dict) -> None:
    for key in ("draws", "stats", "em_history", "trace", "targets", "mean"):
        torch.testing.assert_close(got[key], expected[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


SAMPLES = [name for name, (mode, *_) in worker.scenarios().items() if mode == "samples"]
DATA = [name for name, (mode, *_) in worker.scenarios().items() if mode == "data"]


# short solves, to keep the runs fast: convergence is not what is compared here
@pytest.mark.filterwarnings("ignore:the samples have not converged:UserWarning")
@pytest.mark.filterwarnings("ignore:the linearisation point is not a MAP:UserWarning")
@pytest.mark.parametrize("name", SAMPLES)
def test_sample_parallel_gathers_the_one_process_draws_on_rank_zero(launched, name):
    expected = one_process(name)
    main, other = load(launched, name, 0), load(launched, name, 1)
    num_samples = worker.scenarios()[name][2]["num_samples"]
    assert main["num_samples"] == num_samples and main["idata_posterior"] == (1, num_samples, 3)
    assert_same_run(main, expected)
    # rank 1 keeps its own block, the last rows: its noise is the noise one process draws for them
    block = slice(num_samples - other["num_samples"], num_samples)
    assert other["num_samples"] == num_samples // RANKS
    torch.testing.assert_close(other["targets"][:-1], expected["targets"][block], **TOLERANCE)
    torch.testing.assert_close(other["draws"]["w"], expected["draws"]["w"][block], **TOLERANCE)
    # the mean row (rank 0's, broadcast after each solve) and the EM history are the same on every rank
    assert torch.equal(other["mean"], main["mean"])
    for key, value in main["em_history"].items():
        assert torch.equal(other["em_history"][key], value)


def test_em_moved_the_prior_precision(launched):
    """The EM comparisons above compare something: the precision changed at every step, per site."""
    history = load(launched, "samples_em", 0)["em_history"]["prior_precision"]
    assert history.shape == (3, 1) and bool((history.diff(dim=0).abs() > 1e-3).all())


@pytest.mark.filterwarnings("ignore:the samples have not converged:UserWarning")
@pytest.mark.filterwarnings("ignore:the linearisation point is not a MAP:UserWarning")
@pytest.mark.parametrize("name", DATA)
def test_data_parallel_is_one_process(launched, name):
    expected = one_process(name)
    for rank in range(RANKS):
        assert_same_run(load(launched, name, rank), expected)
    # both ranks took the very same steps: the all-reduce hands every rank the same sum
    first, second = (load(launched, name, rank) for rank in range(RANKS))
    assert torch.equal(first["draws"]["w"], second["draws"]["w"])


def test_a_two_rank_group_refuses_what_it_cannot_split(launched):
    for rank in range(RANKS):
        messages = load(launched, "errors", rank)
        assert "num_samples >= 2" in messages["too_few_samples"]
        assert "no subsampled plate" in messages["no_plate"]


def test_distributed_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    engine = SampleThenOptimize(worker.regression, num_samples=2, distributed="samples", progress_bar=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        engine.run(*worker.data())


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(distributed="chains"), "distributed must be"),
        (dict(distributed="samples", checkpoint="run.pt"), "checkpoint does not work with distributed"),
    ],
)
def test_distributed_arguments_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        SampleThenOptimize(worker.regression, num_samples=2, **options)
