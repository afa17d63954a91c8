"""MultilevelMCMC at its defaults on hierarchical data nobody here wrote, against long NumPyro NUTS references. (slow)

The zoo's hierarchies and the many-group model are simulated here; these are the data a user brings, as they ship
inside installed packages (no network):

* ``eight-centred`` / ``eight-noncentred``: the eight schools (each school's estimated effect, from ArviZ's bundled
  ``centered_eight``, and its standard error), ``mu ~ N(0, 5)``, ``tau ~ HalfCauchy(5)``, a school effect per school,
  written centred (``theta ~ N(mu, tau)``) and non-centred (``theta = mu + tau * z``, ``z ~ N(0, 1)``): one row
  per group and a posterior with a funnel.
* ``grunfeld`` / ``grunfeld-vague``: statsmodels' Grunfeld panel (11 firms x 20 years, 220 rows), the log of a
  firm's investment on its standardised log market value (a varying intercept and slope per firm) and log capital
  (shared), with weakly informative priors and with vague ones (``Normal(0, 1000)`` means, ``HalfNormal(100)``
  scales).
* ``fair``: statsmodels' ``fair`` survey (6,366 women), whether a woman reported any affair, a logistic regression
  on six standardised answers with an intercept varying over the 36 pairs of her and her husband's occupation
  (2 to 904 women a pair): a mixed logit.

Each reference is NumPyro's NUTS on the same posterior, written non-centred (float64, 4 chains x 10,000 draws after
2,000 warm-up, ``target_accept_prob=0.95``), cached with its diagnostics in
``benchmarks/results/multilevel/external_reference.json`` (``reference``). A run (``run``) is ``MultilevelMCMC`` with
every default (4 chains, 1,000 warm-up sweeps, 1,000 draws), judged as the zoo is (:func:`tests.model_zoo.accuracy`:
every element's mean within 0.2 reference sd, its sd within 5% plus three Monte-Carlo standard errors, r_hat at most
1.01): PASS, WARNED (outside, and the run warned) or SILENT (outside, no warning). ``--engines sghmc`` runs
``StochasticMCMC(SGHMC(model))`` at the README's lengths for contrast.

Usage::

    python benchmarks/studies/bench_multilevel_external.py reference
    python benchmarks/studies/bench_multilevel_external.py run [--models ...] [--seeds 10] [--engines multilevel]
    python benchmarks/studies/bench_multilevel_external.py report

``run`` appends one JSON record per (model, engine, seed) to ``benchmarks/results/multilevel/external.jsonl`` and
skips records already there; ``report`` writes ``benchmarks/results/multilevel/external.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
import records  # noqa: E402

from tests.model_zoo import accuracy  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "multilevel"
REFERENCE = RESULTS / "external_reference.json"
CELLS = RESULTS / "external.jsonl"
REPORT = RESULTS / "external.md"
MODELS = ("eight-centred", "eight-noncentred", "grunfeld", "grunfeld-vague", "fair")
REF_WARMUP, REF_SAMPLES, REF_CHAINS = 2000, 10000, 4


# ------------------------------------------------------------------------------------------------ the data
EIGHT_SIGMA = (15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0)  # the estimates' standard errors (Rubin, 1981)


def eight_schools() -> tuple[torch.Tensor, torch.Tensor]:
    """Each school's estimated effect (ArviZ's bundled ``centered_eight``) and its standard error.

    ArviZ's example keeps the estimates (``observed_data.obs``) but not their standard errors (its ``constant_data``
    repeats the estimates), so those are the published eight numbers.
    """
    import arviz as az

    y = torch.tensor(az.load_arviz_data("centered_eight").observed_data["obs"].values, dtype=torch.float32)
    return y, torch.tensor(EIGHT_SIGMA)


def grunfeld() -> tuple[torch.Tensor, ...]:
    """Firm index, standardised log value and log capital, and log investment of statsmodels' Grunfeld panel."""
    import statsmodels.api as sm

    frame = sm.datasets.grunfeld.load_pandas().data
    firm = torch.tensor(frame["firm"].astype("category").cat.codes.values, dtype=torch.long)

    def standard(column):
        x = torch.tensor(frame[column].values, dtype=torch.float64).log()
        return ((x - x.mean()) / x.std()).float()

    log_invest = torch.tensor(frame["invest"].values, dtype=torch.float64).log().float()
    return firm, standard("value"), standard("capital"), log_invest


FAIR_COVARIATES = ("rate_marriage", "age", "yrs_married", "children", "religious", "educ")


def fair() -> tuple[torch.Tensor, ...]:
    """Occupation pair (36 levels), six standardised answers and whether any affair, of statsmodels' ``fair``."""
    import statsmodels.api as sm

    frame = sm.datasets.fair.load_pandas().data
    pair = (frame["occupation"].astype(int) - 1) * 6 + (frame["occupation_husb"].astype(int) - 1)
    x = torch.tensor(frame[list(FAIR_COVARIATES)].values, dtype=torch.float64)
    x = ((x - x.mean(0)) / x.std(0)).float()
    return torch.tensor(pair.values, dtype=torch.long), x, torch.tensor((frame["affairs"] > 0).values).float()


# ------------------------------------------------------------------------------------------------ the Pyro models
def pyro_model(name: str):
    """The model as a Pyro user writes it (a group plate, a subsampled data plate) and its data."""
    import pyro
    import pyro.distributions as dist

    if name.startswith("eight"):
        y, sigma = eight_schools()
        centred = name == "eight-centred"

        def eight(y, sigma):
            mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
            tau = pyro.sample("tau", dist.HalfCauchy(5.0))
            with pyro.plate("schools", len(y)):
                if centred:
                    theta = pyro.sample("theta", dist.Normal(mu, tau))
                else:
                    theta = mu + tau * pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("estimates", len(y), subsample_size=4) as idx:  # the engine reads rows by the data plate
                pyro.sample("y", dist.Normal(theta[idx], sigma[idx]), obs=y[idx])

        return eight, (y, sigma)
    if name.startswith("grunfeld"):
        vague = name.endswith("vague")
        loc, scale = (1000.0, 100.0) if vague else (5.0, 2.0)

        def panel(firm, value, capital, log_invest, num_firms=11):
            mu_a = pyro.sample("mu_a", dist.Normal(0.0, loc))
            mu_b = pyro.sample("mu_b", dist.Normal(0.0, loc))
            tau_a = pyro.sample("tau_a", dist.HalfNormal(scale))
            tau_b = pyro.sample("tau_b", dist.HalfNormal(scale))
            gamma = pyro.sample("gamma", dist.Normal(0.0, loc))
            sigma = pyro.sample("sigma", dist.HalfNormal(scale))
            with pyro.plate("firms", num_firms):
                a = pyro.sample("a", dist.Normal(mu_a, tau_a))
                b = pyro.sample("b", dist.Normal(mu_b, tau_b))
            with pyro.plate("years", len(log_invest), subsample_size=50) as idx:
                f = firm[idx]
                mean = a[f] + b[f] * value[idx] + gamma * capital[idx]
                pyro.sample("y", dist.Normal(mean, sigma), obs=log_invest[idx])

        return panel, grunfeld()
    if name == "fair":

        def mixed_logit(pair, x, any_affair, num_pairs=36):
            mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
            tau = pyro.sample("tau", dist.HalfNormal(2.5))
            beta = pyro.sample("beta", dist.Normal(0.0, 2.5).expand([x.shape[1]]).to_event(1))
            with pyro.plate("pairs", num_pairs):
                alpha = pyro.sample("alpha", dist.Normal(mu, tau))
            with pyro.plate("women", len(any_affair), subsample_size=256) as idx:
                logits = alpha[pair[idx]] + x[idx] @ beta
                pyro.sample("y", dist.Bernoulli(logits=logits), obs=any_affair[idx])

        return mixed_logit, fair()
    raise ValueError(f"unknown model {name!r}; the models are {', '.join(MODELS)}")


# ------------------------------------------------------------------------------------------------ the references
def numpyro_reference(family: str) -> dict[str, object]:
    """NumPyro NUTS on ``family``'s posterior, non-centred, in float64: draws of every site of every variant."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as nd
    from numpyro.infer import MCMC, NUTS

    numpyro.enable_x64()
    if family == "eight":
        y, sigma = (jnp.asarray(t.double().numpy()) for t in eight_schools())

        def model():
            mu = numpyro.sample("mu", nd.Normal(0.0, 5.0))
            tau = numpyro.sample("tau", nd.HalfCauchy(5.0))
            z = numpyro.sample("z", nd.Normal(0.0, 1.0).expand([len(y)]).to_event(1))
            numpyro.sample("y", nd.Normal(mu + tau * z, sigma).to_event(1), obs=y)

    elif family.startswith("grunfeld"):
        firm, value, capital, log_invest = (jnp.asarray(t.numpy()) for t in grunfeld())
        value, capital, log_invest = (v.astype(jnp.float64) for v in (value, capital, log_invest))
        loc, scale = (1000.0, 100.0) if family.endswith("vague") else (5.0, 2.0)

        def model():
            mu_a = numpyro.sample("mu_a", nd.Normal(0.0, loc))
            mu_b = numpyro.sample("mu_b", nd.Normal(0.0, loc))
            tau_a = numpyro.sample("tau_a", nd.HalfNormal(scale))
            tau_b = numpyro.sample("tau_b", nd.HalfNormal(scale))
            gamma = numpyro.sample("gamma", nd.Normal(0.0, loc))
            sigma = numpyro.sample("sigma", nd.HalfNormal(scale))
            za = numpyro.sample("za", nd.Normal(0.0, 1.0).expand([11]).to_event(1))
            zb = numpyro.sample("zb", nd.Normal(0.0, 1.0).expand([11]).to_event(1))
            a, b = mu_a + tau_a * za, mu_b + tau_b * zb
            numpyro.deterministic("a", a)
            numpyro.deterministic("b", b)
            mean = a[firm] + b[firm] * value + gamma * capital
            numpyro.sample("y", nd.Normal(mean, sigma).to_event(1), obs=log_invest)

    elif family == "fair":
        pair, x, any_affair = (jnp.asarray(t.numpy()) for t in fair())
        x, any_affair = x.astype(jnp.float64), any_affair.astype(jnp.float64)

        def model():
            mu = numpyro.sample("mu", nd.Normal(0.0, 5.0))
            tau = numpyro.sample("tau", nd.HalfNormal(2.5))
            beta = numpyro.sample("beta", nd.Normal(0.0, 2.5).expand([x.shape[1]]).to_event(1))
            z = numpyro.sample("z", nd.Normal(0.0, 1.0).expand([36]).to_event(1))
            alpha = numpyro.deterministic("alpha", mu + tau * z)
            numpyro.sample("y", nd.Bernoulli(logits=alpha[pair] + x @ beta).to_event(1), obs=any_affair)

    else:
        raise ValueError(family)
    mcmc = MCMC(
        NUTS(model, target_accept_prob=0.95),
        num_warmup=REF_WARMUP,
        num_samples=REF_SAMPLES,
        num_chains=REF_CHAINS,
        chain_method="sequential",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(0))
    draws = {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    divergences = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
    if family == "eight":
        draws["theta"] = draws["mu"][..., None] + draws["tau"][..., None] * draws["z"]
    return draws, divergences


VARIANT_SITES = {
    "eight-centred": ("mu", "tau", "theta"),
    "eight-noncentred": ("mu", "tau", "z"),
    "grunfeld": ("mu_a", "mu_b", "tau_a", "tau_b", "gamma", "sigma", "a", "b"),
    "grunfeld-vague": ("mu_a", "mu_b", "tau_a", "tau_b", "gamma", "sigma", "a", "b"),
    "fair": ("mu", "tau", "beta", "alpha"),
}
FAMILY = {
    "eight-centred": "eight",
    "eight-noncentred": "eight",
    "grunfeld": "grunfeld",
    "grunfeld-vague": "grunfeld-vague",
    "fair": "fair",
}


def summarise(draws, divergences: int, sites) -> dict:
    """A reference entry as :func:`tests.model_zoo.accuracy` reads it, with the least ESS and largest r_hat."""
    import arviz as az

    entry = {"sites": {}, "diagnostics": {}, "divergences": divergences}
    for site in sites:
        x = draws[site].reshape(draws[site].shape[0], draws[site].shape[1], -1)
        ess = [float(az.ess(x[..., k], method="bulk")) for k in range(x.shape[-1])]
        r_hat = [float(az.rhat(x[..., k])) for k in range(x.shape[-1])]
        flat = x.reshape(-1, x.shape[-1])
        centred = flat - flat.mean(0)
        kurtosis = (centred**4).mean(0) / (centred**2).mean(0) ** 2  # widens the sd's tolerance for heavy tails
        entry["sites"][site] = {
            "mean": flat.mean(0).tolist(),
            "sd": flat.std(0, ddof=1).tolist(),
            "kurtosis": kurtosis.tolist(),
        }
        entry["diagnostics"][site] = {"ess": min(ess), "r_hat": max(r_hat)}
    return entry


def make_reference() -> None:
    cached = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {"models": {}}
    for family in dict.fromkeys(FAMILY.values()):
        variants = [m for m in MODELS if FAMILY[m] == family]
        if all(_complete(cached["models"].get(m)) for m in variants):
            continue
        start = time.perf_counter()
        draws, divergences = numpyro_reference(family)
        seconds = time.perf_counter() - start
        for m in variants:
            cached["models"][m] = {**summarise(draws, divergences, VARIANT_SITES[m]), "seconds": seconds}
            harness.log(m, {s: d for s, d in cached["models"][m]["diagnostics"].items()}, f"{seconds:.0f} s")
        _write(cached)


def _complete(entry: dict | None) -> bool:
    """Whether a cached entry has every field the runs read (an older one lacks the kurtosis)."""
    return entry is not None and all("kurtosis" in site for site in entry["sites"].values())


def _write(cached: dict) -> None:
    cached["command"] = "python benchmarks/studies/bench_multilevel_external.py reference"
    cached["how"] = (
        f"NumPyro NUTS, non-centred, float64, {REF_CHAINS} chains x {REF_SAMPLES} draws after {REF_WARMUP} warm-up, "
        "target_accept_prob=0.95"
    )
    partial = REFERENCE.with_suffix(".partial")
    partial.write_text(json.dumps(cached, indent=1) + "\n")
    partial.replace(REFERENCE)  # whole, for a run reading it meanwhile


# ------------------------------------------------------------------------------------------------ the runs
def run_cell(name: str, engine: str, seed: int) -> dict:
    from pyro_scalable.infer import SGHMC, MultilevelMCMC, StochasticMCMC
    from pyro_scalable.infer.health import HealthWarning

    model, args = pyro_model(name)
    if engine == "multilevel":
        mcmc = MultilevelMCMC(model, seed=seed, progress_bar=False)
    elif engine == "sghmc":
        mcmc = StochasticMCMC(
            SGHMC(model), num_samples=1000, num_warmup=1000, num_chains=4, seed=seed, progress_bar=False
        )
    else:
        raise ValueError(f"unknown engine {engine!r}")
    load, start = harness.load_average(), time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(*args)
    seconds = time.perf_counter() - start
    entry = json.loads(REFERENCE.read_text())["models"][name]
    result = accuracy(mcmc.get_samples(group_by_chain=True), entry)
    warned = [str(w.message)[:200] for w in caught if issubclass(w.category, HealthWarning)]
    verdict = "PASS" if result["passed"] else ("WARNED" if warned else "SILENT")
    return {
        "model": name,
        "engine": engine,
        "seed": seed,
        "verdict": verdict,
        **result,
        "seconds": seconds,
        "warnings": warned,
        "load": [load, harness.load_average()],
        **records.stamp(torch.get_num_threads(), "cpu"),
    }


def run(models, engines, seeds) -> None:
    done = {(r["model"], r["engine"], r["seed"]) for r in _cells()}
    for name in models:
        for engine in engines:
            for seed in seeds:
                if (name, engine, seed) in done:
                    continue
                cell = run_cell(name, engine, seed)
                with CELLS.open("a") as f:
                    f.write(json.dumps(cell) + "\n")
                harness.log(
                    name,
                    engine,
                    seed,
                    cell["verdict"],
                    f"mean {cell['mean_error']:.3f}",
                    f"sd {cell['sd_error']:.3f}",
                    f"r_hat {cell['r_hat']:.4f}",
                    f"{cell['seconds']:.0f} s",
                )


def _cells() -> list[dict]:
    return [json.loads(line) for line in CELLS.read_text().splitlines()] if CELLS.exists() else []


def report() -> None:
    cells = {(c["model"], c["engine"], c["seed"]): c for c in _cells()}  # the latest of each
    reference = json.loads(REFERENCE.read_text())
    lines = [
        "# MultilevelMCMC at its defaults on hierarchical data shipped in installed packages",
        "",
        f"`python benchmarks/studies/bench_multilevel_external.py run --seeds {1 + max(k[2] for k in cells)} && python "
        "benchmarks/studies/bench_multilevel_external.py report` (seeds 0, 1, ... of each model, as many as its "
        "row's `seeds`; `--models` and `--first-seed` run some; one CPU thread a run; models and criteria in the "
        "script's docstring: every element's mean within 0.2 reference sd, sd within 5% + 3 MCSE, r_hat <= 1.01; "
        f"reference: {reference['how']}).",
        "",
        "| model | engine | seeds | PASS | WARNED | SILENT | worst mean error (sd) | worst sd error | worst r_hat "
        "| least ESS | median s/run | code |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in MODELS:
        for engine in ("multilevel", "sghmc"):
            group = [c for (m, e, _), c in sorted(cells.items()) if m == name and e == engine]
            if not group:
                continue
            count = {v: sum(c["verdict"] == v for c in group) for v in ("PASS", "WARNED", "SILENT")}
            seconds = sorted(c["seconds"] for c in group)[len(group) // 2]
            lines.append(
                f"| {name} | {engine} | {len(group)} | {count['PASS']} | {count['WARNED']} | {count['SILENT']} "
                f"| {max(c['mean_error'] for c in group):.3f} | {max(c['sd_error'] for c in group):.3f} "
                f"| {max(c['r_hat'] for c in group):.4f} | {min(c['ess'] for c in group):.0f} | {seconds:.0f} "
                f"| {', '.join(sorted({c['commit'] for c in group}))} |"
            )
    lines += [
        "",
        "Reference runs:",
        "",
        "| model | least ESS | largest r_hat | divergences | seconds |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in MODELS:
        entry = reference["models"].get(name)
        if entry:
            d = entry["diagnostics"].values()
            lines.append(
                f"| {name} | {min(x['ess'] for x in d):.0f} | {max(x['r_hat'] for x in d):.4f} "
                f"| {entry['divergences']} | {entry['seconds']:.0f} |"
            )
    failing = [c for c in cells.values() if c["verdict"] != "PASS"]
    if failing:
        lines += [
            "",
            "Runs that did not pass:",
            "",
            "| model | engine | seed | verdict | mean error | sd error | r_hat | ESS | warning |",
            "|---|---|---:|---|---:|---:|---:|---:|---|",
        ]
        for c in sorted(failing, key=lambda c: (c["model"], c["engine"], c["seed"])):
            warning = (c["warnings"][0][:120] if c["warnings"] else "").replace("|", "/").replace("\n", " ")
            lines.append(
                f"| {c['model']} | {c['engine']} | {c['seed']} | {c['verdict']} | {c['mean_error']:.3f} "
                f"| {c['sd_error']:.3f} | {c['r_hat']:.4f} | {c['ess']:.0f} | {warning} |"
            )
    REPORT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("reference", "run", "report"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--engines", default="multilevel")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    options = parser.parse_args()
    torch.set_num_threads(1)
    if options.command == "reference":
        make_reference()
    elif options.command == "run":
        seeds = range(options.first_seed, options.first_seed + options.seeds)
        run(options.models.split(","), options.engines.split(","), seeds)
    else:
        report()


if __name__ == "__main__":
    main()
