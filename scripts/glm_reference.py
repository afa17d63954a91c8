"""Write the GLMs' reference posteriors: ``python scripts/glm_reference.py`` (1-2 hours on 2 busy cores).

For the GLMs of ``tests/glm_models.py`` but the linear-Gaussian one (whose posterior is a closed form), under the
variants asked for (plain, ``poutine.scale(2.0)``, per-row weights, ``poutine.mask``), the summary statistics of its
posterior, per element of each latent site: mean, sd, the 5%, 50% and 95% quantiles. Pyro's NUTS on the full data (no
subsampling), float64, ``--chains`` chains of ``--warmup`` + ``--samples`` steps, with their split r_hat and ESS
written beside them so that the reference's own Monte-Carlo error is known. Writes ``tests/glm_reference.json``; the
file holds every variant of the logistic and Poisson regressions and the categorical one's plain posterior (``--models
logistic poisson``, then ``--models categorical --variants plain``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.zoo_reference import summarise  # noqa: E402
from tests.glm_models import GLMS, VARIANTS, glm  # noqa: E402


def nuts(name: str, variant: str, chains: int, warmup: int, samples: int) -> tuple[dict, dict]:
    """Pyro NUTS on the full data: per-site summaries, and per-site worst r_hat / least ESS."""
    import pyro
    from pyro.infer import MCMC, NUTS

    from pyro_scalable.bridge.plates import FullDataModel

    model, args = glm(name, variant)
    runs = []
    for chain in range(chains):
        pyro.clear_param_store()
        pyro.set_rng_seed(chain)
        mcmc = MCMC(NUTS(FullDataModel(model)), num_samples=samples, warmup_steps=warmup, disable_progbar=True)
        mcmc.run(*args)
        runs.append(mcmc.get_samples())
    grouped = {site: torch.stack([run[site] for run in runs]) for site in runs[0]}
    diagnostics = {}
    for site, value in grouped.items():
        flat = value.reshape(chains, samples, -1)
        r_hat = pyro.ops.stats.split_gelman_rubin(flat, chain_dim=0, sample_dim=1)
        ess = pyro.ops.stats.effective_sample_size(flat, chain_dim=0, sample_dim=1)
        diagnostics[site] = {"r_hat": float(r_hat.max()), "ess": float(ess.min())}
    pooled = {site: value.reshape(chains * samples, *value.shape[2:]) for site, value in grouped.items()}
    return {site: summarise(value) for site, value in pooled.items()}, diagnostics


def main() -> None:
    """Write the references of the models and variants named (default: all)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "glm_reference.json"))
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--models", nargs="*", default=[m for m in GLMS if m != "linear-gaussian"])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    options = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(options.out)
    reference = json.loads(out.read_text()) if out.exists() else {}
    reference["command"] = "python scripts/glm_reference.py"
    reference.setdefault("models", {})
    for name in options.models:
        for variant in options.variants:
            start = time.perf_counter()
            sites, diagnostics = nuts(name, variant, options.chains, options.warmup, options.samples)
            reference["models"][f"{name}/{variant}"] = {
                "method": f"Pyro NUTS, full data, float64, {options.chains} chains x "
                f"({options.warmup} warm-up + {options.samples} draws)",
                "diagnostics": diagnostics,
                "sites": sites,
            }
            out.write_text(json.dumps(reference, indent=1) + "\n")
            print(f"{name}/{variant}: {time.perf_counter() - start:.0f} s {diagnostics}", flush=True)


if __name__ == "__main__":
    main()
