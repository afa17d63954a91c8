"""Data- and chain-parallel SG-MCMC on 2 gloo ranks (torchrun) against one process with the same total minibatch.

The runs are in ``distributed_worker.py``, launched once for the module. Data-parallel ranks differ from one
process only in the order of floating-point sums (each rank sums its share; the all-reduce adds the shares), a
relative 1e-16 per operation, carried through a dozen steps that neither expand nor contract much (ε λ ≤ 0.1):
``rtol=1e-10`` leaves six orders of magnitude of room and would still catch a wrong scale (a factor 2) or a
wrongly pooled noise variance (which moves the noise correction by O(1)).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pyro_scalable.infer import SGLD, StochasticMCMC

from . import distributed_worker as worker

WORKER = Path(__file__).with_name("distributed_worker.py")
RANKS = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is unavailable",
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distributed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    done = subprocess.run([*command, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return out


def load(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / f"{name}.rank{rank}.pt")


# short runs with big steps, to keep them fast: the too-much-gradient-noise warning is not what is tested here
@pytest.mark.filterwarnings("ignore:in .* the minibatch gradient alone brought more noise:UserWarning")
@pytest.mark.parametrize("name", list(worker.scenarios()))
def test_data_parallel_is_one_process_on_the_whole_minibatch(launched, name):
    kernel, options = worker.scenarios()[name]
    mcmc = StochasticMCMC(kernel, **options)
    mcmc.run(*worker.data())
    expected = worker.result(mcmc)
    for rank in range(RANKS):
        got = load(launched, name, rank)
        torch.testing.assert_close(got["draws"], expected["draws"], rtol=1e-10, atol=1e-12)
        assert set(got["stats"]) == set(expected["stats"])
        torch.testing.assert_close(got["stats"], expected["stats"], rtol=1e-10, atol=1e-12, equal_nan=True)
    # both ranks took the very same steps: the all-reduce hands every rank the same sum
    first, second = (load(launched, name, rank)["draws"] for rank in range(RANKS))
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_chain_parallel_gathers_every_chain_on_rank_zero(launched):
    main, other = load(launched, "chains", 0), load(launched, "chains", 1)
    chains = worker.CHAINS["num_chains"]
    assert main["draws"]["w"].shape == (chains, worker.CHAINS["num_samples"], 2)
    assert other["draws"]["w"].shape == (1, worker.CHAINS["num_samples"], 2)  # 3 chains: 2 on rank 0, 1 on rank 1
    assert main["stats"]["lp"].shape == (chains, worker.CHAINS["num_samples"])
    assert main["idata_chains"] == chains
    assert main["idata_log_likelihood"] == (chains, worker.CHAINS["num_samples"], worker.NUM_DATA)
    torch.testing.assert_close(main["draws"]["w"][2:], other["draws"]["w"], rtol=0, atol=0)
    # num_warmup=0: draw 0 is the initial point, the same as chain c's in a one-process run
    mcmc = StochasticMCMC(worker.chain_kernel(), **worker.CHAINS)
    mcmc.run(*worker.data())
    start = mcmc.get_unconstrained_samples(group_by_chain=True)
    torch.testing.assert_close(main["draws"]["w"][:, 0], start["w"][:, 0], rtol=0, atol=0)
    # after the start, each rank's chains move with their own generator
    assert not torch.equal(main["draws"]["w"][:, 1:], start["w"][:, 1:])


def test_distributed_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    mcmc = StochasticMCMC(SGLD(worker.model, step_size=1e-3), num_samples=2, distributed="data", progress_bar=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        mcmc.run(*worker.data())


def test_distributed_mode_is_checked():
    with pytest.raises(ValueError, match="distributed must be"):
        StochasticMCMC(SGLD(worker.model, step_size=1e-3), num_samples=2, distributed="model")
