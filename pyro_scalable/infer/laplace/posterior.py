r"""The Laplace posterior :math:`\mathcal N(\bar\theta, H^{-1})` of a Pyro model: a guide, its evidence, its predictive.

Around the MAP :math:`\theta_*`, the linearised model has the log-likelihood
:math:`\ell_* + g^\top\delta - \tfrac12\delta^\top G\delta` (:math:`\delta = \theta - \theta_*`, :math:`g` the
full-data gradient, :math:`G` the GGN) and the Gaussian prior :math:`\mathcal N(m, P^{-1})`. With
:math:`r = \theta_* - m`, :math:`H = G + P` and :math:`b = g - P r` (the gradient of the log joint at
:math:`\theta_*`), its evidence is, in closed form,

.. math::

    \log Z(P, \sigma) = \ell_* - \tfrac12 r^\top P r + \tfrac12\log\det P - \tfrac12\log\det H
        + \tfrac12 b^\top H^{-1} b,

and its posterior mean is :math:`\bar\theta = \theta_* + H^{-1} b`. At the prior the MAP was fitted with,
:math:`b = 0` and this is the usual Laplace evidence
:math:`\log p(D\mid\theta_*) + \log p(\theta_*) - \tfrac12\log\det(H/2\pi)`; away from it, the
:math:`b^\top H^{-1} b` term keeps it exact for a linear-Gaussian model instead of evaluating a stale MAP.
That term (and the moved mean) needs a quadratic log-likelihood — a Normal one — and the exact GGN: for
other likelihoods the quadratic extrapolation overstates the evidence far from the fitted prior, and with an
approximate curvature (``diag``, ``kron``,
``low_rank``, or the empirical Fisher) the quadratic model can promise more than the likelihood holds, and the
term grows without bound as :math:`\sigma \to 0`; those structures use the usual formula at :math:`\theta_*`
(:math:`b` left out, the mean kept at :math:`\theta_*`). For a
Normal likelihood with one scalar noise :math:`\sigma` (MAP value :math:`\sigma_0`), :math:`G` and :math:`g` scale
by :math:`\sigma_0^2/\sigma^2` and :math:`\ell_* = -\frac n2\log 2\pi\sigma^2 - \mathrm{SSR}/2\sigma^2`, so the
evidence is also exact in :math:`\sigma`. :meth:`LaplacePosterior.optimize_prior_precision` maximises it by
L-BFGS over :math:`\log P` (scalar, per site or per parameter) and :math:`\log\sigma`
(:mod:`~pyro_scalable.infer.laplace.evidence`).
"""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_scalable.arguments import check_count, check_number, check_tensor
from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer.laplace.curvature import CurvatureError, Precision, Structure
from pyro_scalable.infer.laplace.evidence import LaplaceEvidence, prior_times
from pyro_scalable.infer.laplace.predictive import LaplacePredictives
from pyro_scalable.infer.linearized.ggn import DataFit
from pyro_scalable.infer.linearized.glm import GLMPredictive
from pyro_scalable.infer.linearized.map_check import gauss_newton_gain, warn_not_map
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.record import convert
from pyro_scalable.infer.results import GaussianDraws

__all__ = ["GLMPredictive", "LaplacePosterior"]


class LaplacePosterior(LaplaceEvidence, LaplacePredictives, GaussianDraws):
    """A Gaussian posterior over the Laplace sites; every other latent site held at its MAP value.

    :meth:`posterior_predictive` draws ``y`` at new inputs (linearised by default). Calling it like the model
    (``posterior(*args)``) samples every latent site — it is a Pyro guide, so
    ``Predictive(FullDataModel(model), guide=posterior, num_samples=S)`` gives the sampled-weights predictive (the
    model as written would predict a random minibatch) and
    ``Predictive(posterior.linearized_model, guide=posterior, num_samples=S)`` the linearised one.
    Build it with :meth:`AutoLinearizedLaplace.laplace_approximation`.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import AutoLinearizedLaplace
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        ...     with pyro.plate("data", x.shape[0]):
        ...         pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)
        >>> x = torch.randn(50, 2); y = x @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(50)
        >>> posterior = AutoLinearizedLaplace(model).laplace_approximation(
        ...     x, y, structure="full", map_latents={"w": torch.tensor([1.0, -1.0])}, check_map=False)
        >>> posterior = posterior.optimize_prior_precision("scalar")
        >>> predictive = posterior.predict(x[:3])  # a GLMPredictive
        >>> predictive.covariance.shape, predictive.distribution.batch_shape
        (torch.Size([3, 1, 1]), torch.Size([3]))
        >>> posterior.get_samples(10, seed=0)["w"].shape
        torch.Size([10, 2])

    """

    def __init__(
        self,
        net: NetworkFunction,
        fit: DataFit,
        prior_precision: Tensor,
        prior_mean: Tensor,
        *,
        structure: type[Structure],
        noise_scale: Tensor | None,
        noise_site: str | None,
        jitter: float = 0.0,
        curvature: str = "ggn",
    ):
        self.net, self.fit = net, fit
        self.structure, self._structure = structure.name, structure
        self.theta_star = net.theta_star
        self.prior_mean = prior_mean
        self._map_noise, self._noise_site = noise_scale, noise_site
        self.jitter = jitter
        self.map_search = None  # the mode search that finished the trained point (laplace_approximation's finish_map)
        # the b-term of the evidence and the Newton-moved mean are only sound with the exact GGN (see above)
        self.recenter = structure.exact and curvature == "ggn" and fit.sum_squares is not None
        self._prior_precision = prior_precision
        self._observation_noise = noise_scale
        self._cache: dict[str, Any] = {}

    # ------------------------------------------------------------------ state
    @property
    def bridge(self) -> ModelBridge:
        return self.net.bridge

    @property
    def sites(self) -> list[str]:
        """The Laplace sites (the others are held at their MAP values)."""
        return self.net.layout.names

    @property
    def num_params(self) -> int:
        return self.net.layout.num_params

    @property
    def prior_precision(self) -> Tensor:
        """Diagonal prior precision over the flattened Laplace sites (unconstrained space)."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: Tensor | float) -> None:
        check_tensor("prior_precision", value, nonnegative=True, shape=self.theta_star.shape)
        self._prior_precision = torch.broadcast_to(
            torch.as_tensor(value, dtype=self.theta_star.dtype, device=self.theta_star.device), self.theta_star.shape
        ).clone()
        self._cache.clear()

    @property
    def observation_noise(self) -> Tensor | None:
        """The scalar noise scale σ of a Normal likelihood (``None`` for other likelihoods)."""
        return self._observation_noise

    @observation_noise.setter
    def observation_noise(self, value: Tensor | float) -> None:
        if self._map_noise is None:
            raise ModelError("observation_noise applies to a Normal likelihood with one scalar scale only.")
        check_number("observation_noise", value, positive=True)
        self._observation_noise = torch.as_tensor(value, dtype=self.theta_star.dtype, device=self.theta_star.device)
        self._cache.clear()

    def _scale(self, noise: Tensor | None) -> Tensor | float:
        return 1.0 if noise is None else (self._map_noise / noise) ** 2

    def _precision(self, prior_precision: Tensor, noise: Tensor | None) -> Precision:
        if prior_precision.dim() == 2:  # a correlated prior (as_prior): the jitter on its diagonal
            prior_precision = prior_precision + self.jitter * torch.eye(
                prior_precision.shape[-1], dtype=prior_precision.dtype, device=prior_precision.device
            )
        else:
            prior_precision = prior_precision + self.jitter
        try:
            return self.fit.curvature.precision(prior_precision, self._scale(noise))
        except CurvatureError as error:
            if error.index is not None and error.index.numel():
                names = sorted({self.net.layout.site_of(int(i)) for i in error.index[:100]})
                raise CurvatureError(f"{error} Sites involved: {', '.join(map(repr, names))}.", error.index) from None
            raise

    @property
    def precision(self) -> Precision:
        """The posterior precision :math:`H` in the fitted structure."""
        if "precision" not in self._cache:
            self._cache["precision"] = self._precision(self._prior_precision, self._observation_noise)
        return self._cache["precision"]

    def _log_joint_gradient(self, prior_precision: Tensor, noise: Tensor | None) -> Tensor:
        return self.fit.gradient * self._scale(noise) - prior_times(prior_precision, self.theta_star - self.prior_mean)

    @property
    def mean(self) -> Tensor:
        r"""The posterior mean :math:`\theta_* + H^{-1} b` (flat, unconstrained); the MAP at the fitted prior."""
        if "mean" not in self._cache:
            if self.recenter:
                b = self._log_joint_gradient(self._prior_precision, self._observation_noise)
                self._cache["mean"] = self.theta_star + self.precision.solve(b)
            else:
                self._cache["mean"] = self.theta_star
        return self._cache["mean"]

    # ------------------------------------------------------------------ samples and guide
    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """Flat unconstrained draws of the Laplace sites, ``(num_samples, d)``."""
        check_count("num_samples", num_samples)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        return self.mean + self.precision.sample(num_samples, generator)

    def _all_latents(self, theta: Tensor) -> dict[str, Tensor]:
        batch = theta.shape[:-1]
        fixed = {k: v.expand(batch + v.shape) for k, v in self.net.fixed.items()}
        if self._noise_site is not None and self._observation_noise is not None:
            site = self.bridge.sites[self._noise_site]
            fixed[self._noise_site] = site.transform.inv(self._observation_noise.expand(batch + site.shape))
        return {**fixed, **self.net.layout.unflatten(theta)}

    def _draw(self, num_samples: int, seed: int | None, group_by_chain: bool) -> dict[str, Tensor]:
        # every latent site, the fixed ones repeated; one chain
        generator = None if seed is None else torch.Generator(device=self.theta_star.device).manual_seed(seed)
        draws = self.bridge.constrain(self._all_latents(self.sample(num_samples, generator)))
        return {k: v.unsqueeze(0) for k, v in draws.items()} if group_by_chain else draws

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        values = self.bridge.constrain(self._all_latents(self.sample(1)[0]))
        for name, value in values.items():
            pyro.sample(name, dist.Delta(value, event_dim=value.dim()))
        return values

    def median(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """The constrained values at the posterior mean (the MAP at the fitted prior)."""
        return self.bridge.constrain(self._all_latents(self.mean))

    # ------------------------------------------------------------------ ArviZ
    def to_inference_data(self, num_samples: int = 1000, seed: int | None = None, **kwargs: Any):
        """``num_samples`` posterior draws (chain=1) with the full-data log-likelihood, as ArviZ data.

        Keyword arguments go to :func:`pyro_scalable.to_inference_data` (e.g. ``posterior_predictive=True``).
        """
        return convert(self, num_samples=num_samples, seed=seed, **kwargs)

    def newton_gain(
        self, prior_precision: Tensor | float | None = None, observation_noise: Tensor | float | None = None
    ) -> float:
        r""":math:`b^\top H^{-1} b/2` nats in this structure's :math:`H`, at the given prior and σ (default: current).

        For ``"full"``: the Gauss-Newton gain, by which its evidence exceeds the Laplace evidence at :math:`\theta_*`.
        """
        prior = self._prior_precision if prior_precision is None else prior_precision
        like = {"dtype": self.theta_star.dtype, "device": self.theta_star.device}
        if not (isinstance(prior, Tensor) and prior.dim() == 2):
            prior = torch.broadcast_to(torch.as_tensor(prior, **like), self.theta_star.shape)
        noise = self._observation_noise if observation_noise is None else torch.as_tensor(observation_noise, **like)
        with torch.no_grad():
            b = self._log_joint_gradient(prior, noise)
            return 0.5 * float((b * self._precision(prior, noise).solve(b)).sum())

    def check_map(self, threshold: float = 1.0, *, warn: bool = True) -> float:
        r"""Warn when :math:`\theta_*` is not a MAP: a Gauss-Newton step would gain more than ``threshold`` nats.

        The gain is a lower bound on :math:`\tfrac12 b^\top H^{-1} b` with the *exact* GGN over the full data,
        by conjugate gradients preconditioned with this structure's :math:`H`
        (:mod:`~pyro_scalable.infer.linearized.map_check`; sample-then-optimise checks with the same function).
        Returns it, as far as the iterations went: they stop once a bound decides whether it is above ``threshold``.
        """
        check_number("threshold", threshold, nonnegative=True)
        prior, noise = self._prior_precision, self._observation_noise
        scale = self._scale(noise)
        b = self._log_joint_gradient(prior, noise)

        def matvec(v: Tensor) -> Tensor:
            with torch.no_grad():
                ggn = self.net.ggn_vp(self.theta_star, v.unsqueeze(0)).squeeze(0)
            return scale * ggn + prior_times(prior, v) + self.jitter * v

        floor = (prior + self.jitter).double() if prior.dim() == 1 else None  # H >= P + jitter I (G is psd)
        floor_solve = (lambda r: r / floor) if floor is not None and bool((floor > 0).all()) else None
        gain = gauss_newton_gain(matvec, b, solve=self.precision.solve, floor_solve=floor_solve, threshold=threshold)
        consequence = (
            "The posterior mean is moved by that step (structure='full')."
            if self.recenter
            else "The curvature is taken there, as if it were one."
        )
        if warn:
            warn_not_map(gain, float(b.norm()), consequence, threshold=threshold)
        return gain
