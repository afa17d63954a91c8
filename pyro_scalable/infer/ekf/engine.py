r"""``DiagonalEKF``: the extended Kalman filter with a diagonal covariance, streaming over a model's minibatches.

Ollivier (2018, "Online natural gradient as a Kalman filter") shows that the extended Kalman filter on the
parameters of a static model is online natural-gradient descent. With the Gaussian state
:math:`\mathcal N(m, \mathrm{diag}(v))` over the flat unconstrained latents, started at the prior, and the data
arriving in minibatches :math:`B_t` (each data point once per pass), one step is

.. math::

    v &\leftarrow v + q^2 \quad\text{(predict; } q = \texttt{transition\_sd}\text{, 0: the parameters do not drift)}\\
    F &= \mathrm{diag}\textstyle\sum_{i\in B_t} J_i^\top \Lambda_i J_i \quad\text{(the GGN of the batch's
    likelihood at } m\text{; } \texttt{curvature="ef"}\text{: } \textstyle\sum_i g_i^2\text{)}\\
    v &\leftarrow (v^{-1} + F)^{-1}, \qquad
    m \leftarrow m + v \odot \textstyle\sum_{i\in B_t} \nabla\log p(y_i\mid m).

For a model linear in its latents, with a Normal likelihood and a posterior whose precision is diagonal (one
latent, or orthogonal features), this is the Kalman filter, and one pass gives the exact posterior (the gold
test). Otherwise the diagonal and the linearisation at the running mean are approximations, which the order of
the minibatches affects. The default is the empirical Fisher, as in `posteriors`' ``ekf.diag_fisher``: its
:math:`F \ge (\sum_i g_i)^2/B` bounds each step, where the GGN's gain does not (on a network, the GGN filter's
first steps can throw the weights far from the data's fit).

The prior enters only as the starting state: the mode of the prior in unconstrained space (diagonal Newton steps
from its median; a Normal's mean) and, per coordinate, the inverse of the prior's curvature there (exact for
Normal priors; an error for a flat one). The per-batch gradient and GGN
diagonal come from the linearisation floor (``infer/linearized``: one forward, one backward and one product per
layer and output, no per-example Jacobian for recognised layers). The result is an :class:`EKFPosterior`, with the
surface of the SWAG posterior (draws, guide, predictives, ArviZ) and ``as_prior`` for the next episode.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
from pyro.infer.autoguide.initialization import init_to_median, init_to_sample
from torch import Tensor
from tqdm.auto import tqdm

from pyro_scalable.arguments import check_choice, check_count, check_flag, check_number, check_seed
from pyro_scalable.bridge.checks import ModelError, one_subsampled_plate
from pyro_scalable.bridge.model import Batch, FullDataModel, ModelBridge
from pyro_scalable.infer.gaussian_prior import (
    GaussianPriorModel,
    JointGaussian,
    prior_mode,
    prior_variances,
    site_specs,
)
from pyro_scalable.infer.linearized.ggn import GGNDiagonal, fit_chunk
from pyro_scalable.infer.linearized.jacobians import layer_plan
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.network import NetworkFunction, choose_sites, observed_site
from pyro_scalable.infer.swag.moments import SWAGMoments
from pyro_scalable.infer.swag.posterior import SWAGPosterior

__all__ = ["DiagonalEKF", "EKFPosterior"]


class EKFPosterior(SWAGPosterior):
    """The filter's diagonal Gaussian over every latent site (unconstrained), with the SWAG posterior's surface.

    ``get_samples``, the Pyro guide (``Predictive(FullDataModel(model), guide=posterior)``), ``posterior_predictive``,
    the linearised ``predict``, ``to_inference_data`` and ``as_prior``. ``stats`` records the steps and the time.
    """

    def as_prior(self, model: Any = None) -> GaussianPriorModel:
        r"""The model with :math:`\mathcal N(m, \mathrm{diag}(v))` as its prior: Pyro Normals every engine reads.

        The next episode's ``DiagonalEKF`` on it continues the filter where this one stopped.
        """
        specs = site_specs(self.bridge, self.sites)
        joint = JointGaussian.diagonal(specs, self.mean[0], self.variance[0])
        return GaussianPriorModel(self.bridge.model if model is None else model, joint)


class DiagonalEKF:
    r"""The diagonal extended Kalman filter over a Pyro model's minibatches (module docstring).

    Args:
        model: the Pyro model, its likelihood in ``pyro.plate("data", N, subsample_size=B)``; every latent site
            must feed the likelihood's mean output (a noise scale must be a constant of the model).
        transition_sd: :math:`q`, the random-walk sd added to every coordinate before each update (0: static).
        num_epochs: passes over the data. Each pass counts the data again (a second pass is the posterior of the
            data seen twice): keep 1 for the posterior.
        curvature: ``"ef"`` (the empirical Fisher :math:`\sum_i g_i^2`, as ``posteriors``' ``ekf.diag_fisher``:
            it bounds each step) or ``"ggn"`` (the likelihood's expected Fisher: the Kalman filter's own, exact for
            a linear-Gaussian model).
        shuffle: visit the minibatches in a random order (``seed``); ``False`` walks the data in its order (a
            time series).
        start: the starting mean: ``"prior"`` (the prior's mode: the Bayesian filter, exact where the module
            docstring says), ``"sample"`` (a draw from the prior, with the prior's variance: for a network, whose
            prior mode — all weights zero — is a saddle the filter cannot leave), or a dict of constrained values.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import DiagonalEKF
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        ...     with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        ...         pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])
        >>> x = torch.randn(500, 2); y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.0, -1.0])))
        >>> posterior = DiagonalEKF(model, seed=0, progress_bar=False).run(x, y)
        >>> posterior.get_samples(100, seed=0)["w"].shape
        torch.Size([100, 2])
        >>> x_new = torch.randn(300, 2); y_new = torch.bernoulli(torch.sigmoid(x_new @ torch.tensor([1.0, -1.0])))
        >>> later = DiagonalEKF(posterior.as_prior(), seed=0, progress_bar=False).run(x_new, y_new)
        >>> bool((later.variance < posterior.variance).all())  # more data, narrower
        True

    """

    def __init__(
        self,
        model: Any,
        *,
        transition_sd: float = 0.0,
        num_epochs: int = 1,
        curvature: Literal["ggn", "ef"] = "ef",
        shuffle: bool = True,
        start: Literal["prior", "sample"] | dict = "prior",
        seed: int | None = None,
        progress_bar: bool = True,
    ):
        check_number("transition_sd", transition_sd, nonnegative=True)
        check_count("num_epochs", num_epochs)
        check_choice("curvature", curvature, ("ggn", "ef"))
        check_flag("shuffle", shuffle)
        if not isinstance(start, dict):
            check_choice("start", start, ("prior", "sample"))
        check_seed("seed", seed)
        check_flag("progress_bar", progress_bar)
        self.model = model.model if isinstance(model, FullDataModel) else model
        self.transition_sd, self.num_epochs, self.curvature = float(transition_sd), num_epochs, curvature
        self.shuffle, self.start, self.seed, self.progress_bar = shuffle, start, seed, progress_bar
        self.stats: dict[str, Any] = {}

    def run(self, *args: Any, **kwargs: Any) -> EKFPosterior:
        """Filter the full data ``args``/``kwargs`` (the model's own arguments); returns the posterior."""
        began = time.perf_counter()
        seed = int(torch.randint(0, 2**62, ())) if self.seed is None else self.seed
        bridge = ModelBridge(FullDataModel(self.model), args, kwargs)
        site = observed_site(bridge, "the diagonal EKF")
        plate = one_subsampled_plate(bridge, "the diagonal EKF (it walks the data in the plate's minibatches)")
        start = {k: v[0].detach() for k, v in bridge.init_latents(1, init_to_median, seed=seed).items()}
        chosen, heteroscedastic, _, _ = choose_sites(bridge, site, start, None)
        held = [name for name in bridge.sites if name not in chosen]
        if held:
            raise ModelError(
                f"the latent site(s) {held} do not feed the mean of the observed site '{site}' (a noise scale?); the "
                "diagonal EKF filters the sites the likelihood's mean depends on. Write them as constants in the model "
                "(e.g. a known noise scale), or use SWAG or SG-MCMC, which sample them."
            )
        mode = {**start, **prior_mode(bridge, chosen, start)}  # the prior's mode (a Normal's mean)
        variance_at = mode
        if self.start == "sample":
            start = {k: v[0].detach() for k, v in bridge.init_latents(1, init_to_sample, seed=seed).items()}
        elif isinstance(self.start, dict):
            missing = sorted(set(chosen) - set(self.start))
            if missing:
                raise ModelError(f"start lacks the latent site(s) {missing}.")
            values = {
                n: torch.as_tensor(self.start[n], dtype=bridge.sites[n].dtype, device=bridge.device) for n in chosen
            }
            start = {**start, **{k: v.detach() for k, v in bridge.unconstrain(values).items()}}
        else:
            start = mode
        layout = ParameterLayout({name: bridge.sites[name].unconstrained_shape for name in chosen})
        mean = layout.flatten(start).detach()
        variance = prior_variances(bridge, chosen, variance_at).to(mean.dtype)
        if not bool(torch.isfinite(variance).all()):
            flat = sorted({layout.site_of(int(i)) for i in (~torch.isfinite(variance)).nonzero().flatten()[:50]})
            raise ModelError(
                f"the prior of latent site(s) {flat} has no positive curvature at its mode (a flat or improper "
                "prior): the filter starts from the prior. Give them a proper prior."
            )
        net = NetworkFunction(bridge, site, layout, mean, start, heteroscedastic=heteroscedastic)
        plans, rest = layer_plan(net, mean)
        generator = torch.Generator(device=bridge.device).manual_seed(seed)
        per_epoch = -(-plate.size // plate.subsample_size)
        total, step = self.num_epochs * per_epoch, 0
        bar = tqdm(total=total, desc="EKF", disable=not self.progress_bar)
        try:
            for _ in range(self.num_epochs):
                if self.shuffle:
                    order = torch.randperm(plate.size, generator=generator, device=bridge.device)
                else:
                    order = torch.arange(plate.size, device=bridge.device)
                for indices in order.split(plate.subsample_size):
                    batch = Batch({plate.name: indices}, bridge.args, bridge.kwargs)
                    predicted = variance + self.transition_sd**2
                    gradient, fisher = _batch_terms(net, mean, batch, plans, rest, self.curvature)
                    updated = (predicted.reciprocal() + fisher).reciprocal()
                    moved = mean + updated * gradient
                    if not bool(torch.isfinite(moved).all() and torch.isfinite(updated).all()):
                        self.stats = {"steps": step, "failed_step": step + 1, "seconds": time.perf_counter() - began}
                        self.state = (mean, variance)
                        raise FloatingPointError(
                            f"the EKF's update at step {step + 1} is not finite (the gradient or curvature of the "
                            "likelihood at the running mean); the state before it is in ekf.state."
                        )
                    mean, variance, step = moved.detach(), updated.detach(), step + 1
                    bar.update()
        finally:
            bar.close()
        self.state = (mean, variance)
        self.stats = {
            "steps": step,
            "num_epochs": self.num_epochs,
            "curvature": self.curvature,
            "transition_sd": self.transition_sd,
            "seconds": time.perf_counter() - began,
        }
        moments = SWAGMoments(mean[None], variance[None], mean.new_zeros(1, 0, mean.numel()), step)
        return EKFPosterior(bridge, layout, moments, "diagonal", dict(self.stats))


def _batch_terms(net: NetworkFunction, theta: Tensor, batch: Batch, plans, rest, curvature: str) -> tuple[Tensor, ...]:
    """The gradient of the batch's log-likelihood at ``theta`` and the diagonal of its GGN (or empirical Fisher)."""
    chunk, _, gradient = fit_chunk(net, theta, batch, plans, rest, curvature)
    accumulator = GGNDiagonal()
    accumulator.start(net, theta, plans, rest)
    accumulator.accumulate(chunk)
    return gradient.detach(), accumulator.finish(chunk.f.shape[0]).detach()
