"""The model side of ``as_prior``: each site's conditional as a Pyro distribution, and the model that uses them."""

from __future__ import annotations

import copy
import math
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.poutine.messenger import Messenger
from torch import Tensor
from torch.distributions import constraints
from torch.distributions.transforms import IndependentTransform, Transform

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer.autodiff import hvp
from pyro_scalable.infer.gaussian_prior.joint import JointGaussian, SiteSpec, _Flat, _Tril

__all__ = ["GaussianPriorModel", "SiteGaussian", "prior_mode", "prior_variances", "site_specs"]

_SCALAR = torch.Size()


# ---------------------------------------------------------------------------- the site distribution
def _elementwise(transform: Transform) -> Transform | None:
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return transform if transform.domain.event_dim == 0 and transform.codomain.event_dim == 0 else None


class SiteGaussian(TorchDistribution):
    r"""One site's conditional :math:`p(u_s\mid u_{<s})`, pushed to the site's support.

    ``joint`` and ``name`` say which joint prior it belongs to (the Laplace engine reads the joint from them).
    """

    arg_constraints: dict = {}
    has_rsample = True

    def __init__(
        self, flat: _Flat, spec: SiteSpec, joint: JointGaussian, plate_shape: torch.Size = _SCALAR, extra=_SCALAR
    ):
        self.flat, self.spec, self.joint, self.name = flat, spec, joint, spec.name
        self.plate_shape = torch.Size(plate_shape)
        event_shape = spec.shape[len(plate_shape) :]
        super().__init__(batch_shape=torch.Size(extra) + self.plate_shape, event_shape=event_shape, validate_args=False)

    @constraints.dependent_property
    def support(self):
        return self.spec.support

    def expand(self, batch_shape, _instance=None):
        """Independent copies along new leading dimensions (e.g. ``Predictive(..., parallel=True)``)."""
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        plate = self.plate_shape
        if len(batch_shape) < len(plate) or batch_shape[len(batch_shape) - len(plate) :] != plate:
            raise ModelError(
                f"latent site '{self.name}' has a correlated prior (as_prior) over its whole value; it cannot be "
                f"broadcast to the batch shape {tuple(batch_shape)}. Sample it outside that plate."
            )
        extra = batch_shape[: len(batch_shape) - len(plate)]
        flat = copy.copy(self.flat)
        flat.loc = self.flat.loc.expand(torch.broadcast_shapes(extra + self.flat.loc.shape[-1:], self.flat.loc.shape))
        return SiteGaussian(flat, self.spec, self.joint, plate, extra)

    def rsample(self, sample_shape=_SCALAR):
        flat = self.flat.rsample(torch.Size(sample_shape))
        u = flat.reshape(flat.shape[:-1] + self.spec.unconstrained_shape)
        return self.spec.transform(u)

    def log_prob(self, value: Tensor) -> Tensor:
        transform = self.spec.transform
        u = transform.inv(value)
        outer = u.shape[: u.dim() - len(self.spec.unconstrained_shape)]
        log_prob = self.flat.log_prob(u.reshape(outer + (-1,)))
        if self.spec.has_jacobian:
            jacobian = transform.log_abs_det_jacobian(u, value)
            log_prob = log_prob - jacobian.reshape(outer + (-1,)).sum(-1)
        if self.plate_shape:  # a site inside a plate: its joint log-density spread over the plate's elements
            log_prob = (log_prob / self.plate_shape.numel()).reshape(outer + (1,) * len(self.plate_shape))
            log_prob = log_prob.expand(outer + self.plate_shape)
        return log_prob


def _site_distribution(joint: JointGaussian, s: int, state: Any, batch_shape: torch.Size):
    spec = joint.sites[s]
    if joint.kind == "diagonal":  # Pyro's own distributions: the Laplace and STO engines read them as usual
        rows = joint.slices[s]
        loc = joint.mean[rows].reshape(spec.unconstrained_shape)
        scale = joint.scale[rows].reshape(spec.unconstrained_shape)
        base = dist.Normal(loc, scale)
        if not spec.has_jacobian:
            return base.to_event(len(spec.shape) - len(batch_shape))
        elementwise = _elementwise(spec.transform)
        if elementwise is not None and spec.shape == spec.unconstrained_shape:
            return dist.TransformedDistribution(base, elementwise).to_event(len(spec.shape) - len(batch_shape))
        flat = _Tril(joint.mean[rows], torch.diag(joint.scale[rows]))
        return SiteGaussian(flat, spec, joint, batch_shape)
    return SiteGaussian(joint.conditional(s, state), spec, joint, batch_shape)


class _JointPriorMessenger(Messenger):
    """Replaces the priors of the joint's sites by their conditionals, in the order the model samples them."""

    def __init__(self, joint: JointGaussian):
        super().__init__()
        self.joint = joint
        self.state = joint.start()
        self.next = 0
        self.pending = None

    def _pyro_sample(self, msg):
        s = self.joint.index.get(msg["name"])
        if s is None or msg["is_observed"]:
            return
        spec = self.joint.sites[s]
        if s != self.next:
            expected = self.joint.sites[self.next].name if self.next < len(self.joint.sites) else "none"
            raise ModelError(
                f"latent site '{msg['name']}' came in the model before '{expected}': the prior from the posterior "
                "follows the order the model sampled its sites in when the posterior was fitted. Keep that order."
            )
        fn = msg["fn"]
        shape = torch.Size(fn.batch_shape + fn.event_shape)
        if shape != spec.shape:
            raise ModelError(
                f"latent site '{msg['name']}' has shape {tuple(shape)} here and {tuple(spec.shape)} in the posterior "
                "used as its prior: the next episode's model must have the same latent sites."
            )
        msg["fn"] = _site_distribution(self.joint, s, self.state, fn.batch_shape)
        self.pending = msg["name"]

    def _pyro_post_sample(self, msg):
        # by name: an outer condition() may have marked the site observed since, and a plate expanded its fn
        s = self.joint.index.get(msg["name"])
        if s is None or msg["name"] != self.pending:
            return
        self.pending = None
        spec = self.joint.sites[s]
        u = spec.transform.inv(msg["value"])
        u = u.reshape(u.shape[: u.dim() - len(spec.unconstrained_shape)] + (-1,))
        if self.joint.kind != "diagonal":
            self.state = self.joint.update(s, self.state, u - self.joint.mean[self.joint.slices[s]])
        self.next += 1


class GaussianPriorModel:
    """``model`` with a Gaussian (a previous episode's posterior) as the joint prior of its latent sites.

    Call it like the model. Latent sites outside the Gaussian keep the model's own priors. ``joint`` is the prior
    (a :class:`JointGaussian` over the flat unconstrained sites).
    """

    def __init__(self, model, joint: JointGaussian):
        if not callable(model):
            raise TypeError(f"model must be a callable Pyro model, got {type(model).__name__}.")
        self.model, self.joint = model, joint
        self.__name__ = getattr(model, "__name__", type(model).__name__)

    def __call__(self, *args, **kwargs):
        with _JointPriorMessenger(self.joint):
            return self.model(*args, **kwargs)

    def __repr__(self) -> str:
        return f"GaussianPriorModel({self.__name__}, {self.joint.kind}, sites={[s.name for s in self.joint.sites]})"


def _prior_densities(bridge, names: list[str], latents: dict[str, Tensor]) -> dict[str, Any]:
    """Each named site's prior at ``latents``: a ``SiteGaussian`` (a correlated prior), or its log-density in u."""
    values = bridge.constrain({k: v.detach() for k, v in latents.items()})
    indices = {plate.name: torch.arange(1, device=bridge.device) for plate in bridge.plates.values()}
    with pyro.poutine.condition(data=values):
        trace = bridge.trace_at(indices)
    out: dict[str, Any] = {}
    for name in names:
        fn, site = trace.nodes[name]["fn"], bridge.sites[name]
        if isinstance(fn, SiteGaussian):
            out[name] = fn
            continue

        def log_density(u, fn=fn, site=site):
            constrained = site.transform(u)
            log_prob = fn.log_prob(constrained).sum()
            if site.has_jacobian:
                log_prob = log_prob + site.transform.log_abs_det_jacobian(u, constrained).sum()
            return log_prob

        out[name] = log_density
    return out


def prior_variances(bridge, names: list[str], latents: dict[str, Tensor]) -> Tensor:
    r"""Per flat coordinate of ``names``, the inverse curvature of the model's own prior at unconstrained ``latents``.

    The diagonal of :math:`-\nabla^2\log p(u)` (with the Jacobian of the site's bijection), from one
    Hessian-vector product with a vector of ones per site, which is the diagonal for a factorised prior; ``inf``
    where the curvature is not positive (a flat or improper prior). The priors are read in one trace of the model
    at ``latents`` on one data point.
    """
    parts = []
    for name, density in _prior_densities(bridge, names, latents).items():
        if isinstance(density, SiteGaussian):  # a correlated prior: each coordinate's variance given the others
            parts.append(
                density.joint.precision_diagonal()[density.joint.slices[density.joint.index[name]]].reciprocal()
            )
            continue
        point = latents[name].detach()
        (curvature,) = hvp(density, (point,), (torch.ones_like(point),))
        precision = -curvature.flatten()
        parts.append(torch.where(precision > 0, precision.reciprocal(), torch.full_like(precision, math.inf)))
    return torch.cat(parts)


def prior_mode(bridge, names: list[str], latents: dict[str, Tensor], steps: int = 50) -> dict[str, Tensor]:
    r"""The mode of each named site's prior in unconstrained space, by diagonal Newton steps from ``latents``.

    One step lands on the mean of a Normal prior (to rounding); a scale's log-space prior takes a few. A correlated
    prior (``as_prior``) gives its joint mean. Returns unconstrained values by site name.
    """
    out = {}
    for name, density in _prior_densities(bridge, names, latents).items():
        if isinstance(density, SiteGaussian):
            joint = density.joint
            out[name] = joint.mean[joint.slices[joint.index[name]]].reshape(bridge.sites[name].unconstrained_shape)
            continue
        point = latents[name].detach()
        for _ in range(steps):
            gradient, curvature = torch.func.grad(density)(point), hvp(density, (point,), (torch.ones_like(point),))[0]
            if not bool((curvature < 0).all()):
                raise ModelError(
                    f"the prior of latent site '{name}' has no positive curvature at {point.flatten()[:4].tolist()}... "
                    "(a flat or improper prior); give it a proper prior."
                )
            step = -gradient / curvature
            point = (point + step).detach()
            if bool((step.abs() <= 1e-12 * (1 + point.abs())).all()):
                break
        out[name] = point
    return out


def site_specs(bridge, names: list[str]) -> list[SiteSpec]:
    """The :class:`SiteSpec` of each named latent site of a bridged model, in the given order."""
    return [
        SiteSpec(name, bridge.sites[name].shape, bridge.sites[name].unconstrained_shape, bridge.support(name))
        for name in names
    ]
