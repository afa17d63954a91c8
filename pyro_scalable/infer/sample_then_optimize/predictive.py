r"""The result surface of sample-then-optimise: the posterior's mean and offsets, predictives, the next prior.

:class:`SampleThenOptimizePredictives` is the part of
:class:`~pyro_scalable.infer.sample_then_optimize.engine.SampleThenOptimize` that predicts, from the network
linearised at :math:`\theta_*`, the draws' mean and their zero-mean offsets :math:`\zeta_j`, and turns them into
the next episode's prior (``as_prior``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from pyro_scalable.arguments import (
    check_choice,
    check_count,
    check_flag,
    check_seed,
)
from pyro_scalable.infer.gaussian_prior import GaussianPriorModel, site_specs
from pyro_scalable.infer.gaussian_prior.shrinkage import gaussian_from_draws
from pyro_scalable.infer.linearized.glm import (
    GLMPredictive,
    draws_moments,
    glm_predictive,
    linearized_posterior_predictive,
)
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.uncertainty import Uncertainty, linearized_uncertainty

__all__ = ["SampleThenOptimizePredictives"]


class SampleThenOptimizePredictives:
    """The results of a sample-then-optimise run, read: its mean and offsets, predictions, the next prior.

    Mixed into ``SampleThenOptimize``, whose run sets ``net``, ``state``, ``mean_unconstrained`` and the solved prior.
    """

    @property
    def final_prior_precision(self) -> dict[str, Tensor]:
        """The prior precision of the last solve (after EM) of every sampled site, shaped like its value."""
        return self._require_net().layout.unflatten(self.solved_prior_precision)

    @property
    def solved_prior_precision(self) -> Tensor:
        """The prior precision of the last solve (after EM), flat over the sampled sites (unconstrained)."""
        self._require_net()
        return self._solved_precision

    @property
    def sample_offsets(self) -> Tensor:
        r"""The zero-mean rows :math:`\zeta_j \sim \mathcal N(0, H^{-1})` of the draws, flat, ``(K, d)``."""
        self._require_net()
        return self.state.samples[:-1].detach()

    def _require_net(self) -> NetworkFunction:
        if self.net is None:
            raise RuntimeError("call run(...) before asking for results.")
        return self.net

    def get_mean(self) -> dict[str, Tensor]:
        """The posterior mean of the sampled sites (constrained; the other sites at their fixed values)."""
        net = self._require_net()
        return self.bridge.constrain({**net.fixed, **net.layout.unflatten(self.mean_unconstrained)})

    def predict(
        self,
        *args: Any,
        link_approx: Literal["probit", "mc"] = "probit",
        num_samples: int = 100,
        seed: int | None = None,
        **kwargs: Any,
    ) -> GLMPredictive:
        r"""The linearised predictive at the model's inputs ``args`` (no ``y`` needed), every data point.

        The outputs are :math:`f(x, \theta_*) + J(x)(\bar\theta - \theta_*)` with the covariance
        :math:`\frac1K\sum_j (J\zeta_j)(J\zeta_j)^\top` of the draws (rank at most K); the law of ``y`` follows
        from the likelihood as in :meth:`LaplacePosterior.predict` (``link_approx`` for classification).
        """
        net = self._require_net()
        check_choice("link_approx", link_approx, ("probit", "mc"))
        check_count("num_samples", num_samples)
        check_seed("seed", seed)
        theta = net.theta_star
        generator = None if seed is None else torch.Generator(theta.device).manual_seed(seed)
        batches = list(net.batches()) if not args and not kwargs else list(net.batches(args, kwargs))
        shift = self.mean_unconstrained - theta
        with torch.no_grad():
            return glm_predictive(
                batches,
                lambda batch: draws_moments(net, theta, self.sample_offsets, batch, shift),
                link_approx=link_approx,
                num_samples=num_samples,
                generator=generator,
            )

    def uncertainty(
        self,
        *args: Any,
        linearized: bool = True,
        num_samples: int = 1000,
        seed: int | None = None,
        site: str | None = None,
        **kwargs: Any,
    ) -> Uncertainty:
        r"""Aleatoric + epistemic split of the predictive at ``args`` (none: the run's data).

        By default the linearised predictive (:meth:`predict`: :math:`f` Gaussian with the draws' mean and
        covariance, ``num_samples`` draws of :math:`f` for a classifier); ``linearized=False`` runs the model at
        each kept draw.
        """
        check_flag("linearized", linearized)
        if linearized:
            return linearized_uncertainty(self.predict(*args, **kwargs), num_samples=num_samples, seed=seed)
        return super().uncertainty(*args, site=site, **kwargs)  # type: ignore[misc]  (Draws's)

    def posterior_predictive(
        self,
        *args: Any,
        group_by_chain: bool = False,
        seed: int | None = None,
        return_sites: list[str] | None = None,
        linearized: bool = True,
        **kwargs: Any,
    ) -> dict[str, Tensor]:
        r"""One draw of the observed site per posterior draw: on the run's data (``y`` redrawn), or at new inputs.

        The draws are of the linearised model's posterior, so by default (``linearized=True``) ``y`` is drawn at the
        linearised network :math:`f(x, \theta_*) + J(x)(\theta_j - \theta_*)`, as the Laplace guide's
        :meth:`~pyro_scalable.infer.LaplacePosterior.posterior_predictive` does (the predictive Immer et al. 2021
        recommend); ``linearized=False`` runs the model itself at each draw. The two agree for a model linear in
        the sampled sites. Each site ``(num_samples, *site shape)``, or ``(1, num_samples, ...)`` with
        ``group_by_chain``.
        """
        check_flag("linearized", linearized)
        if not linearized:
            return super().posterior_predictive(
                *args, group_by_chain=group_by_chain, seed=seed, return_sites=return_sites, **kwargs
            )
        net = self._require_net()
        check_flag("group_by_chain", group_by_chain)
        check_seed("seed", seed)
        unconstrained = self.get_unconstrained_samples()
        theta = net.layout.flatten({k: v.to(net.theta_star.device) for k, v in unconstrained.items()}, batch_dims=1)
        batches = list(net.batches()) if not args and not kwargs else list(net.batches(args, kwargs))
        generator = None if seed is None else torch.Generator(theta.device).manual_seed(seed)
        draws = linearized_posterior_predictive(
            net, theta, self.get_samples(), batches, return_sites=return_sites, generator=generator
        )
        draws = {k: v.to(self.draws_device) for k, v in draws.items()}
        if not group_by_chain:
            return draws
        return {k: v.unsqueeze(0) for k, v in draws.items()}

    def as_prior(
        self, model: Any = None, *, correlations: Literal["shrinkage", "diagonal"] = "shrinkage"
    ) -> GaussianPriorModel:
        r"""The model with this posterior's Gaussian as the joint prior of its sampled sites (the next episode).

        :math:`\mathcal N(\bar\theta, \hat\Sigma)` from the draws' offsets :math:`\zeta_j \sim \mathcal N(0, H^{-1})`,
        whose covariance :math:`S = \frac1K\sum_j \zeta_j\zeta_j^\top` is unbiased but of rank K. The default keeps
        the variances and shrinks every correlation by the Schäfer-Strimmer intensity :math:`\rho` (``joint.shrinkage``:
        near 0 when K is large against d, near 1 when the draws' correlations are noise):
        :math:`\hat\Sigma = \rho\,\mathrm{diag}(S) + (1-\rho) S`, rank K plus diagonal, no ``d x d``
        (:mod:`~pyro_scalable.infer.gaussian_prior.shrinkage`); SG-MCMC, SWAG, SVI, NUTS and the ``full`` Laplace
        read it. ``"diagonal"`` gives :math:`\mathrm{diag}(S)` as Pyro Normals, which every engine reads (this one
        too: keep ``em_steps=0`` next time). Both keep the marginals, not EWC's narrower :math:`1/\mathrm{diag}(H)`;
        the sites held fixed (a noise scale) keep the model's priors.

        Args:
            model: the model the prior goes into (default: the one this engine ran on); it must sample the same
                latent sites, in the same order.
            correlations: ``"shrinkage"`` (the correlated estimate) or ``"diagonal"`` (for a next episode run by an
                engine that reads a factorised prior: sample-then-optimise, Laplace ``diag``/``kron``).

        Example:
            >>> import pyro, pyro.distributions as dist, torch
            >>> from pyro_scalable.infer import SampleThenOptimize
            >>> def model(x, y=None):
            ...     w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
            ...     with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
            ...         pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])
            >>> g = torch.Generator().manual_seed(0)
            >>> x = torch.randn(200, 3, generator=g); x[:, 1] += x[:, 0]  # correlated features: a correlated posterior
            >>> y = x @ torch.tensor([1.0, 0.0, -1.0]) + 0.5 * torch.randn(200, generator=g)
            >>> engine = SampleThenOptimize(model, num_samples=16, seed=0, progress_bar=False)
            >>> engine.run(x, y)
            SampleThenOptimize(1 chain x 16 draws)
            >>> engine.as_prior().joint.kind  # the next episode's model: N(mean, rho diag(S) + (1 - rho) S) on "w"
            'low_rank_covariance'
            >>> engine.as_prior(correlations="diagonal").joint.kind  # N(mean, diag(S)), for a factorised engine
            'diagonal'

        """
        check_choice("correlations", correlations, ("shrinkage", "diagonal"))
        specs = site_specs(self.bridge, self._require_net().layout.names)
        joint = gaussian_from_draws(specs, self.mean_unconstrained.detach(), self.sample_offsets, correlations)
        return GaussianPriorModel(self.bridge.model if model is None else model, joint)
