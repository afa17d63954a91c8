r"""The health of a finished set of chains, told in one warning.

After a run, three things can make the draws unusable while every number in them is finite:

* **not converged**: the chains disagree. Split :math:`\hat R` above 1.01 (with 4 or more chains, the threshold
  of Vehtari et al. 2021, "Rank-normalization, folding, and localization") names the site. With fewer chains
  the same test runs on fewer split halves, whose :math:`\hat R` scatters more on healthy chains, so its limit is
  raised to keep the false alarms as rare as 1.01's with 4 (:func:`r_hat_limit`): a chain stuck in one mode of a
  bimodal posterior while another visits both is caught with 2 or 3 chains. One chain is compared with itself
  only (its two halves): chains that each stay in a different mode cannot be told apart from one, and its warning
  says so;
* **too few independent draws**: an effective sample size under 100 per chain (same source) makes the Monte-Carlo
  error of a mean larger than a tenth of a posterior sd and r_hat itself unreliable;
* **stuck**: a chain that repeats its draw. A rejected (diverging) step keeps the state; so does an update that
  underflows against the state (an overflowing likelihood, a step far too small). ``sample_stats["repeated"]``
  marks every kept draw equal, at every site, to the one before it in its chain, whatever the cause.

:math:`\hat R` and the ESS are the rank-normalised split :math:`\hat R` (the larger of the bulk's and the folded
tails') and the bulk ESS of Vehtari et al. (2021), the statistics ``az.summary`` shows and its 1.01 / 100 thresholds
are for (:func:`rank_r_hat`, :func:`bulk_ess`); Pyro's plain split :math:`\hat R` reads lower and would pass runs
that ``az.summary`` flags. The autocorrelation estimator under the ESS is :func:`effective_sample_size`,
the same estimator as :func:`pyro.ops.stats.effective_sample_size` (Geyer's initial monotone sequence on the
multi-chain autocorrelation of the Stan reference manual) in O(chains × draws) memory: Pyro's builds a
(draws/2)² matrix per coordinate for the monotone sequence, 20 GB for 10 coordinates at 16,000 draws per chain.
Both are computed on the unconstrained draws in chunks of coordinates, so that a network's worth of weights never
needs more than a bounded FFT buffer.
Convergence is not judged at temperature 0 (optimisation) or with fewer than 4 draws per chain. What to do about a
problem depends on its cause (a run too short, a collapsed warm-up, chains in different modes, a hierarchy):
:mod:`~pyro_scalable.infer.remedies` chooses the advice from the run's own figures, among them
:func:`chain_agreement`, the chain means against their Monte-Carlo standard errors.

The limits for fewer chains: for mixed chains cut into :math:`m = 2C` halves of :math:`n_e` effective draws each,
the between-halves variance over the within is :math:`\chi^2_{m-1}/(m-1)` over :math:`n_e`, so
:math:`\hat R - 1 \approx X / (2 n_e)` with :math:`X \sim \chi^2_{m-1}/(m-1)`. At the ESS the warning advises,
:data:`ESS_ADVISED` per chain (:math:`n_e = ESS_{advised}/2`), that is :math:`X / ESS_{advised}` whatever
:math:`C`; 1.01 with 4 chains is then the :math:`1 - \alpha` quantile with :math:`\alpha = P(\chi^2_7 > 17.5)
\approx 0.014`, and :math:`C` chains get the same quantile of :math:`\chi^2_{2C-1}/(2C-1)`.
"""

from __future__ import annotations

import math
import warnings

import torch
from pyro.ops.stats import autocovariance, gelman_rubin
from torch import Tensor

from pyro_scalable.bridge.checks import user_stacklevel
from pyro_scalable.infer.remedies import Degenerate, RunSetup, convergence_remedy, degenerate

__all__ = [
    "HealthWarning",
    "bulk_ess",
    "chain_agreement",
    "effective_sample_size",
    "r_hat_limit",
    "rank_r_hat",
    "repeated_draws",
    "site_diagnostics",
    "warn_unhealthy",
]

R_HAT_LIMIT = 1.01
ESS_PER_CHAIN = 100
# what the warning's num_samples aims at: from about this ESS per chain r_hat <= 1.01 holds in every seed on the
# zoo of test models (at 100-120 it fails in some)
ESS_ADVISED = 250
# the limit of split r_hat for 1-3 chains: the false-alarm rate of 1.01 with 4 chains (module docstring; rounded up)
_FEW_CHAINS_LIMITS = {1: 1.024, 2: 1.015, 3: 1.012}
R_HAT_MIXED = 1.1  # above this the chains have not mixed, and their ESS per draw does not tell how long to run
# the most full-data gradients per effective draw that full-batch NUTS spends on the zoo of test models (warm-up
# included; the centred hierarchy's): a run that makes more data passes than this per effective draw costs more
# than full-batch NUTS would
NUTS_PASSES_PER_ESS = 93.0
_CHUNK = 1024  # coordinates per FFT


class HealthWarning(UserWarning):
    """The chains have not converged, have too few independent draws, repeat their draws, or diverged."""


def r_hat_limit(num_chains: int) -> float:
    """The split R̂ above which ``num_chains`` chains are reported as not converged (1.01 from 4 chains on).

    Example:
        >>> r_hat_limit(4), r_hat_limit(2), r_hat_limit(1)
        (1.01, 1.015, 1.024)

    """
    return _FEW_CHAINS_LIMITS.get(num_chains, R_HAT_LIMIT)


def repeated_draws(draws: dict[str, Tensor]) -> Tensor:
    """``(chains, draws)`` bool: the draw equals the chain's previous draw at every site (the first never does).

    Example:
        >>> w = torch.tensor([[[0.0], [1.0], [1.0], [2.0]]])  # one chain, four draws of a (1,) site
        >>> repeated_draws({"w": w})
        tensor([[False, False,  True, False]])

    """
    first_value = next(iter(draws.values()))
    if first_value.shape[1] < 2:
        return torch.zeros(first_value.shape[:2], dtype=torch.bool, device=first_value.device)
    same = None
    for value in draws.values():
        equal = (value[:, 1:] == value[:, :-1]).reshape(value.shape[0], value.shape[1] - 1, -1).all(-1)
        same = equal if same is None else same & equal
    first = torch.zeros_like(same[:, :1])
    return torch.cat([first, same], dim=1)


def effective_sample_size(draws: Tensor, chain_dim: int = 0, sample_dim: int = 1) -> Tensor:
    """The multi-chain ESS of every coordinate of ``draws``: Pyro's estimator in linear memory.

    Example:
        >>> from pyro.ops import stats
        >>> x = torch.randn(4, 300, 3, generator=torch.Generator().manual_seed(0)).cumsum(1)  # random walks
        >>> bool(torch.allclose(effective_sample_size(x), stats.effective_sample_size(x)))
        True

    """
    x = draws.movedim((chain_dim, sample_dim), (1, 0))  # (N, C, ...)
    num_draws, num_chains = x.shape[:2]
    gamma = autocovariance(x, dim=0)  # (N, C, ...)
    within = x.var(0).mean(0)
    estimator = (num_draws - 1) / num_draws * within
    if num_chains > 1:
        estimator = estimator + x.mean(0).var(0)
    else:  # one chain: rho is its autocorrelation
        within = estimator
    rho = (estimator - within + gamma.mean(1)) / estimator
    rho[0] = 1.0
    pairs = rho[: num_draws - num_draws % 2].reshape((num_draws // 2, 2) + rho.shape[1:]).sum(1)
    tau = -1 + 2 * pairs[0]
    if pairs.shape[0] > 1:
        monotone = torch.cummin(pairs[1:].clamp(min=0), dim=0).values
        tau = tau + 2 * monotone.sum(0)
    return num_chains * num_draws / tau


def rank_normalised(draws: Tensor) -> Tensor:
    """Draws ``(chains, draws, k)`` as split chains ``(2 chains, draws // 2, k)`` of normal scores of their ranks.

    Vehtari et al. (2021): the ranks over all draws, r, become z = Φ⁻¹((r - 3/8) / (S + 1/4)); each chain is cut
    in two halves so that a trend within a chain shows as disagreement between chains.
    """
    split = _split(draws)
    flat = split.reshape(-1, *split.shape[2:])
    ranks = flat.argsort(0).argsort(0).to(draws.dtype) + 1.0
    scores = torch.special.ndtri((ranks - 0.375) / (flat.shape[0] + 0.25))
    return scores.reshape(split.shape)


def _split(draws: Tensor) -> Tensor:
    """Each chain of ``(chains, draws, ...)`` as its two halves (the middle draw of an odd length left out)."""
    half = draws.shape[1] // 2
    return torch.cat([draws[:, :half], draws[:, draws.shape[1] - half :]], dim=0)


def _median(flat: Tensor) -> Tensor:
    """The median over dimension 0, the two middle values averaged (NumPy's and ArviZ's; torch's takes the lower)."""
    ordered = flat.sort(0).values
    return (ordered[(flat.shape[0] - 1) // 2] + ordered[flat.shape[0] // 2]) / 2


def rank_r_hat(draws: Tensor, chain_dim: int = 0, sample_dim: int = 1) -> Tensor:
    """The rank-normalised split R̂ of every coordinate (``az.summary``'s ``r_hat``): the bulk's or the tails'.

    Example:
        >>> x = torch.randn(4, 500, 1, generator=torch.Generator().manual_seed(0))
        >>> x[0] += 1.0  # one chain away from the others
        >>> bool(rank_r_hat(x) > 1.05)
        True

    """
    x = draws.movedim((chain_dim, sample_dim), (0, 1))
    folded = (x - _median(_split(x).flatten(0, 1))).abs()
    return torch.maximum(
        gelman_rubin(rank_normalised(x), chain_dim=0, sample_dim=1),
        gelman_rubin(rank_normalised(folded), chain_dim=0, sample_dim=1),
    )


def bulk_ess(draws: Tensor, chain_dim: int = 0, sample_dim: int = 1) -> Tensor:
    """The bulk ESS of every coordinate (``az.summary``'s ``ess_bulk``): the ESS of the rank-normalised split chains.

    Example:
        >>> x = torch.randn(4, 1000, 1, generator=torch.Generator().manual_seed(0))  # independent draws
        >>> 3000 < float(bulk_ess(x)) < 5000
        True

    """
    x = draws.movedim((chain_dim, sample_dim), (0, 1))
    return effective_sample_size(rank_normalised(x))


def chain_agreement(draws: Tensor) -> tuple[float, float, list[float]]:
    """Whether the chains ``(chains, draws, ...)`` sample one distribution: their means against their own errors.

    Returns the largest spread of the chain means over the root-mean-square of their Monte-Carlo standard errors
    (about 1 for chains of one distribution, whatever their length), the largest split R̂ of any chain alone (its
    two halves compared), and the chain means of the coordinate whose spread is the largest.

    Example:
        >>> x = torch.randn(4, 400, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> apart, within, _ = chain_agreement(x)
        >>> x[:2] += 3.0  # two chains around another mode, 3 sds away: their means 60 standard errors apart
        >>> round(apart, 1), round(chain_agreement(x)[0]), within < 1.1
        (1.0, 33, True)

    """
    flat = draws.reshape(draws.shape[0], draws.shape[1], -1).double()
    chains, means = range(flat.shape[0]), flat.mean(1)
    apart, within = [], []
    for i in range(0, flat.shape[-1], _CHUNK):  # a bounded FFT buffer, as _worst's
        part = flat[..., i : i + _CHUNK]
        error = torch.stack(
            [part[c].std(0) / effective_sample_size(part[c : c + 1]).clamp(min=1.0).sqrt() for c in chains]
        )
        apart.append(means[:, i : i + _CHUNK].std(0) / error.square().mean(0).sqrt())
        within.append(torch.stack([rank_r_hat(part[c : c + 1]) for c in chains]).amax(0))
    spread = torch.cat(apart)
    worst = int(torch.nan_to_num(spread, nan=-1.0).argmax())
    return float(spread[worst]), float(torch.cat(within).max()), means[:, worst].tolist()


def site_diagnostics(draws: Tensor) -> tuple[Tensor, Tensor]:
    """The bulk ESS and the rank-normalised R̂ of every coordinate of one site's ``(chains, draws, *shape)`` draws.

    The figures the warning reads, each shaped as the site: R̂ as ``az.summary``'s ``r_hat`` of the same draws; the
    ESS, Pyro's estimator on the rank-normalised split chains, within about 1% of its ``ess_bulk`` on mixed chains.

    Example:
        >>> x = torch.randn(4, 500, 2, generator=torch.Generator().manual_seed(0))
        >>> ess, r_hat = site_diagnostics(x)
        >>> ess.shape, bool(r_hat.max() < 1.01)
        (torch.Size([2]), True)

    """
    return _per_coordinate(draws, bulk_ess), _per_coordinate(draws, rank_r_hat)


def _per_coordinate(value: Tensor, statistic) -> Tensor:
    """``statistic`` of every coordinate of a ``(chains, draws, *shape)`` site, in float64, shaped as the site."""
    flat = value.reshape(value.shape[0], value.shape[1], -1).double()
    results = [
        statistic(flat[..., i : i + _CHUNK], chain_dim=0, sample_dim=1) for i in range(0, flat.shape[-1], _CHUNK)
    ]
    return torch.cat(results).reshape(value.shape[2:])


def _worst(value: Tensor, statistic, reduce) -> float:
    """``statistic`` over every coordinate of a ``(chains, draws, *shape)`` site, reduced (max or min)."""
    return float(reduce(_per_coordinate(value, statistic)))


def warn_unhealthy(
    draws: dict[str, Tensor],
    stats: dict[str, Tensor],
    warmup_divergences: int = 0,
    *,
    data_passes: float | None = None,
    setup: RunSetup | None = None,
    stalled: Degenerate | None = None,
) -> None:
    """One :class:`HealthWarning` saying what is wrong with the chains ``{site: (chains, draws, ...)}``, if anything.

    ``data_passes``: the full-data passes the run made (all chains, warm-up included; ``None``: not known). Where
    they come to more per effective draw than full-batch NUTS spends (:data:`NUTS_PASSES_PER_ESS`), the warning
    says so. ``setup``: how the run was set up, where the remedy depends on it (:mod:`.remedies`: whether warm-up
    chose the step size, a control variate, the priors' latent parameters). ``stalled``: a step the engine found
    stuck (some chains' steps far below the others'), which, as a step that moves nothing does, comes first and
    replaces the other remedies where the chains are unhealthy.

    Example:
        >>> import warnings
        >>> w = torch.randn(4, 500, generator=torch.Generator().manual_seed(0))
        >>> w[0] += 1.0  # one chain away from the others
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_unhealthy({"w": w}, {})
        >>> "r_hat above 1.01 at 'w'" in str(caught[0].message)
        True

    """
    problems, remedies, setup = [], [], setup or RunSetup()
    num_chains, num_draws = next(iter(draws.values())).shape[:2]
    sampling = "temperature" not in stats or bool((stats["temperature"] > 0).any())
    if sampling and num_draws >= 4:
        with torch.no_grad():
            r_hat = {k: _worst(v, rank_r_hat, torch.max) for k, v in draws.items()}
            ess = {k: _worst(v, bulk_ess, torch.min) for k, v in draws.items()}
        limit = r_hat_limit(num_chains)
        high = [f"'{k}' ({v:.3g})" for k, v in r_hat.items() if not v <= limit]
        if high:
            of = "" if num_chains >= 4 else f" (the limit for {num_chains} chain{'s' if num_chains > 1 else ''})"
            problems.append(f"r_hat above {limit}{of} at {', '.join(high)}")
        low = [f"'{k}' ({v:.0f})" for k, v in ess.items() if not v >= ESS_PER_CHAIN * num_chains]
        if low:
            problems.append(
                f"an effective sample size under {ESS_PER_CHAIN} per chain ({ESS_PER_CHAIN * num_chains} in all) at "
                f"{', '.join(low)}"
            )
        least = min(ess.values(), default=math.inf)
        worst = max(r_hat.values(), default=1.0)
        if (high or low) and 0 < least < math.inf:
            # once the chains have mixed, the ESS grows in proportion to the draws and split r_hat - 1 shrinks as one
            # over them: the factor this run's own figures ask for
            factor = max(ESS_ADVISED * num_chains / least, (worst - 1.0) / (limit - 1.0), 1.0)
            length = (
                f"this run gave {least / (num_chains * num_draws):.2g} effective draws per draw: about "
                f"num_samples={_round_up(num_draws * factor)} per chain would give {ESS_ADVISED} per chain, "
                "from which r_hat <= 1.01 held on the models we test"
            )
            agreement = None if num_chains < 2 else (lambda site: chain_agreement(draws[site]))
            remedies.append(convergence_remedy(r_hat, limit, length, setup, agreement, R_HAT_MIXED))
            if data_passes is not None and data_passes / least > NUTS_PASSES_PER_ESS:
                remedies.append(
                    f"this run made {data_passes / least:.3g} full-data passes per effective draw, more than "
                    f"full-batch NUTS needed on any of our test models ({NUTS_PASSES_PER_ESS:g} at most): "
                    "pyro.infer.NUTS(mcmc.kernel.model) (or NumPyro's NUTS) is likely the cheaper sampler here"
                )
    repeated = stats.get("repeated")
    if repeated is not None and bool(repeated.any()):
        runs = _longest_runs(repeated)
        chain = int(runs.argmax())
        problems.append(
            f"{int(repeated.sum())} of {repeated.numel()} kept draws repeat the draw before them (chain {chain} "
            f"for {int(runs[chain])} draws in a row: stuck, see sample_stats.repeated)"
        )
    diverging = int(stats["diverging"].sum()) if "diverging" in stats else 0
    if diverging or warmup_divergences:
        problems.append(
            f"{diverging} kept draws and {warmup_divergences} warmup steps diverged (non-finite log density or "
            "gradient; those steps were rejected and are marked in sample_stats.diverging)"
        )
    if diverging:
        remedies.append("a step that diverges in sampling is too large: a smaller step_size or a longer num_warmup")
    collapsed = (stalled or degenerate(stats, setup)) if problems else None  # a stuck step: no other remedy helps
    if collapsed is not None:
        problems.insert(0, collapsed.problem)
        remedies = [collapsed.remedy]
    if problems:
        advice = "; ".join(remedies or ["run longer (num_warmup, num_samples), or reparametrise the model"])
        if sampling and num_chains == 1:
            advice += (
                "; with one chain, non-mixing between chains (each stuck in its own mode) cannot be detected: "
                "run num_chains=4 or more to check"
            )
        warnings.warn(
            "the chains are not healthy: "
            + "; ".join(problems)
            + ". "
            + advice[:1].upper()
            + advice[1:]
            + ". The diagnostics are in summary() and to_inference_data().",
            HealthWarning,
            stacklevel=user_stacklevel(),
        )


def _round_up(value: float) -> int:
    """``value`` rounded up to two significant digits (a length to suggest, not to compute with)."""
    digits = max(int(math.floor(math.log10(max(value, 1.0)))) - 1, 0)
    return int(math.ceil(value / 10**digits) * 10**digits)


def _longest_runs(repeated: Tensor) -> Tensor:
    """Per chain, the longest stretch of consecutive repeated draws."""
    longest = torch.zeros(repeated.shape[0], dtype=torch.long)
    for chain, row in enumerate(repeated.cpu()):
        run = best = 0
        for flag in row.tolist():
            run = run + 1 if flag else 0
            best = max(best, run)
        longest[chain] = best
    return longest
