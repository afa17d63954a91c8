"""The suites: named cells of the grid problems × sizes × engines, and the columns of the table each renders.

A suite has a ``smoke`` size (a minute or two on 2 CPU cores: what ``python -m benchmarks run <suite>`` does) and a
``full`` size (``--size full``: the sizes the page's claims are about, tens of minutes on a CPU). Records of either
go to ``benchmarks/results/<suite>/cells.jsonl``; the page shows the latest record of each cell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.engines import COLD_ENGINES, LAPLACE_CALLS
from benchmarks.problems import PROBLEMS

__all__ = ["SUITES", "Column", "Suite"]

MCMC_ENGINES = ("ours-sghmc", "numpyro-nuts", "blackjax-nuts", "numpyro-hmcecs", "pyro-nuts")
GLMS = tuple((name, 2000) for name, problem in PROBLEMS.items() if problem.kind == "glm")
LAPLACE_ENGINES = ("map", "ours-laplace-kron", "laplace-torch-kron", "ours-laplace-diag", "laplace-torch-diag")


@dataclass(frozen=True)
class Column:
    title: str
    show: Callable[[dict], str]
    collapsible: bool = False  # left out of a table in which every row shows the same (a filter already says it)


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    sizes: dict[str, tuple[tuple[str | None, int], ...]]  # size name -> (problem, n) pairs
    engines: tuple[str, ...]
    columns: tuple[Column, ...]
    budget: float = 120.0  # seconds for ours' doubling runs, per cell

    def cells(self, size: str) -> list[tuple[str | None, int, str]]:
        return [(problem, n, engine) for problem, n in self.sizes[size] for engine in self.engines]


def _m(key: str, spec: str = "", scale: float = 1.0, suffix: str = "") -> Callable[[dict], str]:
    """A metric of the record; a list (e.g. one value per temperature) as its values joined by " / "."""

    def show(record: dict) -> str:
        value = record.get("metrics", {}).get(key)
        if value is None or (isinstance(value, list) and all(v is None for v in value)):
            return "–"
        if isinstance(value, list):
            return "\u00a0/ ".join("–" if v is None else f"{v * scale:{spec}}{suffix}" for v in value)
        if isinstance(value, bool):
            return "yes" if value else "**no**"
        if isinstance(value, str):
            return value.replace(" × ", "\u00a0×\u00a0")  # "1000 × 4" stays on one line
        return f"{value * scale:{spec}}{suffix}"

    return show


def _seconds(spec: str) -> Callable[[dict], str]:
    def show(record: dict) -> str:
        if record["status"] != "ok":
            return f"{record['status']}: {record.get('reason', '')}"
        # † transcribed from an older file
        mark = "\u00a0†" if record.get("provenance", "measured") != "measured" else ""
        return _m("seconds", spec)(record) + mark

    return show


def _n(record: dict) -> str:
    n = record["n"]
    if not n:
        return "–"
    exponent = len(str(n)) - 1
    return f"10{str(exponent).translate(str.maketrans('0123456789', '⁰¹²³⁴⁵⁶⁷⁸⁹'))}" if n == 10**exponent else f"{n:,}"


def _where(record: dict) -> str:
    machine = record.get("machine", {})
    return f"{machine.get('device', 'cpu')}, {machine.get('threads', '?')}\u00a0thr."


def _load(record: dict) -> str:
    load = record.get("load", {})
    start, end = load.get("start"), load.get("end")
    return "–" if start is None else f"{start[0]:.1f}\u00a0→\u00a0{end[0]:.1f}" if end else f"{start[0]:.1f}"


def _source(record: dict) -> str:
    return "transcribed" if record.get("provenance", "measured") != "measured" else record.get("date", "")[:10]


def _table(*columns: Column, measured: bool = True) -> tuple[Column, ...]:
    """``columns``, then the load during the cell and (``measured``) the date it was measured or "transcribed"."""
    return (*columns, Column("load", _load), *((Column("measured", _source),) if measured else ()))


ENGINE, WHERE = Column("engine", lambda r: r["engine"]), Column("where", _where, collapsible=True)


MCMC_COLUMNS = _table(
    Column("problem", lambda r: r["problem"], collapsible=True),
    Column("N", _n, collapsible=True),
    ENGINE,
    WHERE,
    Column("seconds", _seconds(",.1f")),
    Column("draws", _m("draws")),
    Column("accurate", _m("accurate")),
    Column("mean err. (sd)", _m("mean_error_sd", ".2f")),
    Column("sd err.", _m("sd_error", ".0%")),
    Column("ESS/s", _m("ess_per_s", ",.1f")),
    Column("r_hat", _m("r_hat_max", ".3f")),
    measured=False,
)

LAPLACE_COLUMNS = _table(
    ENGINE,
    WHERE,
    Column("seconds (fit + tune + predict)", _seconds(",.2f")),
    Column("extra memory (MB)", lambda r: "–" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}"),
    Column("prior precision", _m("prior_precision", ".3g")),
    Column("test NLL", _m("nll", ".3f")),
    Column("ECE", _m("ece", ".3f")),
    Column("accuracy", _m("test_accuracy", ".1%")),
)

DIGITS_COLUMNS = _table(
    ENGINE,
    WHERE,
    Column("seconds (the call, predictive included)", _seconds(",.2f")),
    Column("draws", _m("draws")),
    Column("test NLL", _m("nll", ".3f")),
    Column("ECE", _m("ece", ".3f")),
    Column("accuracy", _m("test_accuracy", ".1%")),
)

HIERARCHY_COLUMNS = _table(
    Column("problem", lambda r: r["problem"]),
    Column("N", _n),
    ENGINE,
    WHERE,
    Column("seconds", _seconds(",.1f")),
    Column("steps × chains", _m("draws")),
    Column("least ESS", _m("ess_min", ",.0f")),
    Column("ESS/s", _m("ess_per_s", ",.1f")),
    Column("r_hat", _m("r_hat_max", ".3f")),
    measured=False,
)


def _ratios(record: dict) -> str:
    found = record.get("metrics", {})
    if "sd_ratios" not in found:
        return "–"
    shown = "/".join(f"{r:.2f}" for r in found["sd_ratios"]) + f" ±{found['mcse']:.2f}"
    return f"**{shown}**" if found["sd_error"] > 0.1 else shown


LAPLACE_COST_COLUMNS = _table(
    Column("N", _n, collapsible=True),
    ENGINE,
    WHERE,
    Column("seconds", _seconds(",.2f")),
    Column("extra memory (MB)", _m("call_mb", ",.0f")),
    Column("log evidence", _m("log_evidence", ",.1f")),
)

CALIBRATION_COLUMNS = _table(
    Column("N", _n, collapsible=True),
    ENGINE,
    WHERE,
    Column("sd / exact sd (w₁/w₂ ± MCSE)", _ratios),
    Column("mean err. (sd)", _m("mean_error_sd", ".2f")),
    Column("step size", _m("step_size", ".3g")),
    Column("draws × chains", _m("draws")),
    Column("seconds", _seconds(",.1f")),
    measured=False,
)

DISTRIBUTED_COLUMNS = _table(
    Column("N", _n, collapsible=True),
    ENGINE,
    WHERE,
    Column("ms per step, 1 rank", _m("step_ms_1_rank", ",.1f")),
    Column("2 ranks", _m("step_ms_2_ranks", ",.1f")),
    Column("speed-up", _m("speedup", ".2f", suffix="×")),
    Column("efficiency", _m("efficiency", ".2f")),
    Column("steps", _m("steps")),
)

STEP_COLUMNS = _table(
    Column("problem", lambda r: r["problem"]),
    Column("N", _n),
    ENGINE,
    Column("where", _where),
    Column("ours (ms)", _m("ours_ms", ".3f")),
    Column("hand-written (ms)", _m("hand_ms", ".3f")),
    Column("posteriors (ms)", _m("posteriors_ms", ".3f")),
    Column("ours / hand-written", _m("vs_hand", ".2f", suffix="×")),
    Column("ours / posteriors", _m("vs_posteriors", ".2f", suffix="×")),
    Column("16 vectorised (chain-steps/s)", _m("vectorised_per_s", ",.0f")),
    Column("16 sequential", _m("sequential_per_s", ",.0f")),
    Column("hand-written batched", _m("batched_per_s", ",.0f")),
    Column("vectorised / sequential", _m("vs_sequential", ".2f", suffix="×")),
    Column("vectorised / batched", _m("vs_batched", ".2f", suffix="×")),
)

BLACKJAX_COLUMNS = _table(
    Column("problem", lambda r: r["problem"]),
    Column("N", _n, collapsible=True),
    Column("where", _where),
    Column("ours, plain (ms)", _m("ours_eager_ms", ".3f")),
    Column("ours, noise-corrected", _m("ours_corrected_ms", ".3f")),
    Column("ours, compiled", _m("ours_compiled_ms", ".3f")),
    Column("hand-written", _m("hand_ms", ".3f")),
    Column("hand-written, compiled", _m("hand_compiled_ms", ".3f")),
    Column("… CUDA graphs", _m("hand_graphs_ms", ".3f")),
    Column("BlackJAX SGLD", _m("blackjax_ms", ".3f")),
    Column("plain / BlackJAX", _m("eager_vs_blackjax", ".1f", suffix="×")),
    Column("compiled / BlackJAX", _m("compiled_vs_blackjax", ".1f", suffix="×")),
    Column("compile (s)", _m("compile_s", ".1f")),
)


COLD_COLUMNS = _table(
    Column("N", _n, collapsible=True),
    ENGINE,
    WHERE,
    Column("seconds", _seconds(",.0f")),
    Column("test NLL, T = 1 / 0.3 / 0.1 / 0.03 / 0.01", _m("nll", ".3f")),
    Column("accuracy", _m("test_accuracy", ".2f")),
    Column("AUROC, total", _m("auroc_total", ".2f")),
    Column("AUROC, epistemic", _m("auroc_epistemic", ".2f")),
)

STO_ACCURACY_COLUMNS = _table(
    Column("problem", lambda r: r["problem"]),
    WHERE,
    Column("draws", _m("draws", ".0f")),
    Column("CG passes", _m("cg_passes", ".0f")),
    Column("seconds", _seconds(",.1f")),
    Column("exact (s)", _m("exact_seconds", ",.3f")),
    Column("engine / exact", _m("slower", ".0f", suffix="×")),
    Column("mean err. (sd)", _m("mean_error_sd", ".3f")),
    Column("cov. error, same noise", _m("cov_error", ".3f")),
    Column("sd err., same noise", _m("sd_error", ".3f")),
    Column("warned", lambda r: "–" if r["status"] != "ok" else "yes" if r["metrics"]["warned"] else "no"),
)

STO_COST_COLUMNS = _table(
    Column("problem", lambda r: r["problem"]),
    Column("d", lambda r: f"{PROBLEMS[r['problem']].d:,}"),
    WHERE,
    Column("draws K", _m("draws", ".0f")),
    Column("step, K draws (s)", _seconds(".3f")),
    Column("per draw / fwd+bwd", _m("per_draw_vs_hand", ".1f", suffix="×")),
    Column("marginal / fwd+bwd", _m("marginal_vs_hand", ".1f", suffix="×")),
    Column("extra RSS, 1 / K (MB)", _m("extra_mb")),
    Column("memory per draw (d floats)", _m("floats_per_draw", ".1f")),
)

STO_EM_COLUMNS = _table(
    Column("network", lambda r: r["problem"] or "digits 64-100-10"),
    ENGINE,
    WHERE,
    Column("seconds", _seconds(",.0f")),
    Column("change of α by EM step", _m("changes")),
    Column("settled after step", _m("settled", ".0f")),
    Column("final α", _m("prior_precision")),
    Column("test NLL (probit)", _m("nll", ".3f")),
    Column("ECE", _m("ece", ".3f")),
    Column("accuracy", _m("test_accuracy", ".1%")),
)

EKF_COLUMNS = _table(
    Column("problem", lambda r: r["problem"]),
    ENGINE,
    WHERE,
    Column("seconds", _seconds(",.2f")),
    Column("mean err. (sd)", _m("mean_error_sd", ".2f")),
    Column("sd / exact sd", _m("sd_ratio")),
    Column("warned", lambda r: "–" if r["status"] != "ok" else "yes" if r["metrics"]["warned"] else "no"),
    measured=False,
)

SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "peers",
            "SG-MCMC against NUTS (Pyro, NumPyro, BlackJAX) and NumPyro's HMCECS: time to accuracy",
            {
                "smoke": (("logistic", 10**4), ("regression", 10**4)),
                "full": (("logistic", 10**5), ("regression", 10**5), ("logistic", 10**6), ("regression", 10**6)),
            },
            MCMC_ENGINES,
            MCMC_COLUMNS,
        ),
        Suite(
            "exact",
            "Every engine against an exact Gaussian posterior (linear regression, d = 100, known noise)",
            {"smoke": (("linear", 10**4),), "full": (("linear", 10**5),)},
            ("ours-sto", "ours-sghmc", "numpyro-nuts", "blackjax-nuts", "pyro-nuts"),
            MCMC_COLUMNS,
        ),
        Suite(
            "laplace",
            "Linearised Laplace against laplace-torch on digits: cost, memory, calibration",
            {"smoke": ((None, 0),), "full": ((None, 0),)},
            LAPLACE_ENGINES,
            LAPLACE_COLUMNS,
        ),
        Suite(
            "laplace-cost",
            "Linearised Laplace against laplace-torch on a 109,386-weight MLP: fit, predictive, memory",
            {"smoke": (("teacher", 2000),), "full": (("teacher", 10_000),)},
            tuple(f"{i}-{o}-{s}" for i, o, s in LAPLACE_CALLS),
            LAPLACE_COST_COLUMNS,
        ),
        Suite(
            "swag",
            "SWAG and SGHMC from the digits MAP, beside the Laplace fit: cost for a test NLL",
            {"smoke": ((None, 0),), "full": ((None, 0),)},
            ("map", "ours-laplace-kron", "swag-5", "swag-20", "swag-50", "ours-sghmc-1000", "ours-sghmc-4000"),
            DIGITS_COLUMNS,
        ),
        Suite(
            "hierarchies",
            "SGHMC at the defaults against Pyro's NUTS on an ill-conditioned regression and two hierarchies: ESS/s",
            {
                "smoke": (("ill-conditioned", 1000), ("partial-pooling", 110), ("hierarchical-logistic", 2000)),
                "full": (("ill-conditioned", 5000), ("partial-pooling", 220), ("hierarchical-logistic", 6366)),
            },
            ("ours-sghmc-fixed", "pyro-nuts-fixed"),
            HIERARCHY_COLUMNS,
        ),
        Suite(
            "calibration",
            "Posterior sd against the minibatch size on a conjugate regression: ours at the defaults and posteriors",
            {"smoke": (("conjugate", 500),), "full": (("conjugate", 1000),)},
            tuple(
                f"{k}-b{b}"
                for k in ("sgld", "sghmc", "psgld", "sgnht", "baoab", "posteriors-sgld", "posteriors-sghmc")
                for b in (10, 30, 100, "N")
            ),
            CALIBRATION_COLUMNS,
        ),
        Suite(
            "distributed",
            'Data-parallel SGLD (distributed="data") on 2 CPU ranks against 1: time per step',
            {"smoke": (("mlp-regression", 2000),), "full": (("mlp-regression", 4000),)},
            ("data-parallel-ignore", "data-parallel-correct"),
            DISTRIBUTED_COLUMNS,
        ),
        Suite(
            "sgmcmc-step",
            "One SGHMC step against a hand-written torch loop and posteriors; 16 vectorised chains",
            {
                "smoke": (("step-logistic", 10**5), ("step-mlp", 10**4)),
                "full": (("step-logistic", 10**6), ("step-mlp", 10**5)),
            },
            ("ours-step", "ours-step-corrected", "ours-16-chains"),
            STEP_COLUMNS,
        ),
        Suite(
            "step-blackjax",
            "One SGHMC step, eager and compiled, against BlackJAX's jitted SGLD step (logistic regression, one chain)",
            {
                "smoke": (("step-logistic-d10", 10**4), ("step-logistic", 10**4)),
                "full": (("step-logistic-d10", 10**5), ("step-logistic", 10**5)),
            },
            ("step-vs-blackjax",),
            BLACKJAX_COLUMNS,
        ),
        Suite(
            "cold-posterior",
            "Every engine tempered to p(θ | D)^(1/T) on digits: test NLL, accuracy, AUROC against turned digits",
            {"smoke": (("cold-digits", 600),), "full": (("cold-digits", 1347),)},
            tuple(f"cold-{e}" for e in COLD_ENGINES),
            COLD_COLUMNS,
        ),
        Suite(
            "sto-accuracy",
            "Sample-then-optimise against exact solves of the same perturbed problems (linear-Gaussian, float64)",
            {
                "smoke": (("sto-scaled-d100", 2000), ("sto-correlated-d100", 2000)),
                "full": (("sto-scaled-d1000", 20_000), ("sto-correlated-d1000", 20_000), ("sto-scaled-d2000", 20_000)),
            },
            ("ours-sto-accuracy",),
            STO_ACCURACY_COLUMNS,
        ),
        Suite(
            "sto-cost",
            "Sample-then-optimise on a tanh MLP: step per draw against a forward + backward, memory per draw",
            {
                "smoke": (("sto-mlp-h64", 2000),),
                "full": (("sto-mlp-h64", 10_000), ("sto-mlp-h280", 10_000), ("sto-mlp-h950", 10_000)),
            },
            ("ours-sto-cost",),
            STO_COST_COLUMNS,
        ),
        Suite(
            "sto-em",
            "Sample-then-optimise's EM for the prior precision from the digits MAP",
            {"smoke": ((None, 0),), "full": ((None, 0),)},
            ("ours-sto-em-scalar", "ours-sto-em-site"),
            STO_EM_COLUMNS,
        ),
        Suite(
            "ekf",
            "The EKF on four GLMs streamed once in minibatches of B, against their exact posteriors",
            {"smoke": GLMS, "full": GLMS},
            tuple(f"{kind}-b{b}" for b in (1000, 100, 10) for kind in ("ekf", "diagonal-ekf")),
            EKF_COLUMNS,
        ),
    )
}
