r"""The ``"sampled"`` structure: :math:`H^{-1}` represented by posterior samples from sample-then-optimise.

For networks too large for any matrix structure, the linearisation floor's sample-then-optimise solver
(:func:`~pyro_scalable.infer.linearized.sampling.sample_linearized`, the one ``SampleThenOptimize`` runs) draws
:math:`K` samples :math:`\zeta_j \sim \mathcal N(0, H^{-1})` of the linearised model (the same :math:`H = G + P` as
``structure="full"``, :math:`G` the GGN at the MAP) using only Jacobian-vector products. The Laplace posterior
then works with their empirical law:

* draws (the guide, ``get_samples``, ``to_inference_data``) are the stored samples, taken without replacement
  while they last (``num_samples`` > K reuses them);
* the GLM predictive covariance is :math:`\frac1K\sum_j (J\zeta_j)(J\zeta_j)^\top` (rank at most :math:`K`;
  :func:`~pyro_scalable.infer.linearized.glm.draws_moments`);
* :math:`Hv` is exact (a GGN-vector product); there is no log-determinant and no linear solve, so the evidence is
  not available — the prior precision is tuned by the sampled EM instead (:meth:`SampledCurvature.tune_prior`,
  which solves again with MacKay updates from the same seed).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer.laplace.curvature import CurvatureError, FitRequest
from pyro_scalable.infer.linearized.ggn import DataFit
from pyro_scalable.infer.linearized.glm import Moments, draws_moments
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.linearized.sampling import (
    Solution,
    SolveSettings,
    check_settings,
    is_linear_gaussian,
    sample_linearized,
)
from pyro_scalable.infer.linearized.sites import choose_sites

__all__ = ["SampledCurvature", "SampledPrecision", "SampledRun"]

_NO_EVIDENCE = (
    "the 'sampled' structure keeps samples of H^-1, not H: it has no log-determinant or linear solve, so the "
    "Laplace evidence is not available. Tune the prior with posterior.optimize_prior_precision('scalar' or "
    "'site'), which runs the sample-based EM (MacKay updates), or use structure='kron'/'diag'/'low_rank'."
)
_NOT_A_MAP = "the linearisation point is not a MAP"
# the solver's settings a user may give; the draws' number and the prior are the Laplace fit's own arguments
_OPTIONS = set(SolveSettings.__dataclass_fields__) - {"num_samples", "prior_precision", "map_found"}


@dataclass
class SampledRun:
    """One sample-then-optimise solve at the Laplace MAP: what it was asked, and the :class:`Solution` it gave.

    ``net`` is the solve's own network function (an EM fit of a Normal's noise scale changes it, not the Laplace
    fit's); :meth:`again` solves anew from the same seed, so that only the changed settings change the draws.
    """

    request: FitRequest
    settings: SolveSettings
    chunk_size: int | None
    net: NetworkFunction
    solution: Solution

    @classmethod
    def solve(cls, request: FitRequest, settings: SolveSettings, chunk_size: int | None) -> SampledRun:
        """Solve on ``request``'s model linearised at its MAP, seeded by ``request.seed``."""
        fit = request.net
        bridge, site, latents = fit.bridge, fit.site, request.latents
        chosen = fit.layout.names
        _, heteroscedastic, noise_site, noise = choose_sites(bridge, site, latents, chosen)
        generator = torch.Generator(device=bridge.device).manual_seed(request.seed)
        linear_gaussian = is_linear_gaussian(bridge, site, chosen, latents, generator)
        theta = request.theta
        net = NetworkFunction(
            bridge, site, fit.layout, theta, latents, heteroscedastic=heteroscedastic, chunk_size=chunk_size
        )
        options = dict(parallel=None, noise=noise, linear_gaussian=linear_gaussian, noise_site=noise_site)
        solution = sample_linearized(net, theta, settings, generator, **options)
        return cls(request, settings, chunk_size, net, solution)

    def again(self, **changes: Any) -> SampledRun:
        """The same solve with ``changes`` to its settings."""
        return self.solve(self.request, replace(self.settings, **changes), self.chunk_size)


class SampledCurvature:
    """The data part of :math:`H` seen through sample-then-optimise draws at the Laplace MAP."""

    name = "sampled"
    exact = False
    has_evidence = False
    per_parameter_prior = False

    def __init__(self, run: SampledRun, prior_precision: Tensor):
        self.run = run
        self.prior_precision = prior_precision
        self.num_params = prior_precision.numel()

    @property
    def em_history(self) -> dict[str, Any]:
        """Every EM step's prior precision and effective dimension per group, as ``SampleThenOptimize`` keeps it."""
        solution = self.run.solution
        return {
            "groups": solution.group_names,
            "prior_precision": torch.stack(solution.alphas),
            "effective_dimension": torch.stack(solution.gammas),
        }

    @classmethod
    def fit(cls, request: FitRequest) -> DataFit:
        """Sample-then-optimise on the model linearised at the MAP: ``request.num_samples`` draws.

        ``request.sampler_options`` are the solver's settings (``num_epochs``, ``step_size``, ``em_steps``, ...;
        see ``SampleThenOptimize``), ``chunk_size`` (points per full-data pass) and ``progress_bar`` (default off).
        """
        if request.curvature != "ggn":
            raise ValueError("structure='sampled' samples the GGN posterior; curvature='ef' is not available.")
        options = {"progress_bar": False, **request.sampler_options}
        chunk_size = options.pop("chunk_size", None)
        unknown = sorted(set(options) - _OPTIONS - {"seed"})
        if unknown:
            raise TypeError(f"sampler_options {unknown} are not settings of the sampler; it takes {sorted(_OPTIONS)}.")
        seed = options.pop("seed", request.seed)
        check_settings(num_samples=request.num_samples, **options)
        precision = request.prior_precision
        settings = SolveSettings(num_samples=request.num_samples, prior_precision=precision, **options)
        with warnings.catch_warnings():
            if not request.check_map:
                warnings.filterwarnings("ignore", message=_NOT_A_MAP)
            run = SampledRun.solve(replace(request, seed=seed), settings, chunk_size)
        plates = request.net.bridge.plates
        return DataFit(
            curvature=cls(run, precision),
            log_likelihood=precision.new_zeros(()).fill_(float("nan")),
            gradient=run.solution.gradient,
            num_points=next(iter(plates.values())).size if plates else 1,
            layers=[],
            rest=torch.zeros(0, dtype=torch.long, device=precision.device),
        )

    def tune_prior(
        self, method: str, observation_noise: bool | None, em_steps: int, prior_precision: Tensor
    ) -> SampledCurvature:
        """``em_steps`` MacKay updates of the prior (``"scalar"`` or ``"site"``) from ``prior_precision`` on."""
        if method not in ("scalar", "site"):
            raise ValueError(
                f"structure='sampled' tunes the prior by EM with method 'scalar' or 'site', not {method!r}."
            )
        if observation_noise:
            raise ModelError("structure='sampled' keeps the observation noise fixed; pass observation_noise=False.")
        check_settings(em_steps=em_steps, em_groups=method)
        with warnings.catch_warnings():  # reported (or silenced) when the posterior was built
            warnings.filterwarnings("ignore", message=_NOT_A_MAP)
            run = self.run.again(em_steps=int(em_steps), em_groups=method, prior_precision=prior_precision)
        return type(self)(run, run.solution.precision)

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> SampledPrecision:
        same_prior = prior_precision.shape == self.prior_precision.shape and bool(
            torch.allclose(prior_precision, self.prior_precision, rtol=1e-12, atol=0)
        )
        if not same_prior or not bool(torch.all(torch.as_tensor(scale) == 1)):
            raise CurvatureError(
                "the samples of the 'sampled' structure were drawn for one prior precision (and noise); another "
                "needs new samples: call posterior.optimize_prior_precision(...) (sampled EM), or fit again with "
                "prior_precision=... ." + (" (jitter is not supported here.)" if not same_prior else "")
            )
        return SampledPrecision(self.run, self.prior_precision)

    def matvec(self, v: Tensor) -> Tensor:
        net = self.run.net
        return net.ggn_vp(net.theta_star, v.reshape(-1, self.num_params)).reshape(v.shape)

    def to_dense(self) -> Tensor:
        raise CurvatureError("the 'sampled' structure never forms a d x d matrix; use structure='full' for that.")


class SampledPrecision:
    """:math:`H` with :math:`H^{-1}` known through K samples: draws, inverse diagonal, exact products."""

    def __init__(self, run: SampledRun, prior_precision: Tensor):
        self.run = run
        self.prior_precision = prior_precision
        self.samples = run.solution.state.samples[:-1].detach()  # the zero-mean rows zeta_j, (K, d)

    @property
    def num_samples(self) -> int:
        return self.samples.shape[0]

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        k = self.num_samples
        rounds = -(-num_samples // k)
        order = torch.cat([torch.randperm(k, generator=generator, device=self.samples.device) for _ in range(rounds)])
        return self.samples[order[:num_samples]]

    def inverse_diagonal(self) -> Tensor:
        return (self.samples**2).mean(0)

    def matvec(self, v: Tensor) -> Tensor:
        net = self.run.net
        flat = v.reshape(-1, self.samples.shape[-1])
        return (net.ggn_vp(net.theta_star, flat) + self.prior_precision * flat).reshape(v.shape)

    def logdet(self) -> Tensor:
        raise CurvatureError(_NO_EVIDENCE)

    def solve(self, v: Tensor) -> Tensor:
        raise CurvatureError(_NO_EVIDENCE)

    def to_dense(self) -> Tensor:
        raise CurvatureError("the 'sampled' structure never forms a d x d matrix; use structure='full' for that.")

    def functional_covariance(self, net, theta: Tensor, batch, plans, rest: Tensor) -> Moments:
        r"""``f`` and the Monte-Carlo :math:`J H^{-1} J^\top` on ``batch``: ``(points, outputs[, outputs])``."""
        return draws_moments(net, theta.detach(), self.samples, batch)
