"""The default kernels' draws against the zoo's reference posteriors (``tests/zoo_reference.json``).

Nothing but the model (``SGHMC(model)``, ...), 4 chains, 1,000 warm-up steps and 1,000 draws, as the README runs it.
Accurate: every element's mean within 0.2 reference sd and its sd within 5% plus three Monte-Carlo standard errors
(``tests.model_zoo.accuracy``); r_hat ≤ 1.01 (rank-normalised) is asked for apart, and is not met yet at these
lengths (the strict xfail below says by how much). The fast tier runs two seeds of
the conjugate model, whose reference is exact; the slow tier every model with a reference, every default kernel.
``benchmarks/bench_zoo_seeds.py`` runs ten seeds and writes the pass rates into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import pytest

from pyro_scalable.infer import PSGLD, SGHMC, SGLD, StochasticMCMC
from tests.model_zoo import accuracy, reference, zoo_model

KERNELS = {"SGHMC": SGHMC, "SGLD": SGLD, "PSGLD": PSGLD}


def _accuracy(model_name: str, kernel: str, seed: int) -> dict:
    model, args = zoo_model(model_name)
    mcmc = StochasticMCMC(KERNELS[kernel](model), num_samples=1000, num_warmup=1000, num_chains=4, seed=seed,
                          progress_bar=False)
    mcmc.run(*args)
    return accuracy(mcmc.get_samples(group_by_chain=True), reference()["models"][model_name])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("seed", [0, 1])
def test_sghmc_at_its_defaults_matches_the_exact_posterior_of_the_conjugate_model(seed):
    result = _accuracy("nested-plates", "SGHMC", seed)
    assert result["mean_error"] <= 0.2 and result["sd_excess"] <= 0.0, result


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("model_name", sorted(reference()["models"]))
def test_default_kernels_are_accurate_on_every_zoo_model(model_name, kernel, seed):
    result = _accuracy(model_name, kernel, seed)
    assert result["mean_error"] <= 0.2 and result["sd_excess"] <= 0.0, result


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured at 1,000 draws per chain: r_hat 1.02-1.05 (bulk ESS 117-176 of 4,000) on the zoo's N = 120, "
    "B = 12 models; the means and sds pass. The HealthWarning fires and names the num_samples the run's ESS asks for.",
)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model_name", ["linear-halfnormal-scale", "nested-plates"])
def test_sghmc_reaches_r_hat_1_01_at_the_default_lengths(model_name):
    assert _accuracy(model_name, "SGHMC", 0)["r_hat"] <= 1.01
