r"""A Pyro model seen as a network :math:`f(x, \theta)` around its MAP, for linearised Laplace.

:math:`\theta` is the flat vector of the unconstrained values of the Laplace sites (by default every latent site
that the mean output depends on); every other latent (a Normal's noise scale, the first layers of a last-layer
Laplace) is held at its MAP value. :class:`NetworkFunction` gives

* the outputs :math:`f` and the likelihood family of the observed site, on the full data in chunks along the
  data plate (never on a random minibatch);
* Jacobian-vector and vector-Jacobian products with ``torch.func`` (``jvp``/``vjp``), vectorised over many
  vectors with ``vmap``;
* the prior as a Gaussian :math:`\mathcal N(m, \mathrm{diag}(P)^{-1})` in unconstrained space: exact for Normal
  priors on real-valued sites; otherwise the Gaussian that matches the gradient and the (diagonal) curvature of
  the log prior (with its log-Jacobian) at :math:`\theta_*`, :math:`P = -\mathrm{diag}\,\nabla^2 \log p`,
  :math:`m = \theta_* + P^{-1}\nabla \log p` — exact up to second order for priors that factorise over
  elements.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.func import vjp, vmap

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.minibatches import chunks
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.bridge.outputs import ModelOutputs, model_outputs
from pyro_scalable.infer.autodiff import jvp, row_slices
from pyro_scalable.infer.gaussian_prior import JointGaussian, SiteGaussian
from pyro_scalable.infer.linearized.families import likelihood_of
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.likelihoods import Likelihood

__all__ = ["ROWS_PER_PASS", "NetworkFunction", "Outputs"]

# the most numbers (rows x d) a group of rows takes through the JVP and VJP at once (see batch_ggn_vp)
ROWS_PER_PASS = 2**22


@dataclass
class Outputs:
    """The observed site at one chunk: its family, outputs ``f`` (``points x outputs``), value and layers."""

    likelihood: Likelihood
    f: Tensor
    value: Tensor | None
    raw: ModelOutputs


class NetworkFunction:
    """``theta -> f`` for a Pyro model bound to data, around ``theta`` (the MAP), other latents at ``fixed``."""

    def __init__(
        self,
        bridge: ModelBridge,
        site: str,
        layout: ParameterLayout,
        theta: Tensor,
        fixed: Latents,
        *,
        heteroscedastic: bool = False,
        chunk_size: int | None = None,
    ):
        self.bridge, self.site, self.layout = bridge, site, layout
        self.theta_star = theta.detach()
        self.fixed = {k: v.detach() for k, v in fixed.items()}
        self.heteroscedastic = heteroscedastic
        self.chunk_size = chunk_size
        self.noise: Tensor | None = None  # a homoscedastic Normal's scale in place of the model's (EM sets it)
        self.dual: bool | None = None  # whether the model runs on dual numbers (forward mode); None: not tried yet

    # ------------------------------------------------------------------ forward
    def latents(self, theta: Tensor) -> Latents:
        return {**self.fixed, **self.layout.unflatten(theta)}

    def outputs(self, theta: Tensor, batch: Batch, *, layers: bool = False) -> Outputs:
        return self.outputs_at(self.layout.unflatten(theta), batch, layers=layers)

    def outputs_at(self, values: Latents, batch: Batch, *, layers: bool = False) -> Outputs:
        """:meth:`outputs` at the Laplace sites' values ``{site: value}`` rather than the flat ``theta``."""
        raw = model_outputs(self.bridge, {**self.fixed, **values}, batch, site=self.site, layers=layers)
        likelihood = likelihood_of(
            self.site,
            raw.fn,
            raw.mask,
            heteroscedastic=self.heteroscedastic,
            raw_logits=raw.raw_logits,
            weight=raw.scale,
        )
        if self.noise is not None:
            likelihood = likelihood.with_noise(self.noise)
        return Outputs(likelihood, likelihood.outputs(), raw.value, raw)

    def f(self, theta: Tensor, batch: Batch) -> Tensor:
        return self.outputs(theta, batch).f

    def batches(self, args: tuple | None = None, kwargs: dict | None = None) -> Iterator[Batch]:
        """Chunks of the full data along the first subsampled plate (the training data unless ``args`` given)."""
        args = self.bridge.args if args is None else args
        kwargs = self.bridge.kwargs if kwargs is None else kwargs
        plate = next(iter(self.bridge.plates.values()), None)
        if plate is None:
            yield Batch({}, args, kwargs)
            return
        size = plate.size if args is self.bridge.args else self.plate_size(args, kwargs)
        step = self.chunk_size or max(plate.subsample_size, 1024)
        for idx in chunks(size, step, self.bridge.device):
            yield Batch({plate.name: idx}, args, kwargs)

    def _head(self, args: tuple, kwargs: dict) -> Batch:
        return Batch(
            {p: torch.zeros(1, dtype=torch.long, device=self.bridge.device) for p in self.bridge.plates}, args, kwargs
        )

    def plate_size(self, args: tuple, kwargs: dict) -> int:
        """The data plate's size N when the model runs on ``args`` (runs the model on one data point)."""
        plate = next(iter(self.bridge.plates))
        latents = self.latents(self.theta_star)
        raw = model_outputs(self.bridge, latents, self._head(args, kwargs), site=self.site)
        return raw.plate_sizes[plate]

    # ------------------------------------------------------------------ products
    def jvp(self, theta: Tensor, tangents: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        """``(f, J v)`` for tangents ``(k, d)``: ``J v`` has shape ``(k, points, outputs)``."""

        def single(tangent):
            return jvp(lambda t: self.f(t, batch), (theta,), (tangent,))

        try:
            values, products = vmap(single, randomness="different")(tangents)
            return values[0], products
        except RuntimeError:
            results = [single(t) for t in tangents]
            return results[0][0], torch.stack([r[1] for r in results])

    def vjp(self, theta: Tensor, cotangents: Tensor, batch: Batch, out: Tensor | None = None) -> Tensor:
        """``J^T u`` for cotangents ``(k, points, outputs)``; returns ``(k, d)`` (with ``out``: added to it).

        The rows are pulled back a group at a time (as in :meth:`batch_ggn_vp`), so that the per-site pieces exist
        for one group rather than for all ``k`` rows.
        """
        _, pullback = vjp(lambda values: self.outputs_at(values, batch).f, self.layout.unflatten(theta))
        add = out is not None
        out = theta.new_empty((cotangents.shape[0], self.layout.num_params)) if out is None else out
        for part in row_slices(cotangents.shape[0], self.layout.num_params, ROWS_PER_PASS):
            self._pull(pullback, cotangents[part], out[part], add=add)
        return out

    def batch_ggn_vp(
        self, theta: Tensor, vectors: Tensor, batch: Batch, root: Tensor | None = None, out: Tensor | None = None
    ) -> Tensor:
        r""":math:`\sum_{i\in B} J_i^\top \Lambda_i J_i v` on ``batch``, ``vectors`` ``(k, d)``: batched JVP and VJP.

        The rows go through the JVP and the VJP a group at a time (about :data:`ROWS_PER_PASS` numbers: 4 rows at
        d = 10⁶, all of them at d ≤ 10⁴), so that the tangents of the network's activations and the pullback's
        per-site pieces exist for one group rather than for all ``k`` rows (at the price of one more forward pass
        of the network per group). With ``out``, the products are added to it (a full-data sum in place).
        One vector (a CG iteration) goes through :meth:`_dual_ggn_vp` instead: one forward pass less.
        """
        if vectors.shape[0] == 1 and self.dual is not False:
            try:
                product, self.dual = self._dual_ggn_vp(theta, vectors[0], batch, root).unsqueeze(0), True
            except (RuntimeError, NotImplementedError):  # an operation without a forward-mode formula: as below
                self.dual = False
            else:
                return product if out is None else out.add_(product)

        def forward(values):
            out = self.outputs_at(values, batch)
            return out.f, out.likelihood.hessian_sqrt(out.f.detach()) if root is None else root

        _, pullback, lam_root = vjp(forward, self.layout.unflatten(theta), has_aux=True)
        add = out is not None
        out = theta.new_empty((vectors.shape[0], self.layout.num_params)) if out is None else out
        for part in row_slices(vectors.shape[0], self.layout.num_params, ROWS_PER_PASS):
            _, products = self.jvp(theta, vectors[part], batch)
            weighted = torch.einsum("pmr,pnr,kpn->kpm", lam_root, lam_root, products)
            del products
            self._pull(pullback, weighted, out[part], add=add)
        return out

    def _dual_ggn_vp(self, theta: Tensor, vector: Tensor, batch: Batch, root: Tensor | None) -> Tensor:
        """One vector's product: ``f`` and ``Jv`` from one forward pass at the dual ``theta + εv``, then a backward."""
        leaf = theta.detach().requires_grad_(True)
        with torch.enable_grad():  # the MAP check calls it under no_grad
            with forward_ad.dual_level(), warnings.catch_warnings():  # the backward outside: no tangents of its own
                warnings.simplefilter("ignore", DeprecationWarning)  # torch loads its forward-mode rules by jit once
                out = self.outputs_at(self.layout.unflatten(forward_ad.make_dual(leaf, vector)), batch)
                f, tangent = forward_ad.unpack_dual(out.f)
            root = out.likelihood.hessian_sqrt(f.detach()).detach() if root is None else root
            weighted = torch.einsum("pmr,pnr,pn->pm", root, root, tangent.detach())
            return torch.autograd.grad((f * weighted).sum(), [leaf])[0]  # the inner product: no sympy import

    def _pull(self, pullback, cotangents: Tensor, out: Tensor, add: bool = False) -> Tensor:
        """The pullback of every row of ``cotangents``, written (``add``: added) into the flat ``(k, d)`` ``out``.

        The pullbacks are taken with respect to each site's value, not the flat ``theta``: the backward of a slice
        of ``theta`` would zero-fill a ``(k, d)`` gradient for every site and add them up; here each site's piece is
        written into its columns once (and freed as it is).
        """
        try:
            (pieces,) = vmap(pullback)(cotangents)
        except RuntimeError:
            rows = [pullback(u)[0] for u in cotangents]
            pieces = {name: torch.stack([row[name] for row in rows]) for name in self.layout.names}
            del rows
        for name, slot in self.layout.slots.items():
            piece = pieces.pop(name).reshape(out.shape[0], -1)
            if add:
                out[:, slot.start : slot.stop] += piece
            else:
                out[:, slot.start : slot.stop] = piece
        return out

    def ggn_vp(self, theta: Tensor, vectors: Tensor, roots: list[Tensor] | None = None) -> Tensor:
        r""":math:`G v = \sum_i J_i^\top \Lambda_i J_i v` on the full data for ``vectors`` ``(k, d)``."""
        out = torch.zeros_like(vectors)
        for number, batch in enumerate(self.batches()):
            root = roots[number] if roots is not None else None
            self.batch_ggn_vp(theta, vectors, batch, root, out=out)
        return out

    # ------------------------------------------------------------------ prior
    def prior(self, theta: Tensor, *, joint: bool = False) -> tuple[Tensor, Tensor]:
        """Diagonal prior precision ``P`` and mean ``m`` (flat) of the Gaussian prior in unconstrained space.

        With ``joint=True``, a correlated Gaussian prior (a posterior's ``as_prior``) is read as a dense ``d x d``
        precision; otherwise it is an error naming the engines that read it.
        """
        theta = theta.detach().requires_grad_(True)
        raw = model_outputs(
            self.bridge, self.latents(theta), self._head(self.bridge.args, self.bridge.kwargs), site=self.site
        )
        joints = {id(fn.joint): fn.joint for fn in raw.priors.values() if isinstance(fn, SiteGaussian)}
        if joints:
            return self._joint_prior(theta, list(joints.values()), joint)
        precision, mean = torch.empty_like(theta), torch.empty_like(theta)
        for name, slot in self.layout.slots.items():
            fn = raw.priors.get(name)
            if fn is None:
                raise ModelError(
                    f"latent site '{name}' comes after the observed site '{self.site}' in the model; "
                    "declare global latents before the likelihood."
                )
            value = theta[slot.start : slot.stop].reshape(slot.shape)
            precision[slot.start : slot.stop], mean[slot.start : slot.stop] = self._site_prior(name, fn, value)
        return precision.detach(), mean.detach()

    def _joint_prior(self, theta: Tensor, joints: list[JointGaussian], allowed: bool) -> tuple[Tensor, Tensor]:
        names = [s.name for s in joints[0].sites]
        if not allowed:
            raise ModelError(
                f"the latent sites {names} have a correlated Gaussian prior (a posterior's as_prior); this engine "
                "reads a factorised prior. Use AutoLinearizedLaplace with structure='full', an SG-MCMC kernel, SWAG "
                "or NUTS on this model, or pass the previous posterior with a diagonal structure (a "
                "sample-then-optimise posterior: as_prior(correlations='diagonal'))."
            )
        if len(joints) > 1 or names != self.layout.names:
            raise ModelError(
                f"the Laplace sites {self.layout.names} must be exactly the sites of the correlated prior {names} "
                "(in that order): pass sites=[...] naming them."
            )
        joint = joints[0]
        return joint.precision_matrix().to(theta.dtype), joint.mean.to(theta.dtype)

    def _site_prior(self, name: str, fn, value: Tensor) -> tuple[Tensor, Tensor]:
        site = self.bridge.sites[name]
        base = fn
        while isinstance(base, (dist.Independent, dist.ExpandedDistribution)):
            base = base.base_dist
        if any(v.requires_grad for v in base.__dict__.values() if isinstance(v, Tensor)):
            raise ModelError(
                f"the prior of latent site '{name}' depends on other Laplace sites (a hierarchical prior); the "
                "Laplace prior must be fixed. Pass sites=[...] without the hyper-parameter sites: they are then "
                "held at their MAP values."
            )
        if isinstance(base, dist.Normal) and not site.has_jacobian:
            loc, scale = torch.broadcast_to(base.loc, value.shape), torch.broadcast_to(base.scale, value.shape)
            return scale.pow(-2).flatten().detach(), loc.flatten().detach()
        if fn.event_shape.numel() > 1 and not isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
            raise ModelError(
                f"latent site '{name}' has a {type(fn).__name__} prior, whose Hessian is not diagonal; give it a "
                "factorised prior (e.g. Normal(...).to_event(1)) or leave it out of sites=[...]."
            )

        def log_density(u):
            constrained = site.transform(u)
            log_prob = fn.log_prob(constrained).sum()
            if site.has_jacobian:
                log_prob = log_prob + site.transform.log_abs_det_jacobian(u, constrained).sum()
            return log_prob

        point = value.detach()
        gradient, curvature = jvp(torch.func.grad(log_density), (point,), (torch.ones_like(point),))
        precision = -curvature.flatten()
        if not bool((precision > 0).all()):
            raise ModelError(
                f"the prior of latent site '{name}' ({type(base).__name__}) has no positive curvature at the MAP; "
                "pass prior_precision=... to laplace_approximation, or give the site a Normal prior."
            )
        return precision, point.flatten() + gradient.flatten() / precision
