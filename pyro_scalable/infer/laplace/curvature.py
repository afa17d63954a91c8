r"""The contracts of the Laplace curvature structures, for the posterior precision :math:`H = s\,G + \mathrm{diag}(P)`.

:math:`G` is the generalised Gauss-Newton matrix (or empirical Fisher) of the data over a flat vector of
:math:`d` parameters, :math:`P` a diagonal prior precision and :math:`s` a scale (:math:`\sigma_0^2/\sigma^2`
when the observation noise of a Normal likelihood changes). Each structure stores :math:`G` once and returns a
:class:`Precision` for any :math:`(P, s)`, differentiable in both, with the log-determinant, solves, matrix
products, samples of :math:`\mathcal N(0, H^{-1})` and the marginal variances :math:`\mathrm{diag}(H^{-1})`:

* ``full``: :math:`G` dense; Cholesky of :math:`H`.
* ``diag``: :math:`\mathrm{diag}(G)`.
* ``low_rank``: :math:`G \approx U \Lambda U^\top` (top-:math:`k` eigenpairs). With
  :math:`W = P^{-1/2} U (s\Lambda)^{1/2} = Q \Sigma V^\top`,
  :math:`H = P^{1/2}(I + W W^\top) P^{1/2}`, so :math:`\log\det H = \sum\log P + \sum\log(1 + \sigma_j^2)` and
  :math:`(I + WW^\top)^{-1/2} = I + Q((1+\Sigma^2)^{-1/2} - I)Q^\top` (matrix determinant lemma, Woodbury).
* ``kron``: per layer, :math:`G_\ell \approx B_\ell \otimes A_\ell` (K-FAC; Martens & Grosse 2015, with the bias
  folded into :math:`A_\ell`), the other parameters diagonal. A layer's prior must be
  :math:`I \otimes D` (equal across the layer's outputs; a scalar, or one value for the weight and one for the
  bias). With :math:`\tilde A = D^{-1/2} A D^{-1/2} = Q_A \mathrm{diag}(\lambda) Q_A^\top` and
  :math:`B = Q_B \mathrm{diag}(\mu) Q_B^\top`,

  .. math::

      H_\ell = (I \otimes D^{1/2})(Q_B \otimes Q_A)(s\,\mu\lambda^\top + 1)(Q_B \otimes Q_A)^\top(I \otimes D^{1/2}),

  which is exact (no further approximation of the prior), and needs no new eigendecomposition when :math:`D`
  is a scalar. Vectors of a layer are ``(outputs, inputs + 1)`` matrices; :math:`(B\otimes A)\,\mathrm{vec}(V)
  = \mathrm{vec}(B V A)`.

A precision that is not positive definite raises :class:`CurvatureError` with the offending flat indices.

Each structure is one class in :mod:`pyro_scalable.infer.laplace.structures` (registered there by name): it fits
itself (:meth:`Structure.fit`, its part of the one GGN pass), holds :math:`G`, and its :class:`Precision` gives the
functional covariance :math:`J H^{-1} J^\top` of the linearised predictive in its own factors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import Batch, Latents
from pyro_scalable.infer.linearized.ggn import DataFit, ggn_pass
from pyro_scalable.infer.linearized.glm import Moments
from pyro_scalable.infer.linearized.jacobians import LayerPlan
from pyro_scalable.infer.linearized.network import NetworkFunction

__all__ = [
    "Curvature",
    "CurvatureError",
    "FitRequest",
    "PassStructure",
    "Precision",
    "Structure",
    "check_positive",
    "gaussian_noise",
]


class CurvatureError(ModelError):
    """The posterior precision is not positive definite; ``index`` holds the flat parameter indices involved."""

    def __init__(self, message: str, index: Tensor | None = None):
        super().__init__(message)
        self.index = index


class Precision(Protocol):
    r""":math:`H = sG + \mathrm{diag}(P)` for one choice of ``(P, s)``."""

    def logdet(self) -> Tensor: ...
    def solve(self, v: Tensor) -> Tensor: ...
    def matvec(self, v: Tensor) -> Tensor: ...
    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor: ...
    def inverse_diagonal(self) -> Tensor: ...
    def to_dense(self) -> Tensor: ...
    def functional_covariance(
        self, net: NetworkFunction, theta: Tensor, batch: Batch, plans: list[LayerPlan], rest: Tensor
    ) -> Moments: ...


class Curvature(Protocol):
    """The data part :math:`G` of the posterior precision, in one structure."""

    num_params: int

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> Precision: ...
    def matvec(self, v: Tensor) -> Tensor: ...
    def to_dense(self) -> Tensor: ...


@dataclass
class FitRequest:
    """Everything a structure may need to fit itself at the MAP (most structures read only the first few)."""

    net: NetworkFunction
    theta: Tensor
    prior_precision: Tensor
    curvature: Literal["ggn", "ef"] = "ggn"
    rank: int = 50
    generator: torch.Generator | None = None
    # for a structure that runs a sampler on the Pyro model itself ("sampled")
    model: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    latents: Latents = field(default_factory=dict)
    num_samples: int = 64
    sampler_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    check_map: bool = True


class Structure(Protocol):
    """A structure class, as the registry holds it: what it can do, and how it fits itself.

    A structure without evidence (``has_evidence = False``) has no log-determinant or solve; its curvature tunes
    the prior itself instead, with ``tune_prior(method, observation_noise, em_steps, prior_precision)``, which
    returns the new curvature (whose ``prior_precision`` the posterior adopts).
    """

    name: ClassVar[str]
    exact: ClassVar[bool]  # the exact GGN: the evidence's b-term and the Newton-moved mean are sound
    has_evidence: ClassVar[bool]  # a log-determinant and solves (otherwise the prior is tuned by tune_prior)
    per_parameter_prior: ClassVar[bool]  # accepts a different prior precision for every parameter

    @classmethod
    def fit(cls, request: FitRequest) -> DataFit: ...


class PassStructure:
    """A structure fitted by the one GGN pass: ``accumulator`` says what it keeps of each chunk."""

    exact: ClassVar[bool] = False
    has_evidence: ClassVar[bool] = True
    per_parameter_prior: ClassVar[bool] = True

    @classmethod
    def accumulator(cls, request: FitRequest):
        raise NotImplementedError

    @classmethod
    def fit(cls, request: FitRequest) -> DataFit:
        """One pass over the full data at ``request.theta``, accumulating this structure's :math:`G`.

        The gradient of the log-likelihood is taken in the pass where something reads it for sure (the MAP check,
        the exact structure's evidence and mean); otherwise on first use (:attr:`DataFit.gradient`).
        """
        accumulator = cls.accumulator(request)
        gradient = request.check_map or cls.exact
        return ggn_pass(
            request.net, request.theta, accumulator, curvature=request.curvature, stacklevel=3, gradient=gradient
        )


def gaussian_noise(shape, like: Tensor, generator) -> Tensor:
    """Standard normal noise of ``shape`` with the dtype and device of ``like``."""
    return torch.randn(shape, generator=generator, dtype=like.dtype, device=like.device)


def check_positive(values: Tensor, what: str, index: Tensor | None = None, *, dense: bool = False) -> None:
    """Raise :class:`CurvatureError` naming the flat indices (``index[where]``) where ``values`` is not positive."""
    # the eigenvalues of a dense matrix count as zero below d * eps relative to the largest (numpy's matrix_rank)
    floor = 0.0
    if dense and values.numel():
        floor = float(values.abs().max()) * values.numel() * torch.finfo(values.dtype).eps
    bad = ~(values > floor)
    if bool(bad.any()):
        where = torch.nonzero(bad).flatten()
        where = where if index is None else index[where]
        counted = "non-positive value(s)" if floor == 0.0 else f"value(s) at or below {floor:.3g} (zero to rounding)"
        raise CurvatureError(
            f"the posterior precision is singular: {what} has {int(bad.sum())} {counted}, the smallest "
            f"{float(values.min()):.3g}. Give those parameters a proper prior, raise the prior precision, or pass "
            "jitter=... to laplace_approximation.",
            where,
        )
