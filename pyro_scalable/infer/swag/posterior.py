"""The SWAG posterior of a Pyro model: draws, a Pyro guide, predictions and ArviZ, like the Laplace posterior's.

Every latent site is in the SWAG Gaussian, in unconstrained space (a scale site's draws are log-normal). With
several runs (MultiSWAG) the posterior is their equal-weight mixture; ``get_samples(group_by_chain=True)`` and the
ArviZ conversion keep the runs apart as chains.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_scalable.arguments import check_choice, check_count, check_seed
from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.infer.gaussian_prior import GaussianPriorModel, JointGaussian, prior_variances, site_specs
from pyro_scalable.infer.linearized.glm import GLMPredictive
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.likelihoods import LinkApprox
from pyro_scalable.infer.predictive import sample_posterior_predictive
from pyro_scalable.infer.record import convert
from pyro_scalable.infer.results import GaussianDraws
from pyro_scalable.infer.swag.linearized import linearized_predictive
from pyro_scalable.infer.swag.moments import SWAGMoments, covariance_factors, dense_covariance, sample_flat

__all__ = ["SWAGPosterior"]

UNMOVED = 1e-6  # a SWAG variance below this fraction of the prior's: SGD did not move that coordinate


class SWAGPosterior(GaussianDraws):
    """A SWAG (or MultiSWAG) Gaussian over every latent site, in unconstrained space. Built by :meth:`SWAG.run`.

    Calling it like the model samples every latent site: it is a Pyro guide, so
    ``Predictive(FullDataModel(model), guide=posterior, num_samples=S)`` gives the sampled-weights predictive.
    """

    def __init__(
        self, bridge: ModelBridge, layout: ParameterLayout, moments: SWAGMoments, covariance: str, stats: dict
    ):
        self.bridge, self.layout, self.moments = bridge, layout, moments
        self.covariance = covariance
        self.stats = stats

    # ------------------------------------------------------------------ state
    @property
    def sites(self) -> list[str]:
        return self.layout.names

    @property
    def num_params(self) -> int:
        return self.layout.num_params

    @property
    def num_runs(self) -> int:
        return self.moments.mean.shape[0]

    @property
    def rank(self) -> int:
        """K: the deviations kept per run (the low-rank part's rank)."""
        return self.moments.deviations.shape[1]

    @property
    def mean(self) -> Tensor:
        """Each run's SWA mean, flat and unconstrained, ``(runs, d)``."""
        return self.moments.mean

    @property
    def variance(self) -> Tensor:
        """The marginal variances of each run's Gaussian, ``(runs, d)`` (half the snapshots' with ``low_rank``)."""
        if self.covariance == "diagonal":
            return self.moments.variance
        k = self.rank
        return 0.5 * self.moments.variance + 0.5 * self.moments.deviations.square().sum(1) / (k - 1)

    def covariance_matrix(self, run: int = 0) -> Tensor:
        """Run ``run``'s covariance as a dense ``(d, d)`` matrix (for small models: it takes d² numbers)."""
        self._check_run(run)
        return dense_covariance(self.moments, self.covariance, run)

    def covariance_factors(self, run: int = 0) -> tuple[Tensor, Tensor]:
        r"""Run ``run``'s covariance as :math:`\mathrm{diag}(D) + AA^\top`.

        Returns:
            ``D`` ``(d,)`` and ``A`` ``(d, K)`` (``(d, 0)`` for ``covariance="diagonal"``).

        """
        self._check_run(run)
        return covariance_factors(self.moments, self.covariance, run)

    def _check_run(self, run: int) -> None:
        check_count("run", run, 0)
        if run >= self.num_runs:
            raise ValueError(f"run must be below num_runs = {self.num_runs}, got {run}.")

    # ------------------------------------------------------------------ samples and guide
    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """Flat unconstrained draws ``(num_samples, d)``; draw ``s`` is from run ``s mod num_runs``."""
        check_count("num_samples", num_samples)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        return sample_flat(self.moments, num_samples, self.covariance, generator)

    def _generator(self, seed: int | None) -> torch.Generator | None:
        check_seed("seed", seed)
        return None if seed is None else torch.Generator(device=self.mean.device).manual_seed(seed)

    @property
    def num_chains(self) -> int:
        """The runs are the chains of :meth:`get_samples` ``(group_by_chain=True)`` and of ArviZ."""
        return self.num_runs

    def _draw(self, num_samples: int, seed: int | None, group_by_chain: bool) -> dict[str, Tensor]:
        # with group_by_chain num_samples per run: draw s is from run s mod R, (S, R) -> (R, S)
        total = num_samples * (self.num_runs if group_by_chain else 1)
        theta = self.sample(total, self._generator(seed))
        if group_by_chain:
            theta = theta.reshape(num_samples, self.num_runs, -1).transpose(0, 1)
        return self.bridge.constrain(self.layout.unflatten(theta))

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        values = self.bridge.constrain(self.layout.unflatten(self.sample(1)[0]))
        for name, value in values.items():
            pyro.sample(name, dist.Delta(value, event_dim=value.dim()))
        return values

    def median(self, *args: Any, **kwargs: Any) -> Latents:
        """The constrained values at the first run's SWA mean (SWA's point estimate)."""
        return self.bridge.constrain(self.layout.unflatten(self.mean[0]))

    # ------------------------------------------------------------------ the next episode
    def as_prior(self, model: Any = None) -> GaussianPriorModel:
        r"""The model with this SWAG Gaussian as the joint prior of its latent sites (the next episode's prior).

        One run: :math:`\mathcal N(\bar\theta, \tfrac12\Sigma_{\rm diag} + \tfrac{1}{2(K-1)}DD^\top)` in its
        low-rank form (rank K, no ``d x d``). Several runs (MultiSWAG): the Gaussian with the mixture's mean and
        covariance (rank R(K+1)); a mixture is not a Gaussian, so this keeps its first two moments only.

        SGD does not move a coordinate that no example's gradient reaches (a weight on an input that is always
        zero): SWAG's variance there is zero, while the posterior's is the prior's. Those coordinates (variance
        below :data:`UNMOVED` times the prior's, read from the prior's curvature at the SWA mean) get the prior's
        variance; ``stats["prior_coordinates"]`` counts them.

        SWAG's spread comes from the minibatch gradient noise, so it is narrower than the posterior wherever the
        data's noise is small against the curvature: in the directions the prior rather than the data pins, and
        everywhere when ``lr="auto"`` was capped below Mandt's rate (a warning says so). As a prior it then holds
        the next episode's weights too tightly, and the next episode learns its data poorly: prefer a Laplace
        posterior as the prior.

        Args:
            model: the model the prior goes into (default: the one SWAG ran on); same latent sites, same order.

        """
        noise_rate, rate = self.stats.get("lr_noise", math.nan), self.stats.get("lr", math.nan)
        if rate < noise_rate / 10:
            warnings.warn(
                f"as_prior: SWAG ran at lr={rate:.3g}, {noise_rate / rate:.3g} times below Mandt's rate, so its "
                "covariance is about that many times narrower than the posterior's in the noisy directions; as a "
                "prior it will hold the next episode's weights too tightly. A Laplace posterior's as_prior is the "
                "better prior; or run SWAG with lr= nearer Mandt's rate (stats['lr_noise']) if it stays stable.",
                stacklevel=2,
            )
        moments, runs = self.moments, self.num_runs
        mean = moments.mean.mean(0)
        low_rank = self.covariance == "low_rank"
        diag = (0.5 if low_rank else 1.0) * moments.variance.mean(0)
        # where SGD never moved (no gradient noise: a weight on an always-zero input) the posterior is the prior
        prior = prior_variances(self.bridge, self.sites, self.layout.unflatten(mean)).to(diag.dtype)
        still = diag < UNMOVED * prior
        diag = torch.where(still, prior, diag)
        self.stats["prior_coordinates"] = int(still.sum())
        columns = []
        if low_rank:
            columns.append((moments.deviations / math.sqrt(2 * (self.rank - 1) * runs)).reshape(-1, self.num_params))
        if runs > 1:
            columns.append((moments.mean - mean) / math.sqrt(runs))
        specs = site_specs(self.bridge, self.sites)
        if not columns:
            joint = JointGaussian.diagonal(specs, mean, diag)
        else:
            factor = torch.cat(columns, 0).mT.contiguous()
            joint = JointGaussian.low_rank_covariance(specs, mean, diag, factor)
        return GaussianPriorModel(self.bridge.model if model is None else model, joint)

    # ------------------------------------------------------------------ predictions and ArviZ
    def predict(
        self,
        *args: Any,
        run: int | None = None,
        link_approx: LinkApprox = "probit",
        num_samples: int = 100,
        seed: int | None = None,
        **kwargs: Any,
    ) -> GLMPredictive:
        r"""The linearised predictive at the model's inputs ``args`` (no ``y``; none: the training data).

        The network linearised at the SWA mean, pushed through SWAG's Gaussian:
        :math:`f \sim \mathcal N(f(x,\bar\theta),\ J\Sigma J^\top)`, then the law of ``y`` (module
        :mod:`pyro_scalable.infer.swag.linearized`). Returns the outputs' ``mean`` ``(points, outputs)``, their
        ``covariance`` ``(points, outputs, outputs)`` and the law of ``y`` (``distribution``), as the Laplace
        posterior's ``predict`` does.

        Args:
            run: which run's Gaussian (MultiSWAG has one linearisation point per run; required when there are
                several — mix the runs' laws yourself, or use :meth:`posterior_predictive` for the mixture).
            link_approx: ``"probit"`` (closed form) or ``"mc"`` (``num_samples`` draws of the outputs per point)
                for classification and count likelihoods; a Normal likelihood is always exact.

        Example:
            >>> import pyro, pyro.distributions as dist, torch
            >>> from pyro_scalable.infer import SWAG
            >>> def model(x, y=None):
            ...     w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            ...     with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
            ...         pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])
            >>> x = torch.randn(500, 2); y = x @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(500)
            >>> posterior = SWAG(model, num_epochs=10, rank=5, seed=0, progress_bar=False).run(x, y)
            >>> prediction = posterior.predict(torch.randn(7, 2))
            >>> prediction.mean.shape, prediction.covariance.shape  # f's mean and J Σ Jᵀ, per point
            (torch.Size([7, 1]), torch.Size([7, 1, 1]))

        """
        check_choice("link_approx", link_approx, ("probit", "mc"))
        check_count("num_samples", num_samples)
        if run is None:
            if self.num_runs > 1:
                raise ValueError(
                    f"predict linearises the network at one SWA mean, and this MultiSWAG posterior has "
                    f"{self.num_runs}: pass run= (0 to {self.num_runs - 1}) for one run's predictive, or call "
                    "posterior_predictive() for the mixture's sampled-weights predictive."
                )
            run = 0
        self._check_run(run)
        return linearized_predictive(
            self,
            run,
            args,
            kwargs,
            link_approx=link_approx,
            num_samples=num_samples,
            generator=self._generator(seed),
        )

    def posterior_predictive(
        self,
        *args: Any,
        num_samples: int = 1000,
        seed: int | None = None,
        return_sites: list[str] | None = None,
        **kwargs: Any,
    ) -> dict[str, Tensor]:
        """``num_samples`` draws of the observed site with sampled weights (Bayesian model averaging).

        ``args``: the model's arguments at new inputs (none: the training data, ``y`` redrawn).
        Returns ``{site: (num_samples, *site shape)}``.
        """
        check_count("num_samples", num_samples)
        generator = self._generator(seed)
        if not args and not kwargs:
            args, kwargs = self.bridge.args, self.bridge.kwargs
        samples = self.bridge.constrain(self.layout.unflatten(self.sample(num_samples, generator)))
        draws_seed = None
        if generator is not None:
            draws_seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
        return sample_posterior_predictive(
            self.bridge.model, samples, *args, seed=draws_seed, return_sites=return_sites, **kwargs
        )

    def to_inference_data(self, num_samples: int = 1000, seed: int | None = None, **kwargs: Any):
        """``num_samples`` draws per run (runs as chains) with the full-data log-likelihood, as ArviZ data.

        Keyword arguments go to :func:`pyro_scalable.to_inference_data` (e.g. ``posterior_predictive=True``).
        """
        return convert(self, num_samples=num_samples, seed=seed, **kwargs)

    def __repr__(self) -> str:
        return (
            f"SWAGPosterior(covariance={self.covariance!r}, runs={self.num_runs}, rank={self.rank}, "
            f"d={self.num_params}, snapshots={self.moments.num_snapshots})"
        )
