r"""The result surface of a Laplace posterior: the linearised GLM predictive, draws of ``y``, the next prior.

:class:`LaplacePredictives` is the part of :class:`~pyro_scalable.infer.laplace.posterior.LaplacePosterior` that
predicts; it reads the posterior's point :math:`\theta_*`, mean, precision, network function and fitted noise.
``predict`` gives the closed-form (or probit / Monte-Carlo) law of ``y`` from :math:`J H^{-1} J^\top`;
``posterior_predictive`` draws ``y``; ``linearized_model`` is the linearised network as a Pyro model; ``as_prior``
makes the posterior the joint prior of the next episode's model.
"""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_scalable.arguments import check_choice, check_count, check_flag, check_seed
from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import Batch
from pyro_scalable.infer.gaussian_prior import GaussianPriorModel, JointGaussian, site_specs
from pyro_scalable.infer.linearized.glm import GLMPredictive, Moments, glm_predictive, linearized_posterior_predictive
from pyro_scalable.infer.linearized.likelihoods import Likelihood, LinkApprox
from pyro_scalable.infer.predictive import sample_posterior_predictive
from pyro_scalable.infer.uncertainty import Uncertainty

__all__ = ["LaplacePredictives"]


_DENSE_PRIOR_LIMIT = 5000  # as_prior of a structure without a structured Gaussian: dense up to this many parameters


class LaplacePredictives:
    """Predictions from a Laplace posterior (mixed into ``LaplacePosterior``)."""

    def _batches(self, args: tuple, kwargs: dict):
        if not args and not kwargs:
            return list(self.net.batches())
        return list(self.net.batches(args, kwargs))

    def predict(
        self,
        *args: Any,
        link_approx: LinkApprox = "probit",
        num_samples: int = 100,
        seed: int | None = None,
        **kwargs: Any,
    ) -> GLMPredictive:
        """The linearised predictive at the model's inputs ``args`` (no ``y`` needed), on every data point.

        Args:
            link_approx: ``"probit"`` (closed form) or ``"mc"`` (``num_samples`` draws of the outputs per point)
                for classification and Poisson likelihoods; a Normal likelihood is always exact.

        """
        check_choice("link_approx", link_approx, ("probit", "mc"))
        check_count("num_samples", num_samples)
        check_seed("seed", seed)
        generator = None if seed is None else torch.Generator(self.theta_star.device).manual_seed(seed)
        delta = self.mean - self.theta_star
        shifted = bool(delta.abs().max() > 0)

        def moments(batch: Batch) -> Moments:
            f, covariance, likelihood = self.precision.functional_covariance(
                self.net, self.theta_star, batch, self.fit.layers, self.fit.rest
            )
            if shifted:
                _, shift = self.net.jvp(self.theta_star, delta.unsqueeze(0), batch)
                f = f + shift[0].detach()
            return f, covariance, likelihood

        return glm_predictive(
            self._batches(args, kwargs),
            moments,
            link_approx=link_approx,
            num_samples=num_samples,
            generator=generator,
            fitted=self._fitted,
        )

    def uncertainty(
        self,
        *args: Any,
        num_samples: int | None = None,
        seed: int | None = None,
        linearized: bool = True,
        site: str | None = None,
        **kwargs: Any,
    ) -> Uncertainty:
        """Aleatoric + epistemic split of the predictive at ``args``; by default the linearised one (``predict``).

        ``linearized=False``: the model itself at ``num_samples`` weight draws (plain Laplace sampling).
        """
        return super().uncertainty(  # type: ignore[misc]  (GaussianDraws's, next in LaplacePosterior's MRO)
            *args, num_samples=num_samples, seed=seed, linearized=linearized, site=site, **kwargs
        )

    def posterior_predictive(
        self,
        *args: Any,
        num_samples: int = 1000,
        seed: int | None = None,
        linearized: bool = True,
        return_sites: list[str] | None = None,
        **kwargs: Any,
    ) -> dict[str, Tensor]:
        r"""``num_samples`` draws of the observed site, on the training data or at new inputs ``args``.

        Each draw takes weights from this posterior and ``y`` from the likelihood at the network's output there.
        With ``linearized=True`` (the default) the output is the linearised network
        :math:`f(x, \theta_*) + J(x)(\theta - \theta_*)`, the model the Laplace posterior is the posterior of: the
        GLM predictive that Immer et al. (2021, "Improving predictions of Bayesian neural nets via local
        linearization") recommend, since the Gaussian posterior pushed through the nonlinear network underfits (it
        puts mass where the network, not its linearisation, is far from the data). ``linearized=False`` runs the
        model itself at the sampled weights (what ``Predictive(FullDataModel(model), guide=posterior)`` gives);
        both agree where the output is linear in the Laplace sites.

        Args:
            args: the model's arguments without ``y`` (none: the data the posterior was fitted on, ``y`` redrawn).
            return_sites: default the observed site; latent sites give their posterior draws.

        Returns:
            ``{site: (num_samples, *site shape)}``.

        """
        check_count("num_samples", num_samples)
        check_seed("seed", seed)
        check_flag("linearized", linearized)
        if not args and not kwargs:
            args, kwargs = self.bridge.args, self.bridge.kwargs
        generator = None if seed is None else torch.Generator(self.theta_star.device).manual_seed(seed)
        theta = self.sample(num_samples, generator)
        samples = self.bridge.constrain(self._all_latents(theta))
        draws_seed = None
        if generator is not None:
            draws_seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
        if not linearized:
            return sample_posterior_predictive(
                self.bridge.model, samples, *args, seed=draws_seed, return_sites=return_sites, **kwargs
            )
        return linearized_posterior_predictive(
            self.net,
            theta,
            samples,
            self._batches(args, kwargs),
            return_sites=return_sites,
            fitted=self._fitted,
            generator=generator,
        )

    def linearized_model(self, *args: Any, **kwargs: Any) -> Tensor:
        """The linearised model as a Pyro model: ``f = f(x, θ*) + J(x)(θ - θ*)``, then ``y`` from the likelihood.

        Its latents are drawn from this posterior (so ``Predictive(posterior.linearized_model, num_samples=S)``
        needs no guide), or taken from a guide's trace when ``Predictive`` conditions on one.
        """
        draw = self.bridge.constrain(self._all_latents(self.sample(1)[0]))
        values = {name: pyro.sample(name, dist.Delta(v, event_dim=v.dim())) for name, v in draw.items()}
        theta = self.net.layout.flatten(self.bridge.unconstrain({k: values[k] for k in self.sites}))
        batch = Batch({}, args, kwargs)
        with torch.no_grad():
            f, tangent = self.net.jvp(self.theta_star, (theta - self.theta_star).unsqueeze(0), batch)
            likelihood = self._fitted(self.net.outputs(self.theta_star, batch).likelihood)
        return pyro.sample(self.net.site, likelihood.distribution(f + tangent[0]))

    def _fitted(self, likelihood: Likelihood) -> Likelihood:
        # a Normal's noise as the evidence fitted it, where it differs from the model's MAP value
        if self._map_noise is not None and self._observation_noise is not None:
            return likelihood.with_noise(self._observation_noise)
        return likelihood

    # ------------------------------------------------------------------ the next episode
    def as_prior(self, model: Any = None) -> GaussianPriorModel:
        r"""The model with the posterior :math:`\mathcal N(\bar\theta, H^{-1})` as the joint prior of the Laplace sites.

        Fit the next episode's data with any engine on the returned model: the correlations are kept (``full`` as
        a dense Gaussian, ``low_rank`` in its precision form, ``diag`` as independent Normals — the EWC update).
        The sites held at their MAP values (e.g. a noise scale) keep the model's own priors.
        ``kron`` keeps its layer blocks (a weight's marginal and its bias given it, in the factors' eigenbases: no
        ``d x d``; :mod:`pyro_scalable.infer.gaussian_prior.kron`); ``sampled`` is made dense, up to 5,000 parameters.

        Args:
            model: the model the prior goes into (default: the one this posterior was fitted on); it must sample
                the same latent sites, in the same order.

        """
        precision = self.precision
        specs = site_specs(self.bridge, self.sites)
        mean = self.mean.detach()
        if hasattr(precision, "joint_gaussian"):
            joint = precision.joint_gaussian(specs, mean)
        elif self.num_params <= _DENSE_PRIOR_LIMIT:
            dense = precision.to_dense().detach().double()
            covariance = torch.cholesky_inverse(torch.linalg.cholesky(dense)).to(mean.dtype)
            joint = JointGaussian.dense(specs, mean, covariance)
        else:
            raise ModelError(
                f"as_prior of a '{self.structure}' posterior with {self.num_params} parameters would form a dense "
                f"covariance (it does so up to {_DENSE_PRIOR_LIMIT}); fit structure='diag' or 'low_rank' for a "
                "prior of this size."
            )
        return GaussianPriorModel(self.bridge.model if model is None else model, joint)
