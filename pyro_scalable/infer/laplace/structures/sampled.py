r"""The ``"sampled"`` structure: :math:`H^{-1}` represented by posterior samples from sample-then-optimise.

For networks too large for any matrix structure, :class:`~pyro_scalable.infer.SampleThenOptimize` draws
:math:`K` samples :math:`\zeta_j \sim \mathcal N(0, H^{-1})` of the linearised model (the same :math:`H = G + P`
as ``structure="full"``, :math:`G` the GGN at the MAP) using only Jacobian-vector products. The
Laplace posterior then works with their empirical law:

* draws (the guide, ``get_samples``, ``to_inference_data``) are the stored samples, taken without replacement
  while they last (``num_samples`` > K reuses them);
* the GLM predictive covariance is :math:`\frac1K\sum_j (J\zeta_j)(J\zeta_j)^\top` (rank at most :math:`K`;
  :func:`~pyro_scalable.infer.linearized.glm.draws_moments`);
* :math:`Hv` is exact (a GGN-vector product); there is no log-determinant and no linear solve, so the evidence is
  not available — the prior precision is tuned by the sampled EM instead (:meth:`SampledCurvature.tune_prior`,
  which re-runs the engine with MacKay updates, through the engine's public
  :meth:`~pyro_scalable.infer.SampleThenOptimize.rerun_em`).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer.laplace.curvature import CurvatureError, FitRequest
from pyro_scalable.infer.linearized.ggn import DataFit
from pyro_scalable.infer.linearized.glm import Moments, draws_moments
from pyro_scalable.infer.sample_then_optimize import SampleThenOptimize

__all__ = ["SampledCurvature", "SampledPrecision"]

_NO_EVIDENCE = (
    "the 'sampled' structure keeps samples of H^-1, not H: it has no log-determinant or linear solve, so the "
    "Laplace evidence is not available. Tune the prior with posterior.optimize_prior_precision('scalar' or "
    "'site'), which runs the sample-based EM (MacKay updates), or use structure='kron'/'diag'/'low_rank'."
)
_NOT_A_MAP = "the linearisation point is not a MAP"


class SampledCurvature:
    """The data part of :math:`H` seen through a finished :class:`SampleThenOptimize` run at the Laplace MAP."""

    name = "sampled"
    exact = False
    has_evidence = False
    per_parameter_prior = False

    def __init__(self, engine: SampleThenOptimize, prior_precision: Tensor):
        self.engine = engine
        self.prior_precision = prior_precision
        self.num_params = prior_precision.numel()

    @classmethod
    def fit(cls, request: FitRequest) -> DataFit:
        """Run sample-then-optimise on the model linearised at the MAP: ``request.num_samples`` draws."""
        if request.curvature != "ggn":
            raise ValueError("structure='sampled' samples the GGN posterior; curvature='ef' is not available.")
        net, precision = request.net, request.prior_precision
        options = {"num_samples": request.num_samples, "seed": request.seed, **request.sampler_options}
        engine = SampleThenOptimize(
            request.model,
            linearize_at=net.bridge.constrain(request.latents),
            sites=net.layout.names,
            prior_precision=precision,
            **{"progress_bar": False, **options},
        )
        with warnings.catch_warnings():
            if not request.check_map:
                warnings.filterwarnings("ignore", message=_NOT_A_MAP)
            engine.run(*request.args, **request.kwargs)
        plates = net.bridge.plates
        return DataFit(
            curvature=cls(engine, precision),
            log_likelihood=precision.new_zeros(()).fill_(float("nan")),
            gradient=engine.data_gradient,
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
        with warnings.catch_warnings():  # reported (or silenced) when the posterior was built
            warnings.filterwarnings("ignore", message=_NOT_A_MAP)
            self.engine.rerun_em(em_steps, method, prior_precision)
        return type(self)(self.engine, self.engine.solved_prior_precision)

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
        return SampledPrecision(self.engine, self.prior_precision)

    def matvec(self, v: Tensor) -> Tensor:
        net = self.engine.net
        return net.ggn_vp(net.theta_star, v.reshape(-1, self.num_params)).reshape(v.shape)

    def to_dense(self) -> Tensor:
        raise CurvatureError("the 'sampled' structure never forms a d x d matrix; use structure='full' for that.")


class SampledPrecision:
    """:math:`H` with :math:`H^{-1}` known through K samples: draws, inverse diagonal, exact products."""

    def __init__(self, engine: SampleThenOptimize, prior_precision: Tensor):
        self.engine = engine
        self.prior_precision = prior_precision
        self.samples = engine.sample_offsets  # the zero-mean rows zeta_j, (K, d)

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
        net = self.engine.net
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
