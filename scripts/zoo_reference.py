"""Write the zoo's reference posteriors: ``python scripts/zoo_reference.py`` (about 15 minutes on 2 cores).

For every model of ``tests/model_zoo.py`` with an identifiable posterior, the summary statistics of its posterior on
the zoo's data (float64), per element of each latent site in constrained space: mean, sd, the 5%, 50% and 95%
quantiles. Closed form where the model is conjugate (``nested-plates``: a Normal mean with known noise); otherwise
Pyro's NUTS on the full data (no subsampling), ``--chains`` chains of ``--warmup`` + ``--samples`` steps, with
their split r_hat and ESS written beside them so that the reference's own Monte-Carlo error is known. The two
varying-intercept models (304 coordinates) take NumPyro's NUTS instead (``--many-groups-samples`` draws per chain,
4 chains, the model written non-centred, the centred model's intercepts as ``mu + tau * raw``; one run serves both,
the same posterior): at Pyro's speed a reference precise enough for 304 sds (2 x 1,500 draws left some 7% off)
would take hours. Their ESS is the least over elements of the draws' and their squares' (what an sd's error rests
on), and each element's kurtosis is written beside its sd.
The ``PyroModule`` network is left out: its posterior is symmetric under permuting and flipping hidden units, so
per-weight means and sds are not a property of the posterior a sampler can be checked against.

Writes ``tests/zoo_reference.json`` (or ``--out``), which ``tests/test_zoo_accuracy.py`` and
``python -m benchmarks zoo-seeds`` read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import MCMC, NUTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyro_scalable.bridge.plates import FullDataModel  # noqa: E402
from tests.model_zoo import ZOO, data, zoo_model  # noqa: E402

SKIPPED = {
    "pyromodule-net": "symmetric posterior (hidden units permute and flip): per-weight moments are not identified"
}
QUANTILES = (0.05, 0.5, 0.95)


def summarise(draws: torch.Tensor) -> dict[str, list[float]]:
    """Per-element mean, sd and quantiles of ``draws`` (draw dimension first), flattened."""
    flat = draws.reshape(draws.shape[0], -1).double()
    quantiles = torch.quantile(flat, torch.tensor(QUANTILES, dtype=flat.dtype), dim=0)
    summary = {"shape": list(draws.shape[1:]), "mean": flat.mean(0).tolist(), "sd": flat.std(0).tolist()}
    for q, row in zip(QUANTILES, quantiles, strict=True):
        summary[f"q{int(round(q * 100)):02d}"] = row.tolist()
    return summary


def nested_plates_closed_form(num_draws: int = 200_000) -> dict[str, dict]:
    """``mu[f] ~ N(0, 1)``, ``x[i, f] ~ N(mu[f], 1)``: posterior N(Σx / (1 + N), 1 / (1 + N)) per feature."""
    x, _, _ = data(torch.float64)
    precision = 1.0 + x.shape[0]
    mean, sd = x.sum(0) / precision, precision**-0.5
    draws = mean + sd * torch.randn(num_draws, *mean.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    summary = summarise(draws[..., None])  # the site's shape is (D, 1)
    summary["mean"], summary["sd"] = mean.tolist(), [sd] * len(mean)  # exact; the quantiles by Monte Carlo
    return {"mu": summary}


def nuts_reference(name: str, chains: int, warmup: int, samples: int) -> tuple[dict[str, dict], dict]:
    """Pyro NUTS on the full data: per-site summaries, and per-site worst r_hat / least ESS."""
    model, args = zoo_model(name, torch.float64)
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
        constant = flat.std((0, 1)) < 1e-12  # e.g. a correlation matrix's diagonal
        r_hat = pyro.ops.stats.split_gelman_rubin(flat[..., ~constant], chain_dim=0, sample_dim=1)
        ess = pyro.ops.stats.effective_sample_size(flat[..., ~constant], chain_dim=0, sample_dim=1)
        diagnostics[site] = {"r_hat": float(r_hat.max()), "ess": float(ess.min())}
    pooled = {site: value.reshape(chains * samples, *value.shape[2:]) for site, value in grouped.items()}
    return {site: summarise(value) for site, value in pooled.items()}, diagnostics


MANY_GROUPS_MODELS = ("varying-intercept-centred", "varying-intercept-non-centred")


def numpyro_many_groups(warmup: int, samples: int, chains: int = 4) -> dict[str, tuple[dict, dict]]:
    """Both varying-intercept models' summaries and diagnostics from one NumPyro NUTS run of the non-centred one."""
    import arviz as az
    import jax
    import numpy as np
    import numpyro
    import numpyro.distributions as nd
    from numpyro.infer import MCMC as NumPyroMCMC
    from numpyro.infer import NUTS as NumPyroNUTS

    jax.config.update("jax_enable_x64", True)
    x, y, group = (jax.numpy.asarray(t.numpy()) for t in zoo_model(MANY_GROUPS_MODELS[1], torch.float64)[1])
    num_groups = int(group.max()) + 1

    def model():  # tests/model_zoo.py's varying_intercept_non_centred, on the full data
        mu = numpyro.sample("mu", nd.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", nd.HalfNormal(1.0))
        with numpyro.plate("groups", num_groups):
            raw = numpyro.sample("raw", nd.Normal(0.0, 1.0))
        beta = numpyro.sample("beta", nd.Normal(0.0, 1.0))
        sigma = numpyro.sample("sigma", nd.HalfNormal(1.0))
        numpyro.sample("obs", nd.Normal(mu + tau * raw[group] + beta * x, sigma), obs=y)

    mcmc = NumPyroMCMC(
        NumPyroNUTS(model, target_accept_prob=0.95),
        num_warmup=warmup,
        num_samples=samples,
        num_chains=chains,
        chain_method="sequential",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(0))
    draws = {k: torch.tensor(np.array(v)) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    draws["intercept"] = draws["mu"][..., None] + draws["tau"][..., None] * draws["raw"]
    out = {}
    for name, local in zip(MANY_GROUPS_MODELS, ("intercept", "raw"), strict=True):
        sites, diagnostics = {}, {}
        for site in ("mu", "tau", local, "beta", "sigma"):
            value = draws[site].reshape(chains, samples, -1)
            array = value.numpy()
            squares = (array - array.mean((0, 1))) ** 2
            ess = min(float(az.ess(array[..., k]).min()) for k in range(array.shape[-1]))
            ess = min(ess, min(float(az.ess(squares[..., k])) for k in range(array.shape[-1])))
            r_hat = max(float(az.rhat(array[..., k])) for k in range(array.shape[-1]))
            pooled = draws[site].reshape(chains * samples, *draws[site].shape[2:])
            sites[site] = summarise(pooled)
            centred = value.reshape(chains * samples, -1) - value.reshape(chains * samples, -1).mean(0)
            sites[site]["kurtosis"] = (centred.pow(4).mean(0) / centred.pow(2).mean(0).square()).tolist()
            diagnostics[site] = {"r_hat": r_hat, "ess": ess}
        out[name] = (sites, diagnostics)
    return out


def main() -> None:
    """Write the references of the models named (default: all but the skipped ones)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "zoo_reference.json"))
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=1500)
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--many-groups-samples", type=int, default=10_000)
    options = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(options.out)
    reference = json.loads(out.read_text()) if out.exists() else {}
    reference["command"] = "python scripts/zoo_reference.py"
    reference.setdefault("models", {})
    reference["skipped"] = SKIPPED
    many_groups = None
    for name in options.models:
        if name in SKIPPED:
            continue
        start = time.perf_counter()
        if name in MANY_GROUPS_MODELS:
            many_groups = many_groups or numpyro_many_groups(1000, options.many_groups_samples)
            sites, diagnostics = many_groups[name]
            how = {
                "method": f"NumPyro NUTS, full data, non-centred, float64, 4 chains x (1000 warm-up + "
                f"{options.many_groups_samples} draws), target_accept_prob=0.95",
                "diagnostics": diagnostics,
            }
        elif name == "nested-plates":
            sites, how = nested_plates_closed_form(), {"method": "closed form (conjugate Normal mean)"}
        else:
            sites, diagnostics = nuts_reference(name, options.chains, options.warmup, options.samples)
            how = {
                "method": f"Pyro NUTS, full data, float64, {options.chains} chains x "
                f"({options.warmup} warm-up + {options.samples} draws)",
                "diagnostics": diagnostics,
            }
        reference["models"][name] = {**how, "sites": sites}
        out.write_text(json.dumps(reference, indent=1) + "\n")
        print(f"{name}: {time.perf_counter() - start:.0f} s {how.get('diagnostics', '')}", flush=True)


if __name__ == "__main__":
    main()
