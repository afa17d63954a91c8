r"""Predictive uncertainty split into its aleatoric and epistemic parts, for every engine's predictive.

The posterior predictive at an input :math:`x` is the mixture
:math:`p(y \mid x, D) = \mathbb E_{\theta \sim p(\theta \mid D)}\, p(y \mid x, \theta)`. Its spread splits into the
part each model :math:`\theta` already has (aleatoric: noise in the data, which more data does not remove) and the
part that comes from the models disagreeing (epistemic: what more data would settle).

**Classification** (entropies in nats; :math:`p_\theta = p(\cdot \mid x, \theta)`, :math:`\bar p = \mathbb E\,
p_\theta`):

.. math::

    \underbrace{H[\bar p]}_{\text{total}}
    = \underbrace{\mathbb E_\theta\, H[p_\theta]}_{\text{aleatoric (expected entropy)}}
    + \underbrace{\mathbb E_\theta\, \mathrm{KL}(p_\theta \,\|\, \bar p)}_{\text{epistemic } I(y;\,\theta)}

(the mutual information of :math:`y` and :math:`\theta`; Depeweg et al. 2018, "Decomposition of uncertainty in
Bayesian deep learning"; the posteriors paper's eq. 2). The
identity holds term by term since :math:`\mathbb E_\theta \sum_y p_\theta(y) \log(p_\theta(y)/\bar p(y)) =
-\mathbb E_\theta H[p_\theta] + H[\bar p]`. Both parts are computed, and ``total`` is their sum, so the parts add
up to the total exactly in floating point too (it equals :math:`H[\bar p]` to rounding).

**Regression** (the law of total variance, per output):

.. math::

    \underbrace{\mathrm{Var}[y]}_{\text{total}}
    = \underbrace{\mathbb E_\theta\, \mathrm{Var}[y \mid \theta]}_{\text{aleatoric (noise)}}
    + \underbrace{\mathrm{Var}_\theta\, \mathbb E[y \mid \theta]}_{\text{epistemic (variance of the mean)}}

From :math:`S` posterior draws the expectations are the draws' averages (the variance over draws divides by
:math:`S`, the variance of the empirical mixture), so the split is that of the mixture of the draws' laws, exactly.
Any observed distribution with a ``mean`` and ``variance`` other than a Bernoulli or Categorical (Normal, Student-t,
Poisson, ...) is read this way.

**The linearised predictive** (Laplace, SWAG's ``predict``, sample-then-optimise's ``predict``): the outputs are
:math:`f \sim \mathcal N(m, V)` per point. For a Normal likelihood :math:`y = f + \sigma\varepsilon` the split is
closed-form: epistemic :math:`\mathrm{diag}(V)`, aleatoric :math:`\sigma^2` (the predictive's variance less
:math:`\mathrm{diag}(V)`; for a heteroscedastic Normal the log-normal moment of the noise). For classification the
expectations over :math:`f` have no closed form (the probit approximation gives :math:`\bar p` only), so
``num_samples`` draws of :math:`f` from :math:`\mathcal N(m, V)` (full per-point covariance) stand in for the draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import Tensor

from pyro_scalable.arguments import check_count, check_seed, fork_rng
from pyro_scalable.bridge.plates import FullDataModel
from pyro_scalable.memory import check_memory

if TYPE_CHECKING:
    from pyro_scalable.infer.linearized.glm import GLMPredictive

__all__ = [
    "Uncertainty",
    "decompose_moments",
    "decompose_probabilities",
    "draws_uncertainty",
    "linearized_uncertainty",
]


class Uncertainty(NamedTuple):
    """Per-point total, aleatoric and epistemic uncertainty; ``total == aleatoric + epistemic``.

    ``measure`` is ``"entropy"`` (classification, nats; the epistemic part is the mutual information) or
    ``"variance"`` (regression, the law of total variance, per output).
    """

    total: Tensor
    aleatoric: Tensor
    epistemic: Tensor
    measure: Literal["entropy", "variance"]


def decompose_probabilities(probs: Tensor) -> Uncertainty:
    r"""Split the entropy of the mixture of ``probs`` ``(S, ..., classes)`` (one law per draw, equal weights).

    Example:
        >>> import torch
        >>> probs = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # two confident draws that disagree
        >>> u = decompose_probabilities(probs)
        >>> round(u.total.item(), 4), round(u.aleatoric.item(), 4), round(u.epistemic.item(), 4)  # log 2 = 0.6931
        (0.6931, 0.0, 0.6931)

    """
    if not isinstance(probs, Tensor) or probs.dim() < 2:
        raise ValueError("probs must be a tensor (draws, ..., classes).")
    aleatoric = torch.special.entr(probs).sum(-1).mean(0)
    # E KL(p_s || mean): 0 log 0 = 0, and mean > 0 wherever some p_s > 0. log mean as a logsumexp: a subnormal p_s
    # (a saturated softmax in float32) would round the mean itself to 0 and make log_ratio infinite
    log_probs = torch.log(probs)
    log_ratio = log_probs - (torch.logsumexp(log_probs, 0) - math.log(probs.shape[0]))
    epistemic = torch.where(probs > 0, probs * log_ratio, 0.0).sum(-1).mean(0).clamp_min(0.0)
    return Uncertainty(aleatoric + epistemic, aleatoric, epistemic, "entropy")


def decompose_moments(means: Tensor, variances: Tensor) -> Uncertainty:
    """The law of total variance of the mixture of laws with ``means`` and ``variances`` ``(S, ...)``, per output."""
    if not isinstance(means, Tensor) or means.dim() < 1:
        raise ValueError("means must be a tensor (draws, ...).")
    aleatoric = torch.broadcast_to(variances, means.shape).mean(0)
    epistemic = means.var(0, correction=0)
    return Uncertainty(aleatoric + epistemic, aleatoric, epistemic, "variance")


def _unwrap(fn: Any) -> Any:
    while isinstance(fn, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
        fn = fn.base_dist
    return fn


def _law(fn: Any) -> tuple[str, Tensor, Tensor | None]:
    """``("probs", probs, None)`` for a classifier's law, ``("moments", mean, variance)`` otherwise."""
    base = _unwrap(fn)
    if isinstance(base, (dist.Categorical, dist.OneHotCategorical)):
        return "probs", base.probs, None
    if isinstance(base, dist.Bernoulli):
        return "probs", torch.stack([1 - base.probs, base.probs], -1), None
    try:
        return "moments", base.mean, base.variance
    except NotImplementedError as error:
        raise ValueError(f"the observed site's {type(base).__name__} has no mean and variance to split.") from error


def _observed_site(trace, samples: Mapping[str, Tensor], site: str | None) -> str:
    names = [
        name
        for name, node in trace.nodes.items()
        if node["type"] == "sample"
        and not site_is_subsample(node)
        and not node["infer"].get("_deterministic")  # pyro.deterministic: a recorded value, not a law
        and name not in samples
    ]
    if site is not None:
        if site not in names:
            raise ValueError(f"site '{site}' is not an observed (unsampled) site of the model; it has {names}.")
        return site
    if len(names) != 1:
        raise ValueError(f"the model has {len(names)} sites not in the draws ({names}): pass site=.")
    return names[0]


def draws_uncertainty(
    model: Callable,
    samples: Mapping[str, Tensor],
    *args: Any,
    site: str | None = None,
    **kwargs: Any,
) -> Uncertainty:
    """The split of the predictive mixture over constrained draws ``samples`` ``{site: (S, ...)}``, at ``args``.

    The model runs on full data (every ``subsample_size`` plate off) once per draw, and the observed ``site``'s law
    (default: the one sample site not in ``samples``) is read, never sampled: Categorical/Bernoulli probabilities
    or a mean and variance. Returns per-point parts shaped like the site (less the classes).
    """
    if not isinstance(samples, Mapping) or not samples:
        raise ValueError("samples must be a non-empty dict of constrained draws {site: (S, *shape)}.")
    count = next(iter(samples.values())).shape[0]
    full = FullDataModel(model)
    laws = []
    with torch.no_grad(), fork_rng(0):  # a latent left out of samples is drawn from its prior, reproducibly
        for index in range(count):
            draw = {name: value[index] for name, value in samples.items()}
            trace = poutine.trace(poutine.condition(full, draw)).get_trace(*args, **kwargs)
            if index == 0:
                site = _observed_site(trace, samples, site)
            laws.append(_law(trace.nodes[site]["fn"]))
            if index == 0:
                _check_memory(laws[0], count)
    if laws[0][0] == "probs":
        return decompose_probabilities(torch.stack([law[1] for law in laws]))
    means = torch.stack([law[1] for law in laws])
    return decompose_moments(means, torch.stack([torch.broadcast_to(law[2], law[1].shape) for law in laws]))


def _check_memory(law: tuple, count: int) -> None:
    """Refuse the laws of ``count`` draws (kept, then stacked: twice) where they would not fit."""
    values = law[1]
    per_draw = sum(torch.broadcast_to(t, values.shape).numel() * t.element_size() for t in law[1:] if t is not None)
    check_memory(
        2 * count * per_draw,
        values.device,
        f"the predictive laws of {count} draws ({values.numel():,} values each)",
        lambda factor: [
            f"fewer draws: draws_uncertainty(model, result.get_samples(num_samples={max(1, count // factor)}), "
            f"*inputs), or num_samples={max(1, count // factor)} for a Gaussian posterior",
            f"fewer points: the inputs of a subset (1/{factor} of them fits)",
        ],
    )


def linearized_uncertainty(prediction: GLMPredictive, num_samples: int = 1000, seed: int | None = None) -> Uncertainty:
    r"""The split of a linearised predictive :math:`f \sim \mathcal N(m, V)` (what ``predict(...)`` returns).

    Closed form for a Normal likelihood; ``num_samples`` draws of :math:`f` for a Categorical or Bernoulli one.
    """
    check_count("num_samples", num_samples)
    check_seed("seed", seed)
    mean, covariance, fn = prediction.mean, prediction.covariance, _unwrap(prediction.distribution)
    variance = covariance.diagonal(dim1=-2, dim2=-1)
    if isinstance(fn, dist.Normal):
        width = fn.loc.numel() // max(1, mean.shape[0])
        epistemic = variance[..., :width].reshape(fn.loc.shape)
        total = torch.broadcast_to(fn.variance, fn.loc.shape)
        aleatoric = (total - epistemic).clamp_min(0.0)
        return Uncertainty(aleatoric + epistemic, aleatoric, epistemic, "variance")
    if not isinstance(fn, (dist.Categorical, dist.Bernoulli)):
        raise ValueError(
            f"linearized_uncertainty splits a Normal, Categorical or Bernoulli predictive, not {type(fn).__name__}: "
            "use the draws' uncertainty (linearized=False) instead."
        )
    generator = torch.Generator(mean.device)
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ())))
    # a symmetric root, not Cholesky: a covariance from K draws (sample-then-optimise) has rank K, often singular
    values, vectors = torch.linalg.eigh(covariance)
    root = vectors * values.clamp_min(0.0).sqrt().unsqueeze(-2)
    noise = torch.randn((num_samples, *mean.shape), generator=generator, dtype=mean.dtype, device=mean.device)
    f = mean + torch.einsum("nij,snj->sni", root, noise)  # (S, points, outputs)
    if isinstance(fn, dist.Bernoulli):
        p = torch.sigmoid(f).reshape((num_samples, *fn.probs.shape))
        return decompose_probabilities(torch.stack([1 - p, p], -1))
    classes = fn.probs.shape[-1]
    probs = torch.softmax(f.reshape(f.shape[:-1] + (-1, classes)), -1)
    return decompose_probabilities(probs.reshape((num_samples, *fn.probs.shape)))
