r"""What to do about unhealthy chains: the remedy that fits the case, chosen from the run's own figures.

:func:`~pyro_scalable.infer.health.warn_unhealthy` finds *what* is wrong (r_hat, ESS, repeated draws,
divergences); this module says *what to do*, and the same symptom has different remedies:

* **a degenerate warm-up** (:func:`degenerate`): a step size below :data:`LEAST_STEP` or a friction above
  :data:`MOST_FRICTION` moves a chain by less than its values' rounding, so it repeats its draws. Warm-up chose
  them (a prior far wider than the posterior starts it where the minibatch noise is extreme; a control variate
  centred far from the chains adds more) or the user did; more steps do not help either way.
* **a run too short**: the chains agree within their Monte-Carlo error but have too few effective draws. Split
  :math:`\hat R` of a short run is high even for well-mixing chains (:math:`\hat R - 1` scatters as one over the
  effective draws per chain: :mod:`~pyro_scalable.infer.health`), so a high :math:`\hat R` alone does not mean the
  chains disagree. Their means are compared with their Monte-Carlo standard errors instead: for chains that sample one
  distribution, the spread of the chain means over the root-mean-square of their standard errors
  :math:`\mathrm{sd}_c/\sqrt{\mathrm{ESS}_c}` is about 1 (:math:`\sqrt{\chi^2_{C-1}/(C-1)}`). The remedy is the length
  to run, from the ESS per draw.
* **chains in different modes**: that spread is above :data:`CHAINS_APART` while each chain agrees with itself (its
  own split :math:`\hat R` at most :data:`WITHIN_MIXED`): a longer run of the same chains will not join them.
* **a hierarchy**: the sites with a high :math:`\hat R` have a prior that depends on other latents, or are those
  latents (:func:`~pyro_scalable.bridge.hierarchy.prior_parents`): the funnel is the model's, and the remedy is a
  non-centred parametrisation or NUTS.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "CHAINS_APART",
    "LEAST_STEP",
    "MOST_FRICTION",
    "WITHIN_MIXED",
    "Degenerate",
    "RunSetup",
    "convergence_remedy",
    "degenerate",
]

LEAST_STEP = 1e-8  # a step size below this moves a chain by less than its values' rounding (float32's is 6e-8)
MOST_FRICTION = 1e8  # a friction above this damps every move the same way
# chain means this many Monte-Carlo standard errors apart: not one distribution (about 1 where they are; 10 is
# beyond chi2 quantiles for any chain count, and short runs on the regressions we test give 0.5-1.1)
CHAINS_APART = 10.0
# each chain's own split r_hat below this: the chain is mixed within itself (chains stuck in different modes of a
# bimodal posterior gave 1.09-1.32 over 300 draws; a chain still drifting after too short a warm-up gave 2.1)
WITHIN_MIXED = 1.5


class RunSetup(NamedTuple):
    """How the run was set up, where the remedy depends on it (the driver's; a bare call knows none of it)."""

    tuned: bool = False  # warm-up chose the step size (and friction) in sample_stats, not the user
    control_variate: bool = False  # the run's gradient had a control variate
    parents: Mapping[str, tuple[str, ...]] = {}  # each latent's prior's latent parameters (bridge/hierarchy.py)


class Degenerate(NamedTuple):
    """A step size or friction that no longer moves the chains: what it was, and what to try."""

    problem: str
    remedy: str


def degenerate(stats: Mapping[str, Tensor], setup: RunSetup) -> Degenerate | None:
    """The chains' step size below :data:`LEAST_STEP` or friction above :data:`MOST_FRICTION` (else ``None``).

    Example:
        >>> stats = {"step_size": torch.full((2, 5), 1e-30), "friction": torch.full((2, 5), 1e29)}
        >>> print(degenerate(stats, RunSetup(tuned=True)).problem.replace(" and", chr(10) + "and"))
        warm-up collapsed: the step sizes it chose are down to 1e-30 (below 1e-08)
        and the frictions up to 1e+29 (above 1e+08) in chains 0, 1, where a step no longer moves a chain

    """
    step, friction = stats.get("step_size"), stats.get("friction")
    small = _per_chain(step, torch.amin, lambda v: v < LEAST_STEP)
    large = _per_chain(friction, torch.amax, lambda v: v > MOST_FRICTION)
    if not small and not large:
        return None
    chains = ", ".join(str(c) for c in sorted(small.keys() | large.keys()))
    chosen = ("step sizes it chose are down to", "frictions up to")
    step_text, friction_text = chosen if setup.tuned else ("step size is", "friction is")
    parts = []
    if small:
        parts.append(f"{step_text} {min(small.values()):.2g} (below {LEAST_STEP:.0e})")
    if large:
        parts.append(f"{friction_text} {max(large.values()):.2g} (above {MOST_FRICTION:.0e})")
    if setup.tuned:
        problem = f"warm-up collapsed: the {' and the '.join(parts)} in chains {chains}, where a step no longer moves"
        problem += " a chain"
        tries = [
            "a narrower prior (one far wider than the posterior, as Normal(0, 1000) on a coefficient of "
            "standardised data, starts warm-up where the minibatch gradient's noise is extreme)"
        ]
        if setup.control_variate:
            tries.append("control_variate=None (a control variate centred far from the chains adds to that noise)")
        tries.append("a fixed step size (e.g. SGHMC(model, step_size=1e-3, friction=10.0, gradient_noise='correct'))")
        remedy = f"a longer run will not mend a collapsed warm-up: try {', or '.join(tries)}"
    else:
        problem = f"the {' and the '.join(parts)} in chains {chains}, where a step no longer moves a chain"
        remedy = "give a larger step_size and a friction of order 1-100, or leave both to warm-up (step_size=None)"
    return Degenerate(problem, remedy)


def _per_chain(value: Tensor | None, reduce: Callable, bad: Callable) -> dict[int, float]:
    if value is None or value.dim() < 1:
        return {}
    per_chain = reduce(value.reshape(value.shape[0], -1).double(), dim=1)
    return {c: float(v) for c, v in enumerate(per_chain.tolist()) if bad(v)}


def convergence_remedy(
    r_hat: Mapping[str, float],
    limit: float,
    length: str,
    setup: RunSetup,
    agreement: Callable[[str], tuple[float, float, list[float]]] | None,
    mixed: float,
) -> str:
    """What to do about a high r_hat or a low ESS: run longer, reparametrise a hierarchy, or know the modes apart.

    ``length``: the sentence with the num_samples to run (the remedy of a run too short); ``agreement(site)``: the
    chain means' spread in Monte-Carlo standard errors, the largest split r_hat of one chain alone, and the chain
    means of the site's worst coordinate (``None`` with one chain); ``mixed``: the r_hat below which the chains
    count as mixed (then the length is the remedy whatever the rest).
    """
    worst = max(r_hat.values(), default=1.0)
    if worst < mixed:
        return length
    high = sorted((k for k, v in r_hat.items() if not v <= limit), key=lambda k: -r_hat[k])
    children = [k for k in high if setup.parents.get(k)]
    hypers = [k for k in high if any(k in of for of in setup.parents.values())]
    if children or hypers:
        return _hierarchy_remedy(children, hypers, r_hat, setup.parents)
    if agreement is None or not high:
        return length
    apart, within, means = agreement(high[0])
    if not (math.isfinite(apart) and math.isfinite(within)):  # constant chains: the repeated draws tell
        return length
    if apart >= CHAINS_APART and within <= WITHIN_MIXED:
        shown = ", ".join(f"{m:.3g}" for m in means[:8])
        return (
            f"the chains sit in different modes: each agrees with itself (its own split r_hat at most {within:.3g}) "
            f"but their means at '{high[0]}' lie {apart:.3g} Monte-Carlo standard errors apart (chain means "
            f"{shown}), so a longer run of the same chains will not join them. Where the modes are copies of one "
            "another (a sign flip, relabelled components), break the symmetry in the model (an ordering, a positive "
            "constraint); otherwise each chain found a mode of its own: compare their log densities "
            "(sample_stats.lp) before reading the draws as one posterior"
        )
    if apart < CHAINS_APART:
        return (
            f"the chains agree within their Monte-Carlo error (their means at '{high[0]}' lie within {apart:.2g} "
            f"standard errors of one another): r_hat {worst:.3g} comes from too few draws, and {length}"
        )
    return (
        f"the chains still drift (each chain's two halves disagree: its own split r_hat up to {within:.3g} at "
        f"'{high[0]}'): a longer num_warmup, and {length}"
    )


def _hierarchy_remedy(
    children: list[str], hypers: list[str], r_hat: Mapping[str, float], of: Mapping[str, tuple[str, ...]]
) -> str:
    child = children[0] if children else next(k for k, p in of.items() if hypers[0] in p)
    above = ", ".join(f"'{k}' ({r_hat[k]:.3g})" for k in sorted({*children, *hypers}, key=lambda k: -r_hat[k])[:4])
    hyper = ", ".join(f"'{k}'" for k in of[child])
    return (
        f"the chains disagree at {above}, sites of a centred hierarchy ('{child}' has a prior that depends on "
        f"{hyper}), whose funnel a stochastic-gradient sampler crosses slowly at any length: reparametrise it "
        f"non-centred ('{child}' as loc + scale * z with z ~ Normal(0, 1); in Pyro "
        f"poutine.reparam(model, config={{'{child}': LocScaleReparam(centered=0.0)}})), or use NUTS "
        "(pyro.infer.NUTS(mcmc.kernel.model)) for a hierarchy of this size"
    )
