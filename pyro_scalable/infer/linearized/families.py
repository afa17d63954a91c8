r"""The likelihood families a linearised engine knows, and the one that fits an observed site (:func:`likelihood_of`).

One class per family (the table in :mod:`.likelihoods`, whose :class:`~.likelihoods.Likelihood` each subclasses):
its output :math:`f`, the square root of its curvature :math:`\Lambda`, its gradient and its linearised predictive;
``_FAMILIES`` maps a Pyro distribution to its class. A new family is one class here and one line in ``_FAMILIES``.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer.linearized.likelihoods import Likelihood

__all__ = ["likelihood_of"]


class _Normal(Likelihood):
    name = "Normal"

    def __init__(self, site, fn, mask, heteroscedastic: bool):
        super().__init__(site, fn, mask)
        self.heteroscedastic = heteroscedastic
        self.scale = torch.broadcast_to(self.base.scale, self.shape)

    def with_noise(self, noise: Tensor) -> _Normal:
        """The same site with a homoscedastic scale ``noise`` (as fitted by the evidence)."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.scale = torch.broadcast_to(noise.to(self.scale), self.shape)
        return copy

    def outputs(self) -> Tensor:
        loc = self.flatten(torch.broadcast_to(self.base.loc, self.shape))
        if self.heteroscedastic:
            return torch.cat([loc, self.flatten(self.scale).log()], dim=-1)
        return loc

    @property
    def width(self) -> int:
        return self.shape.numel() // self.num_points

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        if self.heteroscedastic:
            diagonal = torch.cat([(-f[..., self.width :]).exp(), torch.full_like(f[..., self.width :], 2**0.5)], -1)
        else:
            diagonal = self.flatten(self.scale).reciprocal().expand_as(f)
        return torch.diag_embed(diagonal)

    def weight_outputs(self, f: Tensor) -> Tensor:
        """The weights of the mean outputs, repeated for the log-scale outputs when the scale is heteroscedastic."""
        keep = super().weight_outputs(f[..., : self.width])
        return torch.cat([keep, keep], -1) if self.heteroscedastic else keep

    def _split(self, f: Tensor) -> tuple[Tensor, Tensor]:
        if self.heteroscedastic:
            return self._unflatten(f[..., : self.width]), self._unflatten(f[..., self.width :]).exp()
        return self._unflatten(f), self.scale

    def _base(self, f: Tensor):
        return dist.Normal(*self._split(f))

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        variance = covariance.diagonal(dim1=-2, dim2=-1)
        if not self.heteroscedastic:
            loc, noise = self._unflatten(mean), self.scale
            return self._wrap(dist.Normal(loc, (self._unflatten(variance) + noise**2).sqrt()))
        # y = loc + exp(s) eps: E[y] = E[loc], Var[y] = Var[loc] + E[exp(2 s)] (a log-normal moment)
        width = self.width
        loc = self._unflatten(mean[..., :width])
        noise_var = (2 * mean[..., width:] + 2 * variance[..., width:]).exp()
        return self._wrap(dist.Normal(loc, self._unflatten(variance[..., :width] + noise_var).sqrt()))


class _Bernoulli(Likelihood):
    name = "Bernoulli"
    classification = True

    def outputs(self) -> Tensor:
        return self.flatten(torch.broadcast_to(self.base.logits, self.shape))

    def _count(self) -> Tensor | float:
        return 1.0

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        p = torch.sigmoid(f)
        return torch.diag_embed((self._count() * p * (1 - p)).sqrt())

    def _base(self, f: Tensor):
        return dist.Bernoulli(logits=self._unflatten(f))

    def _probs(self, mean, covariance, link_approx, num_samples, generator) -> Tensor:
        variance = covariance.diagonal(dim1=-2, dim2=-1)
        if link_approx == "probit":
            return torch.sigmoid(mean / (1 + math.pi / 8 * variance).sqrt())
        draws = _gaussian_draws(mean, variance.sqrt(), num_samples, generator)
        return torch.sigmoid(draws).mean(0)

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        probs = self._probs(mean, covariance, link_approx, num_samples, generator)
        return self._wrap(dist.Bernoulli(probs=self._unflatten(probs)))


class _Binomial(_Bernoulli):
    name = "Binomial"

    def __init__(self, site, fn, mask):
        super().__init__(site, fn, mask)
        self.total_count = torch.broadcast_to(torch.as_tensor(self.base.total_count), self.shape)

    def _count(self) -> Tensor:
        return self.flatten(self.total_count)

    def _base(self, f: Tensor):
        return dist.Binomial(self.total_count, logits=self._unflatten(f))

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        probs = self._probs(mean, covariance, link_approx, num_samples, generator)
        return self._wrap(dist.Binomial(self.total_count, probs=self._unflatten(probs)))


class _Categorical(Likelihood):
    name = "Categorical"
    classification = True
    _event_dims = 1

    def _output_shape(self, fn) -> torch.Size:
        return fn.batch_shape + fn.logits.shape[-1:]

    @property
    def num_classes(self) -> int:
        return self.shape[-1]

    def outputs(self) -> Tensor:
        logits = self.base.logits if self.raw_logits is None else self.raw_logits
        return self.flatten(torch.broadcast_to(logits, self.shape))

    def _groups(self, f: Tensor) -> Tensor:
        return f.reshape(f.shape[:-1] + (-1, self.num_classes))

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        p = torch.softmax(self._groups(f), -1)
        root_p = p.sqrt()
        blocks = p.unsqueeze(-1) * -root_p.unsqueeze(-2)  # (points, groups, K, K): diag(√p) - p √pᵀ
        blocks.diagonal(dim1=-2, dim2=-1).add_(root_p)
        return blocks.squeeze(-3) if blocks.shape[-3] == 1 else _block_diag(blocks)

    def _base(self, f: Tensor):
        return dist.Categorical(logits=self._unflatten(f))

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        if link_approx == "probit":
            variance = covariance.diagonal(dim1=-2, dim2=-1)
            probs = torch.softmax(self._groups(mean / (1 + math.pi / 8 * variance).sqrt()), -1)
        else:
            draws = _gaussian_draws_full(mean, covariance, num_samples, generator)
            probs = torch.softmax(self._groups(draws), -1).mean(0)
        return self._wrap(dist.Categorical(probs=self._unflatten(probs.flatten(-2))))


class _Poisson(Likelihood):
    name = "Poisson"

    def outputs(self) -> Tensor:
        return self.flatten(torch.broadcast_to(self.base.rate, self.shape)).log()

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        return torch.diag_embed((0.5 * f).exp())

    def _base(self, f: Tensor):
        return dist.Poisson(self._unflatten(f).exp())

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        variance = covariance.diagonal(dim1=-2, dim2=-1)
        if link_approx == "mc":
            rates = _gaussian_draws(mean, variance.sqrt(), num_samples, generator).exp()
            components = dist.Poisson(rates.movedim(0, -1).reshape(self.shape + (num_samples,)))
            mixing = dist.Categorical(logits=rates.new_zeros(self.shape + (num_samples,)))
            return self._wrap(dist.MixtureSameFamily(mixing, components))
        # Poisson-log-normal, moment-matched by a negative binomial: mean mu, variance mu + mu^2 (e^v - 1)
        mu = (mean + variance / 2).exp()
        total_count = 1 / variance.clamp_min(torch.finfo(mean.dtype).tiny).expm1()
        probs = mu / (mu + total_count)
        return self._wrap(dist.NegativeBinomial(self._unflatten(total_count), probs=self._unflatten(probs)))


_FAMILIES = {
    dist.Normal: _Normal,
    dist.Bernoulli: _Bernoulli,
    dist.Binomial: _Binomial,
    dist.Categorical: _Categorical,
    dist.Poisson: _Poisson,
}


def likelihood_of(
    site: str,
    fn,
    mask: Tensor | None = None,
    *,
    heteroscedastic: bool = False,
    raw_logits: Tensor | None = None,
    weight: Tensor | float | None = None,
) -> Likelihood:
    """The family of observed ``site`` whose distribution is ``fn`` (raises a :class:`ModelError` if unknown).

    ``raw_logits`` are a Categorical's logits before normalisation, when known: the GGN does not depend on the
    choice, but the probit approximation does, and the usual convention linearises the network's own logits.
    ``weight``: the site's ``poutine.scale`` weight (a constant or one per point of its batch shape; ``None``: 1).
    """
    likelihood = _family(site, fn, mask, heteroscedastic, raw_logits)
    if weight is not None:
        outer = likelihood.base.batch_shape[: len(likelihood.base.batch_shape) - likelihood.reinterpreted]
        like = likelihood.base.mean  # a tensor of the outputs' dtype and device (a Categorical's is NaN)
        weight = torch.as_tensor(weight, dtype=like.dtype, device=like.device)
        bad = ~torch.isfinite(weight) | (weight < 0)
        if bool(bad.any()):
            raise ModelError(
                f"observed site '{site}' has a poutine.scale weight that is negative or not finite "
                f"({weight[bad].flatten()[0].item() if weight.dim() else weight.item():.3g}); weights must be >= 0."
            )
        likelihood.weight = torch.broadcast_to(weight, outer).detach()
    return likelihood


def _family(site: str, fn, mask: Tensor | None, heteroscedastic: bool, raw_logits: Tensor | None) -> Likelihood:
    base = fn
    while isinstance(base, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
        base = base.base_dist
    for family, cls in _FAMILIES.items():
        if type(base) is family:
            if cls is _Normal:
                return cls(site, fn, mask, heteroscedastic)
            return cls(site, fn, mask, raw_logits) if cls is _Categorical else cls(site, fn, mask)
    known = ", ".join(f.__name__ for f in _FAMILIES)
    raise ModelError(
        f"observed site '{site}' has a {type(base).__name__} likelihood, whose GGN curvature is not known here "
        f"(known: {known}). Write the likelihood with one of these families."
    )


def _block_diag(blocks: Tensor) -> Tensor:
    # (points, groups, K, K) -> (points, groups*K, groups*K)
    points, groups, size, _ = blocks.shape
    out = blocks.new_zeros(points, groups, size, groups, size)
    index = torch.arange(groups, device=blocks.device)
    out[:, index, :, index, :] = blocks.movedim(1, 0)
    return out.reshape(points, groups * size, groups * size)


def _gaussian_draws(mean: Tensor, scale: Tensor, num_samples: int, generator) -> Tensor:
    noise = torch.randn((num_samples,) + mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + scale * noise


def _gaussian_draws_full(mean: Tensor, covariance: Tensor, num_samples: int, generator) -> Tensor:
    eye = torch.eye(covariance.shape[-1], dtype=covariance.dtype, device=covariance.device)
    jitter = 1e-10 * covariance.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[..., None, None]
    root = torch.linalg.cholesky(covariance + jitter * eye)
    noise = torch.randn((num_samples,) + mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + torch.einsum("nij,snj->sni", root, noise)
