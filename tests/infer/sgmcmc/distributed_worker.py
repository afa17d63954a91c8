"""The runs tests/infer/sgmcmc/test_distributed.py compares: launched by torchrun on 2 gloo ranks, or in one process.

``python -m torch.distributed.run --standalone --nproc_per_node=2 tests/infer/sgmcmc/distributed_worker.py OUT``
writes ``OUT/<scenario>.rank<r>.pt`` (draws and sample_stats, unconstrained) for every scenario on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC

NUM_DATA, MINIBATCH = 60, 12  # 6 examples per rank: the rank-local noise estimate needs at least 2


def model(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
    scale = pyro.sample("scale", dist.LogNormal(torch.zeros((), dtype=x.dtype), 1.0))
    with pyro.plate("data", len(y), subsample_size=MINIBATCH) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, scale), obs=y[idx])


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 2, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5], dtype=torch.float64) + 0.3 * torch.randn(
        NUM_DATA, generator=generator, dtype=torch.float64
    )
    return x, y


def scenarios() -> dict[str, tuple[object, dict]]:
    """Name -> (kernel, StochasticMCMC options other than ``distributed``)."""
    common = dict(seed=3, progress_bar=False)
    return {
        # warm-up chooses the step size (8 power iterations at the first step) and corrects the gradient noise
        "sgld_warmup": (SGLD(model), dict(num_samples=6, num_warmup=6, num_chains=2, **common)),
        "sghmc_fisher": (
            SGHMC(model, step_size=0.02, friction=5.0, mass="fisher", gradient_noise="correct"),
            dict(num_samples=6, num_warmup=4, num_chains=2, **common),
        ),
        # no noise correction, so epoch minibatches: warm-up's noise estimate (for the Fisher mass) then has the
        # finite-population correction (1 - B/N)
        "sghmc_fisher_epoch": (
            SGHMC(model, step_size=0.01, friction=5.0, mass="fisher"),
            dict(num_samples=6, num_warmup=4, num_chains=2, **common),
        ),
        # the control variate's mode search (its full-data passes split over the ranks and all-reduced) and the
        # controlled minibatch estimate on each rank's share, with warm-up choosing the step
        "sghmc_control_variate": (
            SGHMC(model, control_variate="map"),
            dict(num_samples=6, num_warmup=6, num_chains=2, **common),
        ),
        # the control variate recentred at each of warm-up's metric windows (full-data passes all-reduced)
        "sghmc_warmup_centre": (
            SGHMC(model, control_variate="warmup"),
            dict(num_samples=6, num_warmup=20, num_chains=2, metric="dense", **common),
        ),
        "sgld_sequential": (
            SGLD(model, step_size=1e-3),
            dict(num_samples=6, num_warmup=0, num_chains=2, chain_method="sequential", **common),
        ),
    }


CHAINS = dict(num_samples=5, num_warmup=0, num_chains=3, seed=3, progress_bar=False)


def chain_kernel() -> SGHMC:
    return SGHMC(model, step_size=0.01, friction=5.0)


def result(mcmc: StochasticMCMC) -> dict:
    return {"draws": mcmc.get_unconstrained_samples(group_by_chain=True), "stats": mcmc.sample_stats}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    x, y = data()
    for name, (kernel, options) in scenarios().items():
        mcmc = StochasticMCMC(kernel, distributed="data", **options)
        mcmc.run(x, y)
        torch.save(result(mcmc), out / f"{name}.rank{rank}.pt")
    mcmc = StochasticMCMC(chain_kernel(), distributed="chains", **CHAINS)
    mcmc.run(x, y)
    saved = result(mcmc)
    if rank == 0:
        idata = mcmc.to_inference_data()
        saved["idata_chains"] = int(idata.posterior.sizes["chain"])
        saved["idata_log_likelihood"] = tuple(idata.log_likelihood["obs"].shape)
    torch.save(saved, out / f"chains.rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
