r"""A Gaussian posterior as the joint prior of a Pyro model's latent sites: ``posterior.as_prior(model)``.

A Gaussian over the flat unconstrained vector :math:`u = (u_1, \dots, u_S)` of the sites :math:`1..S` (in the order
the model samples them) is written as the chain of its conditionals,

.. math::

    \mathcal N(u;\ \mu, \Sigma) = \prod_s p(u_s \mid u_{<s}),

and site :math:`s` of the model gets :math:`p(u_s\mid u_{<s})`, pushed through the site's bijection to its support
(the log-density subtracts :math:`\log|\det J|`, so an engine that works in unconstrained space sees the Gaussian
itself). Drawing the sites in turn draws the joint; the sum of the sites' log-densities is the joint's. Every engine
that reads the model's log-density (SG-MCMC, SWAG, Pyro's NUTS) therefore reads the posterior as the prior, with
its correlations. The conditionals never form a ``d x d`` matrix for the structured forms:

* **diagonal** :math:`\Sigma = \mathrm{diag}(v)`: independent Normals (Pyro's own, so the Laplace and
  sample-then-optimise engines read them as their usual diagonal prior — the EWC update).
* **dense** :math:`\Sigma = LL^\top`: with :math:`z_{<s} = L_{<s,<s}^{-1}(u_{<s}-\mu_{<s})`,
  :math:`u_s \mid u_{<s} \sim \mathcal N(\mu_s + L_{s,<s} z_{<s},\ L_{ss}L_{ss}^\top)`.
* **low-rank covariance** :math:`\Sigma = D + UU^\top` (SWAG; rank :math:`k`): with
  :math:`C_s = I + \sum_{t<s} U_t^\top D_t^{-1} U_t` and :math:`r_s = \sum_{t<s} U_t^\top D_t^{-1}\delta_t`
  (:math:`\delta = u - \mu`), Woodbury gives
  :math:`u_s \mid u_{<s} \sim \mathcal N(\mu_s + U_s C_s^{-1} r_s,\ D_s + U_s C_s^{-1} U_s^\top)`, again rank k.
* **low-rank precision** :math:`\Lambda = P + VV^\top` (the Laplace ``low_rank`` structure): integrating out the
  later sites leaves the precision :math:`P + V M_s V^\top` on :math:`u_{\le s}`, with
  :math:`M_s = (I + \sum_{t>s} V_t^\top P_t^{-1} V_t)^{-1}`, so
  :math:`u_s \mid u_{<s}` has precision :math:`\Lambda_s = P_s + V_s M_s V_s^\top` and mean
  :math:`\mu_s - \Lambda_s^{-1} V_s M_s \sum_{t<s} V_t^\top \delta_t`.

A site inside a (non-subsampled) plate keeps the plate as its batch shape; its joint log-density is spread evenly
over the plate's elements, so the model's total is exact (a plate claims independence the prior no longer has:
do not subsample such a plate, and do not enumerate it).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.poutine.messenger import Messenger
from torch import Tensor
from torch.distributions import biject_to, constraints
from torch.distributions.transforms import IndependentTransform, Transform

from pyro_scalable.bridge.checks import ModelError

__all__ = ["GaussianPriorModel", "JointGaussian", "SiteGaussian", "SiteSpec"]

_LOG_2PI = math.log(2 * math.pi)
_SCALAR = torch.Size()


@dataclass(frozen=True)
class SiteSpec:
    """One latent site of the joint prior: its name, constrained and unconstrained shapes, and its support."""

    name: str
    shape: torch.Size
    unconstrained_shape: torch.Size
    support: Any

    @property
    def size(self) -> int:
        return self.unconstrained_shape.numel()

    @property
    def transform(self) -> Transform:
        return biject_to(self.support)

    @property
    def has_jacobian(self) -> bool:
        support = self.support
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        return support is not constraints.real


# ---------------------------------------------------------------------------- flat conditionals
def _mv(matrix: Tensor, vector: Tensor) -> Tensor:
    return (matrix @ vector.unsqueeze(-1)).squeeze(-1)


class _Flat:
    """A Gaussian over a flat vector, ``loc`` possibly batched; ``log_prob`` and ``rsample`` only."""

    loc: Tensor

    def rsample(self, shape: torch.Size) -> Tensor:
        raise NotImplementedError

    def log_prob(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def noise(self, shape: torch.Size, size: int) -> Tensor:
        return torch.randn(
            tuple(shape) + tuple(self.loc.shape[:-1]) + (size,), dtype=self.loc.dtype, device=self.loc.device
        )


class _Tril(_Flat):
    def __init__(self, loc: Tensor, scale_tril: Tensor):
        self.loc, self.scale_tril = loc, scale_tril

    def rsample(self, shape):
        return self.loc + _mv(self.scale_tril, self.noise(shape, self.loc.shape[-1]))

    def log_prob(self, x):
        diff = (x - self.loc).unsqueeze(-1)
        z = torch.linalg.solve_triangular(self.scale_tril, diff, upper=False).squeeze(-1)
        n = x.shape[-1]
        return -0.5 * z.square().sum(-1) - self.scale_tril.diagonal().log().sum() - 0.5 * n * _LOG_2PI


class _LowRankCovariance(_Flat):
    r""":math:`\mathcal N(\text{loc}, \mathrm{diag}(D) + FF^\top)`."""

    def __init__(self, loc: Tensor, diag: Tensor, factor: Tensor):
        self.loc, self.diag, self.factor = loc, diag, factor
        scaled = factor / diag.unsqueeze(-1)
        capacitance = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device) + factor.mT @ scaled
        self.scaled, self.cholesky = scaled, torch.linalg.cholesky(capacitance)

    def rsample(self, shape):
        n, k = self.factor.shape
        return self.loc + self.diag.sqrt() * self.noise(shape, n) + _mv(self.factor, self.noise(shape, k))

    def log_prob(self, x):
        diff = x - self.loc
        projected = (diff.unsqueeze(-2) @ self.scaled).squeeze(-2)
        whitened = torch.linalg.solve_triangular(self.cholesky, projected.unsqueeze(-1), upper=False).squeeze(-1)
        maha = (diff.square() / self.diag).sum(-1) - whitened.square().sum(-1)
        logdet = self.diag.log().sum() + 2 * self.cholesky.diagonal().log().sum()
        return -0.5 * (maha + logdet + x.shape[-1] * _LOG_2PI)


class _LowRankPrecision(_Flat):
    r""":math:`\mathcal N(\text{loc}, (\mathrm{diag}(P) + VV^\top)^{-1})`."""

    def __init__(self, loc: Tensor, precision: Tensor, factor: Tensor):
        self.loc, self.precision, self.factor = loc, precision, factor
        capacitance = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
        capacitance = capacitance + factor.mT @ (factor / precision.unsqueeze(-1))
        self.cholesky = torch.linalg.cholesky(capacitance)

    def solve(self, y: Tensor) -> Tensor:
        r""":math:`\Lambda^{-1} y` by Woodbury."""
        scaled = y / self.precision
        inner = torch.cholesky_solve((scaled.unsqueeze(-2) @ self.factor).mT, self.cholesky).mT.squeeze(-2)
        return scaled - _mv(self.factor, inner) / self.precision

    def rsample(self, shape):
        n, k = self.factor.shape
        # P^{1/2} e1 + V e2 has covariance Λ, so Λ^{-1} of it has covariance Λ^{-1}
        root = self.precision.sqrt() * self.noise(shape, n) + _mv(self.factor, self.noise(shape, k))
        return self.loc + self.solve(root)

    def log_prob(self, x):
        diff = x - self.loc
        maha = (self.precision * diff.square()).sum(-1) + (diff.unsqueeze(-2) @ self.factor).squeeze(-2).square().sum(
            -1
        )
        logdet = self.precision.log().sum() + 2 * self.cholesky.diagonal().log().sum()
        return -0.5 * (maha - logdet + x.shape[-1] * _LOG_2PI)


# ---------------------------------------------------------------------------- the joint forms
class JointGaussian:
    r"""A Gaussian over the flat unconstrained sites, in the model's order, as a chain of per-site conditionals.

    Build one with :meth:`diagonal`, :meth:`dense`, :meth:`low_rank_covariance` or :meth:`low_rank_precision`.
    ``conditional(s, state)`` is the flat conditional of site ``s`` given the deviations the ``state`` holds;
    ``update(s, state, delta)`` adds site ``s``'s deviation :math:`\delta_s = u_s - \mu_s`.
    """

    kind: str

    def __init__(self, sites: list[SiteSpec], mean: Tensor):
        self.sites, self.mean = list(sites), mean.detach()
        self.index = {site.name: i for i, site in enumerate(self.sites)}
        starts = [0]
        for site in self.sites:
            starts.append(starts[-1] + site.size)
        if starts[-1] != mean.shape[-1]:
            raise ValueError(f"the sites hold {starts[-1]} numbers, the mean {mean.shape[-1]}.")
        self.slices = [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]

    @property
    def num_params(self) -> int:
        return self.mean.shape[-1]

    # each form fills these
    def start(self) -> Any:
        return None

    def conditional(self, s: int, state: Any) -> _Flat | None:
        raise NotImplementedError

    def update(self, s: int, state: Any, delta: Tensor) -> Any:
        return state

    def covariance_matrix(self) -> Tensor:
        """The dense ``d x d`` covariance (for tests and small models)."""
        raise NotImplementedError

    def precision_matrix(self) -> Tensor:
        """The dense ``d x d`` precision (read by the ``full`` Laplace structure)."""
        return torch.cholesky_inverse(torch.linalg.cholesky(self.covariance_matrix().double())).to(self.mean.dtype)

    def precision_diagonal(self) -> Tensor:
        """The diagonal of the precision: one over each coordinate's variance given all the others."""
        raise NotImplementedError

    @staticmethod
    def diagonal(sites, mean: Tensor, variance: Tensor) -> JointGaussian:
        return _Diagonal(sites, mean, variance)

    @staticmethod
    def dense(sites, mean: Tensor, covariance: Tensor) -> JointGaussian:
        return _Dense(sites, mean, covariance)

    @staticmethod
    def low_rank_covariance(sites, mean: Tensor, diag: Tensor, factor: Tensor) -> JointGaussian:
        return _LowRankCovarianceJoint(sites, mean, diag, factor)

    @staticmethod
    def low_rank_precision(sites, mean: Tensor, precision: Tensor, factor: Tensor) -> JointGaussian:
        return _LowRankPrecisionJoint(sites, mean, precision, factor)


class _Diagonal(JointGaussian):
    kind = "diagonal"

    def __init__(self, sites, mean, variance):
        super().__init__(sites, mean)
        self.scale = variance.detach().sqrt()

    def covariance_matrix(self):
        return torch.diag(self.scale.square())

    def precision_matrix(self):
        return torch.diag(self.scale.pow(-2))

    def precision_diagonal(self):
        return self.scale.pow(-2)


def _concatenate(parts: list[Tensor]) -> Tensor:
    """Flat pieces with (possibly different) leading batch dimensions, joined along the last."""
    batch = torch.broadcast_shapes(*(p.shape[:-1] for p in parts))
    return torch.cat([p.expand(batch + p.shape[-1:]) for p in parts], -1)


class _Dense(JointGaussian):
    kind = "dense"

    def __init__(self, sites, mean, covariance):
        super().__init__(sites, mean)
        covariance = covariance.detach()
        self.covariance = covariance
        tril = torch.linalg.cholesky(covariance.double()).to(covariance.dtype)
        # per site, contiguous: a strided slice would be copied by every triangular solve
        self.blocks = [(tril[rows, rows].contiguous(), tril[rows, : rows.start].contiguous()) for rows in self.slices]

    def start(self):
        return []

    def conditional(self, s, state):
        block, before = self.blocks[s]
        loc = self.mean[self.slices[s]]
        if state:
            loc = loc + _mv(before, _concatenate(state))
        return _Tril(loc, block)

    def update(self, s, state, delta):
        block, before = self.blocks[s]
        rest = delta - _mv(before, _concatenate(state)) if state else delta
        z = torch.linalg.solve_triangular(block, rest.unsqueeze(-1), upper=False).squeeze(-1)
        return [*state, z]

    def covariance_matrix(self):
        return self.covariance

    def precision_diagonal(self):
        return torch.linalg.inv(self.covariance.double()).diagonal().to(self.mean.dtype)


class _LowRankCovarianceJoint(JointGaussian):
    kind = "low_rank_covariance"

    def __init__(self, sites, mean, diag, factor):
        super().__init__(sites, mean)
        self.diag, self.factor = diag.detach(), factor.detach()
        k = self.factor.shape[-1]
        capacitance = torch.eye(k, dtype=self.factor.dtype, device=self.factor.device)
        self.factors = []  # per site: U_s W_s with W_s W_s^T = C_s^{-1}, and C_s^{-1}
        for rows in self.slices:
            inverse = torch.cholesky_inverse(torch.linalg.cholesky(capacitance))
            root = torch.linalg.cholesky(0.5 * (inverse + inverse.mT))
            self.factors.append((self.factor[rows] @ root, inverse))
            u = self.factor[rows]
            capacitance = capacitance + u.mT @ (u / self.diag[rows].unsqueeze(-1))

    def start(self):
        return None

    def conditional(self, s, state):
        rows = self.slices[s]
        factor, inverse = self.factors[s]
        loc = self.mean[rows]
        if state is not None:
            loc = loc + _mv(self.factor[rows] @ inverse, state)
        return _LowRankCovariance(loc, self.diag[rows], factor)

    def update(self, s, state, delta):
        rows = self.slices[s]
        r = _mv((self.factor[rows] / self.diag[rows].unsqueeze(-1)).mT, delta)
        return r if state is None else state + r

    def covariance_matrix(self):
        return torch.diag(self.diag) + self.factor @ self.factor.mT

    def precision_diagonal(self):
        # Woodbury: (D + UU^T)^{-1} = D^{-1} - D^{-1} U C^{-1} U^T D^{-1}, C = I + U^T D^{-1} U
        scaled = self.factor / self.diag.unsqueeze(-1)
        capacitance = torch.eye(scaled.shape[-1], dtype=scaled.dtype, device=scaled.device) + self.factor.mT @ scaled
        whitened = torch.linalg.solve_triangular(torch.linalg.cholesky(capacitance), scaled.mT, upper=False)
        return self.diag.reciprocal() - whitened.square().sum(0)


class _LowRankPrecisionJoint(JointGaussian):
    kind = "low_rank_precision"

    def __init__(self, sites, mean, precision, factor):
        super().__init__(sites, mean)
        self.precision, self.factor = precision.detach(), factor.detach()
        k = self.factor.shape[-1]
        later = torch.eye(k, dtype=self.factor.dtype, device=self.factor.device)
        self.factors: list[tuple[Tensor, Tensor]] = [None] * len(self.slices)  # type: ignore[list-item]
        for s in reversed(range(len(self.slices))):  # M_s = (I + sum_{t>s} V_t^T P_t^{-1} V_t)^{-1}
            rows = self.slices[s]
            m = torch.cholesky_inverse(torch.linalg.cholesky(later))
            m = 0.5 * (m + m.mT)
            self.factors[s] = (self.factor[rows] @ torch.linalg.cholesky(m), self.factor[rows] @ m)
            v = self.factor[rows]
            later = later + v.mT @ (v / self.precision[rows].unsqueeze(-1))

    def conditional(self, s, state):
        rows = self.slices[s]
        root, vm = self.factors[s]
        flat = _LowRankPrecision(self.mean[rows], self.precision[rows], root)
        if state is not None:
            flat.loc = self.mean[rows] - flat.solve(_mv(vm, state))
        return flat

    def update(self, s, state, delta):
        r = _mv(self.factor[self.slices[s]].mT, delta)
        return r if state is None else state + r

    def precision_matrix(self):
        return torch.diag(self.precision) + self.factor @ self.factor.mT

    def precision_diagonal(self):
        return self.precision + self.factor.square().sum(-1)

    def covariance_matrix(self):
        precision = self.precision_matrix().double()
        return torch.cholesky_inverse(torch.linalg.cholesky(precision)).to(self.mean.dtype)


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


def prior_variances(bridge, names: list[str], latents: dict[str, Tensor]) -> Tensor:
    """Per flat coordinate of ``names``, the inverse curvature of the model's own prior at unconstrained ``latents``.

    The diagonal of :math:`-\\nabla^2\\log p(u)` (with the Jacobian of the site's bijection), from one
    Hessian-vector product with a vector of ones per site, which is the diagonal for a factorised prior; ``inf``
    where the curvature is not positive (a flat or improper prior). The priors are read in one trace of the model
    at ``latents`` on one data point.
    """
    import pyro  # noqa: PLC0415  (the module is imported by pyro-facing code only)

    values = bridge.constrain({k: v.detach() for k, v in latents.items()})
    indices = {plate.name: torch.arange(1, device=bridge.device) for plate in bridge.plates.values()}
    with pyro.poutine.condition(data=values):
        trace = bridge.trace_at(indices)
    parts = []
    for name in names:
        fn, site = trace.nodes[name]["fn"], bridge.sites[name]
        point = latents[name].detach()
        if isinstance(fn, SiteGaussian):  # a correlated prior: each coordinate's variance given the others
            parts.append(fn.joint.precision_diagonal()[fn.joint.slices[fn.joint.index[name]]].reciprocal())
            continue

        def log_density(u, fn=fn, site=site):
            constrained = site.transform(u)
            log_prob = fn.log_prob(constrained).sum()
            if site.has_jacobian:
                log_prob = log_prob + site.transform.log_abs_det_jacobian(u, constrained).sum()
            return log_prob

        _, curvature = torch.func.jvp(torch.func.grad(log_density), (point,), (torch.ones_like(point),))
        precision = -curvature.flatten()
        parts.append(torch.where(precision > 0, precision.reciprocal(), torch.full_like(precision, math.inf)))
    return torch.cat(parts)


def site_specs(bridge, names: list[str]) -> list[SiteSpec]:
    """The :class:`SiteSpec` of each named latent site of a bridged model, in the given order."""
    return [
        SiteSpec(name, bridge.sites[name].shape, bridge.sites[name].unconstrained_shape, bridge.support(name))
        for name in names
    ]
