r"""The EKF's posterior: its Gaussian over every latent site (unconstrained), with the SWAG posterior's surface.

A diagonal filter's Gaussian is SWAG-Diagonal's form; a dense filter's covariance :math:`\Sigma = LL^\top` is held
by its Cholesky factor :math:`L` (``d x d``), which the SWAG surface reads as :math:`\mathrm{diag}(0) + LL^\top`
(its linearised predictive, ``covariance_factors``) and which draws :math:`m + Lz`. ``as_prior`` gives the next
episode the Gaussian itself: Pyro Normals for a diagonal one, the dense joint prior (with its correlations) for a
dense one, which the next dense filter reads as its starting precision.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pyro_scalable.arguments import check_count
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer.gaussian_prior import GaussianPriorModel, JointGaussian, site_specs
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.swag.moments import SWAGMoments
from pyro_scalable.infer.swag.posterior import SWAGPosterior

__all__ = ["EKFPosterior"]


class EKFPosterior(SWAGPosterior):
    """The filter's Gaussian over every latent site (unconstrained), with the SWAG posterior's surface.

    ``get_samples``, the Pyro guide (``Predictive(FullDataModel(model), guide=posterior)``), ``posterior_predictive``,
    the linearised ``predict``, ``covariance_matrix``, ``variance``, ``to_inference_data`` and ``as_prior``.
    ``covariance`` is ``"dense"`` or ``"diagonal"``. ``stats`` records the steps, the iterations, the time and the
    check of the posterior after the pass.
    """

    def __init__(
        self,
        bridge: ModelBridge,
        layout: ParameterLayout,
        mean: Tensor,
        covariance: Tensor,
        stats: dict,
    ):
        dense = covariance.dim() == 2
        variance = covariance.diagonal() if dense else covariance
        moments = SWAGMoments(mean[None], variance.to(mean.dtype)[None], mean.new_zeros(1, 0, mean.numel()), 1)
        super().__init__(bridge, layout, moments, "dense" if dense else "diagonal", stats)
        # float64: a float32 model's dense covariance, rounded, can lose positive definiteness
        self._dense = covariance.double() if dense else None
        self.scale_tril = torch.linalg.cholesky(self._dense) if dense else None

    @property
    def variance(self) -> Tensor:
        """The marginal variances, ``(1, d)``."""
        return self.moments.variance

    def covariance_matrix(self, run: int = 0) -> Tensor:
        """The covariance as a dense ``(d, d)`` matrix."""
        self._check_run(run)
        if self._dense is None:
            return torch.diag(self.moments.variance[run])
        return self._dense.to(self.mean.dtype)

    def covariance_factors(self, run: int = 0) -> tuple[Tensor, Tensor]:
        r"""The covariance as :math:`\mathrm{diag}(D) + AA^\top` (SWAG's linearised predictive reads it).

        Returns:
            ``D`` ``(d,)`` and ``A``: dense, zeros and the Cholesky factor ``(d, d)``; diagonal, the variances and
            ``(d, 0)``.

        """
        self._check_run(run)
        if self.scale_tril is None:
            return self.moments.variance[run], self.mean.new_zeros(self.num_params, 0)
        return self.mean.new_zeros(self.num_params), self.scale_tril.to(self.mean.dtype)

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """Flat unconstrained draws ``(num_samples, d)``."""
        if self.scale_tril is None:
            return super().sample(num_samples, generator)
        check_count("num_samples", num_samples)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        like = {"dtype": self.mean.dtype, "device": self.mean.device, "generator": generator}
        noise = torch.randn(num_samples, self.num_params, **like)
        return self.mean + (noise.double() @ self.scale_tril.T).to(self.mean.dtype)

    def as_prior(self, model: Any = None) -> GaussianPriorModel:
        r"""The model with this Gaussian as the joint prior of its latent sites: the next episode's prior.

        Diagonal: Pyro Normals every engine reads. Dense: the joint prior with its correlations, which SG-MCMC,
        SWAG, NUTS, the ``"full"`` Laplace and the next dense ``EKF`` read; the EKF continues the filter where this
        one stopped (two episodes are one filter over both data sets).

        Args:
            model: the model the prior goes into (default: the one the filter ran on); same latent sites, same order.

        """
        specs = site_specs(self.bridge, self.sites)
        if self.scale_tril is None:
            joint = JointGaussian.diagonal(specs, self.mean[0], self.variance[0])
        else:
            joint = JointGaussian.dense(specs, self.mean[0], self.covariance_matrix())
        return GaussianPriorModel(self.bridge.model if model is None else model, joint)

    def __repr__(self) -> str:
        return f"EKFPosterior(covariance={self.covariance!r}, d={self.num_params}, steps={self.stats.get('steps')})"
