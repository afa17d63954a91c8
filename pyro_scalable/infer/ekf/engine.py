r"""``EKF``: the extended Kalman filter over a Pyro model's minibatches, one pass, a Gaussian posterior.

The filter starts at the prior and updates a Gaussian :math:`\mathcal N(m, \Lambda^{-1})` over the flat
unconstrained latents with each minibatch in turn, linearising the model there (the update, iterated to the
minibatch's mode, is in :mod:`~pyro_scalable.infer.ekf.filter`). After the pass it checks the result against the
full data (:mod:`~pyro_scalable.infer.ekf.check`) and warns where the mean or the sds are off.

**Defaults.** The GGN curvature (the Kalman filter's own; the empirical Fisher, ``curvature="ef"``, collapses the
variance where the first minibatch's residuals are large, at the prior's mean, and the later minibatches then move the
mean too little: it can end many posterior sds off, even on a linear-Gaussian model), Gauss-Newton iterations per
minibatch until the step is under ``tolerance`` = 0.01 posterior sds (at most 10), and a **dense** covariance up to
:data:`DENSE_UP_TO` latents: a diagonal one ignores the posterior's correlations, and with the posterior's mean a
hundred of its sds from the prior's, a correlation of :math:`1/\sqrt N` moves the mean several sds. Above it (networks)
the diagonal (``DiagonalEKF``). With the dense filter, a linear-Gaussian model's pass is the Kalman filter, exact; two
episodes through ``as_prior`` are one filter over both data sets.

**The prior** is the starting state: in unconstrained space, the mode of each site's prior (diagonal Newton steps
from its median; a Normal's mean) and the inverse of its curvature there (exact for Normal priors; an error for a
flat one), or a previous posterior's correlated Gaussian (``as_prior``), read whole by the dense filter. The
per-minibatch gradient and curvature come from the linearisation floor (``infer/linearized``): the dense GGN from
the per-example rows of the recorded layers (:math:`\sum_c R_c^\top R_c`, the cheapest exact form at
:math:`d \le` :data:`DENSE_UP_TO`), the diagonal without per-example Jacobians.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Literal

import torch
from pyro.infer.autoguide.initialization import init_to_median, init_to_sample
from torch import Tensor
from tqdm.auto import tqdm

from pyro_scalable.arguments import check_choice, check_count, check_flag, check_number, check_seed
from pyro_scalable.bridge.checks import ModelError, one_subsampled_plate
from pyro_scalable.bridge.model import Batch, FullDataModel, ModelBridge
from pyro_scalable.bridge.outputs import model_outputs
from pyro_scalable.infer.ekf import filter as ekf_filter
from pyro_scalable.infer.ekf.check import check_posterior, warn_check
from pyro_scalable.infer.ekf.posterior import EKFPosterior
from pyro_scalable.infer.gaussian_prior import SiteGaussian, prior_mode, prior_variances
from pyro_scalable.infer.linearized.ggn import GGNDiagonal, fit_chunk
from pyro_scalable.infer.linearized.jacobians import layer_plan
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.linearized.sites import choose_sites, observed_site

__all__ = ["DENSE_UP_TO", "EKF", "DiagonalEKF"]

DENSE_UP_TO = 2048  # covariance="auto": dense up to this many latents (a d x d float64 Cholesky per evaluation)


class EKF:
    r"""The extended Kalman filter over a Pyro model's minibatches, iterated, dense where it fits (module docstring).

    Args:
        model: the Pyro model, its likelihood in ``pyro.plate("data", N, subsample_size=B)``; every latent site
            must feed the likelihood's mean output (a noise scale must be a constant of the model).
        covariance: ``"auto"`` (dense up to :data:`DENSE_UP_TO` latents, diagonal above), ``"dense"`` (the Kalman
            filter's ``d x d`` covariance) or ``"diagonal"`` (``d`` numbers: for networks; it ignores correlations).
        curvature: ``"ggn"`` (the likelihood's expected Fisher: the Kalman filter's own, exact for a
            linear-Gaussian model) or ``"ef"`` (the empirical Fisher :math:`\sum_i g_i g_i^\top`, as
            ``posteriors``' ``ekf.diag_fisher``).
        iterations: evaluations of each minibatch at most: Gauss-Newton steps to its mode (1: the plain EKF).
        tolerance: the iterations stop once a step is shorter than this, in posterior sds.
        transition_sd: :math:`q`, the random-walk sd added to every coordinate before each update (0: static).
        num_epochs: passes over the data. Each pass counts the data again (a second pass is the posterior of the
            data seen twice): keep 1 for the posterior.
        shuffle: visit the minibatches in a random order (``seed``); ``False`` walks the data in its order (a
            time series).
        start: the starting mean: ``"prior"`` (the prior's mode: the Bayesian filter), ``"sample"`` (a draw from
            the prior, with the prior's variance: for a network, whose prior mode — all weights zero — is a saddle
            the filter cannot leave), or a dict of constrained values.
        check_posterior: after the pass, check the mean and the sds against the full data (a gradient pass and a
            few GGN-vector passes; :mod:`~pyro_scalable.infer.ekf.check`) and warn where they are off. Skipped
            with ``transition_sd`` > 0 (the filter then forgets: it is not the static posterior).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import EKF
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        ...     with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        ...         pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(500, 2, generator=g)
        >>> y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.0, -1.0])), generator=g)
        >>> posterior = EKF(model, seed=0, progress_bar=False).run(x, y)
        >>> posterior.covariance, posterior.get_samples(100, seed=0)["w"].shape
        ('dense', torch.Size([100, 2]))
        >>> x_new = torch.randn(300, 2, generator=g)
        >>> y_new = torch.bernoulli(torch.sigmoid(x_new @ torch.tensor([1.0, -1.0])), generator=g)
        >>> later = EKF(posterior.as_prior(), seed=0, progress_bar=False).run(x_new, y_new)
        >>> bool((later.variance < posterior.variance).all())  # more data, narrower
        True

    """

    def __init__(
        self,
        model: Any,
        *,
        covariance: Literal["auto", "dense", "diagonal"] = "auto",
        curvature: Literal["ggn", "ef"] = "ggn",
        iterations: int = 10,
        tolerance: float = 0.01,
        transition_sd: float = 0.0,
        num_epochs: int = 1,
        shuffle: bool = True,
        start: Literal["prior", "sample"] | dict = "prior",
        check_posterior: bool = True,
        seed: int | None = None,
        progress_bar: bool = True,
    ):
        check_choice("covariance", covariance, ("auto", "dense", "diagonal"))
        check_choice("curvature", curvature, ("ggn", "ef"))
        check_count("iterations", iterations)
        check_number("tolerance", tolerance, nonnegative=True)
        check_number("transition_sd", transition_sd, nonnegative=True)
        check_count("num_epochs", num_epochs)
        check_flag("shuffle", shuffle)
        if not isinstance(start, dict):
            check_choice("start", start, ("prior", "sample"))
        check_flag("check_posterior", check_posterior)
        check_seed("seed", seed)
        check_flag("progress_bar", progress_bar)
        self.model = model.model if isinstance(model, FullDataModel) else model
        self.covariance, self.curvature = covariance, curvature
        self.iterations, self.tolerance = iterations, float(tolerance)
        self.transition_sd, self.num_epochs = float(transition_sd), num_epochs
        self.shuffle, self.start, self.check_posterior = shuffle, start, check_posterior
        self.seed, self.progress_bar = seed, progress_bar
        self.stats: dict[str, Any] = {}

    def run(self, *args: Any, **kwargs: Any) -> EKFPosterior:
        """Filter the full data ``args``/``kwargs`` (the model's own arguments); returns the posterior."""
        began = time.perf_counter()
        seed = int(torch.randint(0, 2**62, ())) if self.seed is None else self.seed
        bridge = ModelBridge(FullDataModel(self.model), args, kwargs)
        site = observed_site(bridge, "the EKF")
        plate = one_subsampled_plate(bridge, "the EKF (it walks the data in the plate's minibatches)")
        layout, start, mode, heteroscedastic = self._start(bridge, site, seed)
        dense = self.covariance == "dense" or (self.covariance == "auto" and layout.num_params <= DENSE_UP_TO)
        mean = layout.flatten(start).detach()
        covariance, prior_precision = _prior(bridge, site, layout, mode, dense, mean.dtype)
        net = NetworkFunction(bridge, site, layout, mean, start, heteroscedastic=heteroscedastic)
        generator = torch.Generator(device=bridge.device).manual_seed(seed)
        self.stats = {"covariance": "dense" if dense else "diagonal", "curvature": self.curvature}
        state = self._pass(net, plate, ekf_filter.init(mean, covariance), dense, generator, began)
        self.stats["filter_seconds"] = time.perf_counter() - began
        if self.check_posterior and self.transition_sd == 0:
            checked = time.perf_counter()
            check = check_posterior(
                net, state.mean, state.covariance, mean, prior_precision, epochs=self.num_epochs, generator=generator
            )
            self.stats.update(check._asdict(), check_seconds=time.perf_counter() - checked)
            warn_check(
                check,
                dense=dense,
                curvature=self.curvature,
                iterations=self.iterations,
                batch_size=plate.subsample_size,
            )
        self.stats["seconds"] = time.perf_counter() - began
        return EKFPosterior(bridge, layout, state.mean, state.covariance, dict(self.stats))

    def _pass(
        self, net: NetworkFunction, plate: Any, state: ekf_filter.EKFState, dense: bool, generator, began: float
    ) -> ekf_filter.EKFState:
        """The filter over every minibatch of ``num_epochs`` passes; its counts go to ``stats``."""
        plans, rest = layer_plan(net, state.mean)
        bridge = net.bridge
        evaluations, unsettled, steps = 0, 0, 0
        total = self.num_epochs * -(-plate.size // plate.subsample_size)
        bar = tqdm(total=total, desc="EKF", disable=not self.progress_bar)
        try:
            for _ in range(self.num_epochs):
                if self.shuffle:
                    order = torch.randperm(plate.size, generator=generator, device=bridge.device)
                else:
                    order = torch.arange(plate.size, device=bridge.device)
                for indices in order.split(plate.subsample_size):
                    batch = Batch({plate.name: indices}, bridge.args, bridge.kwargs)
                    evaluate = functools.partial(_batch_terms, net, batch, plans, rest, self.curvature, dense)
                    moved, info = ekf_filter.update(
                        state,
                        evaluate,
                        transition_sd=self.transition_sd,
                        iterations=self.iterations,
                        tolerance=self.tolerance,
                    )
                    if not bool(torch.isfinite(moved.mean).all() and torch.isfinite(moved.covariance).all()):
                        self.stats.update(steps=steps, failed_step=steps + 1, seconds=time.perf_counter() - began)
                        self.state = state
                        raise FloatingPointError(
                            f"the EKF's update at step {steps + 1} is not finite (the gradient or curvature of the "
                            "likelihood at the running mean); the state before it is in ekf.state."
                        )
                    state, steps = moved, steps + 1
                    evaluations += int(info.iterations)
                    unsettled += int(info.step > self.tolerance)
                    bar.update()
        finally:
            bar.close()
        self.state = state
        self.stats.update(
            steps=steps,
            num_epochs=self.num_epochs,
            iterations=self.iterations,
            evaluations=evaluations,
            unsettled=unsettled,  # minibatches whose last Gauss-Newton step was above tolerance
            transition_sd=self.transition_sd,
        )
        return state

    def _start(self, bridge: ModelBridge, site: str, seed: int) -> tuple[ParameterLayout, dict, dict, bool]:
        """The filtered sites' layout, the latents' starting values and prior mode, and if the Normal's scale varies."""
        start = {k: v[0].detach() for k, v in bridge.init_latents(1, init_to_median, seed=seed).items()}
        chosen, heteroscedastic, _, _ = choose_sites(bridge, site, start, None)
        held = [name for name in bridge.sites if name not in chosen]
        if held:
            raise ModelError(
                f"the latent site(s) {held} do not feed the mean of the observed site '{site}' (a noise scale?); the "
                "EKF filters the sites the likelihood's mean depends on. Write them as constants in the model "
                "(e.g. a known noise scale), or use SWAG or SG-MCMC, which sample them."
            )
        mode = {**start, **prior_mode(bridge, chosen, start)}  # the prior's mode (a Normal's mean)
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
        layout = ParameterLayout({name: bridge.sites[name].unconstrained_shape for name in chosen})
        return layout, (mode if self.start == "prior" else start), mode, heteroscedastic


class DiagonalEKF(EKF):
    r"""The EKF with a diagonal covariance (``EKF(model, covariance="diagonal", ...)``): the filter for networks.

    ``d`` numbers of state rather than ``d x d``; it ignores the posterior's correlations, so on a model whose
    latents are correlated a posteriori its sds are too narrow and its mean can be off (the check after the pass
    says so). Every argument but ``covariance`` is :class:`EKF`'s.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import DiagonalEKF
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        ...     with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        ...         pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.eye(3)[torch.arange(600) % 3]  # each point measures one latent: a diagonal posterior
        >>> y = x @ torch.tensor([1.0, -1.0, 0.5]) + 0.5 * torch.randn(600, generator=g)
        >>> posterior = DiagonalEKF(model, seed=0, progress_bar=False).run(x, y)
        >>> posterior.covariance, round(posterior.stats["spread_high"], 3)  # the check: its sds are right
        ('diagonal', 1.0)

    """

    def __init__(self, model: Any, **kwargs: Any):
        if "covariance" in kwargs:
            raise TypeError("DiagonalEKF is the EKF with covariance='diagonal'; pass covariance= to EKF instead.")
        super().__init__(model, covariance="diagonal", **kwargs)


def _prior(
    bridge: ModelBridge, site: str, layout: ParameterLayout, mode: dict, dense: bool, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The filter's starting covariance from the prior at its ``mode``, and the prior's precision (for the check).

    The covariance is ``(d, d)`` float64 (dense) or the variances ``(d,)``; the precision ``(d,)`` for a factorised
    prior, ``(d, d)`` where the dense filter reads a correlated one.
    """
    variance = prior_variances(bridge, layout.names, mode)
    if not bool(torch.isfinite(variance).all()):
        flat = sorted({layout.site_of(int(i)) for i in (~torch.isfinite(variance)).nonzero().flatten()[:50]})
        raise ModelError(
            f"the prior of latent site(s) {flat} has no positive curvature at its mode (a flat or improper "
            "prior): the filter starts from the prior. Give them a proper prior."
        )
    if not dense:  # a correlated prior's diagonal: each coordinate's variance given the others
        return variance.to(dtype), variance.reciprocal().to(dtype)
    covariance = torch.diag(variance.double())
    indices = {p: torch.zeros(1, dtype=torch.long, device=bridge.device) for p in bridge.plates}
    priors = model_outputs(bridge, mode, Batch(indices, bridge.args, bridge.kwargs), site=site).priors
    joints = {id(fn.joint): fn.joint for fn in priors.values() if isinstance(fn, SiteGaussian)}
    if not joints:
        return covariance, variance.reciprocal().to(dtype)
    for joint in joints.values():  # a previous dense posterior (as_prior): its correlations, whole
        slots = [layout.slots[s.name] for s in joint.sites]
        index = torch.cat([torch.arange(slot.start, slot.stop, device=bridge.device) for slot in slots])
        covariance[index[:, None], index] = joint.covariance_matrix().double()
    return covariance, torch.cholesky_inverse(torch.linalg.cholesky(covariance))


def _batch_terms(
    net: NetworkFunction, batch: Batch, plans, rest: Tensor, curvature: str, dense: bool, theta: Tensor
) -> ekf_filter.BatchTerms:
    """The minibatch's log-likelihood at ``theta``, its gradient and its GGN (or empirical Fisher): dense or diag."""
    chunk, log_prob, gradient = fit_chunk(net, theta, batch, plans, rest, curvature)
    if dense:  # the rows of every column of the roots, stacked: G = RᵀR
        terms = torch.cat([chunk.rows(grads, rest_rows).double() for grads, rest_rows in chunk.columns()])
    else:
        accumulator = GGNDiagonal()
        accumulator.start(net, theta, plans, rest)
        accumulator.accumulate(chunk)
        terms = accumulator.finish(chunk.f.shape[0])
    return ekf_filter.BatchTerms(log_prob.detach(), gradient.detach(), terms.detach())
