"""Pyro ports of 32 posteriordb reference posteriors: an accuracy yardstick this project did not make.

posteriordb (https://github.com/stan-dev/posteriordb) is the Stan developers' database of posteriors, each a Stan
model, its data and reference draws from long NUTS runs (10 chains x 1,000 draws, r_hat about 1.00). The 32 here
are its posteriors with iid or sequential observations (its two ODE posteriors are left out): 26 linear regressions
(Gelman and Hill's earnings, kidiq, mesquite and nes examples; sblrc), ARMA(1, 1) and GARCH(1, 1) series, three
hidden Markov models and a Gaussian process. None of the 32 is a logistic regression. Each port is this project's
own Pyro code, written from the Stan model: the same priors, likelihood and constraints.

* ``data/``: each posterior's data, the posteriordb zip's JSON byte for byte; ``reference.json``: per Stan parameter
  (``beta[1]``, ...) the mean, sd and 5/50/95% quantiles of the reference draws (the draws themselves are not
  vendored). Both are posteriordb's, under its BSD-3 licence: ``LICENCE.md`` in this folder.
* Regenerate both from a posteriordb checkout: ``python scripts/posteriordb_reference.py [PATH]`` (default
  ``/work/shared/posteriordb``; posteriordb's own repository layout is read too).
* Data plates: the 26 regressions observe ``y`` in ``pyro.plate("data", N, subsample_size=B)`` with
  B = max(10, round(N / 10)): 119 (earnings, N = 1,192), 43 (kidiq, 434), 10 (mesquite, 46; sblrc, 100), 70-135
  (nes, 701-1,350). ARMA and GARCH have a sequential likelihood, the HMMs a forward algorithm over one sequence and
  the GP one multivariate Normal: full-batch models without a data plate (``Posterior.no_data_plate`` says why).
* Priors: Stan's own where it states one (``cauchy(0, 2.5)`` on a positive scale is ``HalfCauchy(2.5)``, a
  ``normal(0, s)`` on one ``HalfNormal(s)``). A flat Stan prior has no Pyro equivalent; the wide proper prior standing
  in for it is ``Posterior.priors``: Normal(0, 1000) for a coefficient and HalfNormal(1000) for a scale, 10⁴ for
  mesquite's grams and 10⁶ for earnings in dollars; GARCH's location and intercept likewise. A flat prior on a bounded
  set is proper and kept exactly: Dirichlet(1, ..., 1) on a simplex, GARCH's uniform triangle (``structured.py``).
* The check: each port, before any engine is judged by it, ran Pyro's NUTS on the full data
  (``FullDataModel``), float64, 4 chains x (500 warm-up + 1,000 draws) or longer, and passed when every Stan
  parameter's mean is within 0.25 reference sd of the reference mean and its sd within 0.8-1.25 times the reference
  sd (:func:`errors`). ``python scripts/posteriordb_check_ports.py`` writes ``ports_checked.json`` beside this file
  and ``benchmarks/results/posteriordb_ports.md``.

Example:
    >>> from tests.posteriordb import POSTERIORS
    >>> posterior = POSTERIORS["kidiq-kidscore_momiq"]
    >>> posterior.kind, posterior.batch_size, list(posterior.reference())
    ('regression', 43, ['beta[1]', 'beta[2]', 'sigma'])
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from tests.posteriordb import regressions, structured
from tests.posteriordb.entry import Posterior, load_reference

__all__ = [
    "CHECKED",
    "MEAN_TOLERANCE",
    "NOT_PORTED",
    "POSTERIORS",
    "SD_RATIO",
    "Posterior",
    "checked",
    "errors",
    "load_reference",
]

POSTERIORS: dict[str, Posterior] = {**regressions.PORTS, **structured.PORTS}
NOT_PORTED: dict[str, str] = {}  # name -> why it cannot be a faithful Pyro model (none of the 32)
CHECKED = Path(__file__).with_name("ports_checked.json")  # the NUTS check's outcome per port
MEAN_TOLERANCE = 0.25  # |mean - reference mean| in reference sds
SD_RATIO = (0.8, 1.25)  # sd / reference sd


def errors(posterior: Posterior, samples: Mapping[str, Tensor]) -> dict[str, float | bool]:
    """Draws by site (any leading draw dimensions) against the reference: the worst Stan parameter of each measure.

    Returns ``mean_error`` (the largest ``|mean - reference mean| / reference sd``), ``sd_ratio`` (the ratio
    ``sd / reference sd`` farthest from 1 on a log scale), the parameters they came from, and ``passed``.
    """
    missing = [site for site in posterior.stan_names if site not in samples]
    if missing:
        raise KeyError(f"no draws of the site(s) {missing}: errors() judges every Stan parameter")
    reference = posterior.reference()
    worst = {"mean_error": 0.0, "mean_error_at": "", "sd_ratio": 1.0, "sd_ratio_at": ""}
    for stan_name, draws in posterior.stan_draws(samples).items():
        flat = draws.detach().double().reshape(-1)
        mean_error = abs(float(flat.mean()) - reference[stan_name]["mean"]) / reference[stan_name]["sd"]
        sd_ratio = float(flat.std()) / reference[stan_name]["sd"]
        if mean_error > worst["mean_error"]:
            worst |= {"mean_error": mean_error, "mean_error_at": stan_name}
        if _from_one(sd_ratio) > _from_one(worst["sd_ratio"]):
            worst |= {"sd_ratio": sd_ratio, "sd_ratio_at": stan_name}
    worst["passed"] = worst["mean_error"] <= MEAN_TOLERANCE and SD_RATIO[0] <= worst["sd_ratio"] <= SD_RATIO[1]
    return worst


def _from_one(ratio: float) -> float:
    return max(ratio, 1.0 / ratio) if ratio > 0.0 else math.inf


def checked() -> dict:
    """The NUTS check's record (``ports_checked.json``)."""
    return json.loads(CHECKED.read_text())
