r"""The Pyro bridge: a Pyro model and its data as a log posterior over unconstrained latents.

For latent sites :math:`z_s` with supports :math:`\mathcal{S}_s` and bijections
:math:`t_s = \mathrm{biject\_to}(\mathcal{S}_s): \mathbb{R}^{d_s} \to \mathcal{S}_s`, the engines work on the
unconstrained values :math:`u_s = t_s^{-1}(z_s)` and the density

.. math::

    \log \tilde p(u, \mathcal{B}) = \sum_s \log p(t_s(u_s)) + \log\lvert\det J_{t_s}(u_s)\rvert
        + \frac{N}{B}\sum_{i \in \mathcal{B}} \log p(y_i \mid t(u)),

where the :math:`N/B` comes from the model's own ``pyro.plate(..., subsample_size=B)`` (or ``subsample=idx``)
and is exact in expectation over the minibatch :math:`\mathcal{B}`. This module is the only code that reads
Pyro traces; everything above it sees ``log_posterior(latents, batch) -> scalar``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import pyro
import torch
from pyro.infer.autoguide.initialization import InitMessenger, init_to_uniform
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from torch.distributions import biject_to
from torch.distributions.transforms import ComposeTransform, IndependentTransform, Transform

from pyro_scalable.bridge.checks import (
    ModelError,
    check_inputs,
    check_model,
    checked_init,
    checking_draws,
    explain_invalid_parameters,
    explain_latent_in_plate,
    explain_mixed_tensors,
    explain_sequence_data,
    first_line,
    named_tensors,
    same_support,
    user_stacklevel,
)
from pyro_scalable.bridge.densities import Evaluate
from pyro_scalable.bridge.dtypes import explain_integer_data, refuse_numpy
from pyro_scalable.bridge.log_posterior import PARTS, LogPosterior
from pyro_scalable.bridge.observed import check_observed_values
from pyro_scalable.bridge.plates import FullDataModel, plate_indices
from pyro_scalable.bridge.records import Batch, DataPlate, Latents, LatentSite
from pyro_scalable.bridge.subsampling import data_rows
from pyro_scalable.bridge.traced import TracedLogDensity

__all__ = ["Batch", "DataPlate", "FullDataModel", "LatentSite", "Latents", "LogPosterior", "ModelBridge"]


@contextlib.contextmanager
def _validation(enabled: bool) -> Iterator[None]:
    # Distribution argument checks call bool() on tensors, which vmap cannot batch: the data is checked once,
    # when the bridge is built, and the hot path runs without them.
    with pyro.validation_enabled(enabled):
        yield


def _is_identity(transform: Transform) -> bool:
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return isinstance(transform, ComposeTransform) and not transform.parts


class ModelBridge:
    """A Pyro model bound to its data: unconstrained latents, log posterior, full-data log-likelihood.

    Building the bridge traces the model once and checks it: continuous latents only, no latent
    inside a subsampled plate, at least one observed site, data on one device and finite, and plate sizes that
    agree with the data, observed values inside their likelihood's support (checked over the full data, in
    chunks), and distribution parameters that are valid where the latents are drawn from their prior. Each failure
    is a :class:`ModelError` naming the site or argument. Those prior draws come from ``seed`` (a run passes its
    own), so the checks pass or fail alike on every call with it, and the global RNG is left as it was.
    ``check_values=False`` leaves the support of the observed values to the caller, which must then pass every
    chunk it reads through :func:`~.observed.check_site_values` before it evaluates it (the Laplace pass does).
    """

    def __init__(
        self,
        model: Callable,
        args: tuple = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        seed: int | None = None,
        check_values: bool = True,
    ):
        self.model = model.model if isinstance(model, FullDataModel) else model
        check_model(self.model, args, kwargs)
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        refuse_numpy(self.model, self.args, self.kwargs)  # with the conversion the priors' dtype asks for
        self.device = check_inputs(self.model, self.args, self.kwargs)
        self.values_checked = check_values  # the observed values' support, over the full data (bridge/observed.py)
        with checking_draws(seed, self.device):
            self._check(self._trace(self.model, validate=True))
        sizes = {plate.name: plate.size for plate in self.plates.values()}
        self.traced = TracedLogDensity(self._run_log_posterior, sizes)  # bridge/traced.py
        self.traced_parts = {
            part: TracedLogDensity(partial(self._run_log_posterior, part=part), sizes) for part in PARTS
        }

    def _check(self, trace) -> None:
        self.plates = self._find_plates(trace)
        # plates whose minibatch indices the caller passes (`subsample=idx`, a DataLoader): N/B scaled by Pyro,
        # but no engine draws their indices, so no per-example split of them is possible
        self.given_plates = {
            name: node["fn"].size
            for name, node in trace.nodes.items()
            if site_is_subsample(node) and name not in self.plates and node["value"].shape[0] < node["fn"].size
        }
        self.sites = self._find_latents(trace)
        self.observed = self._find_observed(trace)
        # the plate dims in ``observed`` count from the right of the batch shape, left of these event dims
        self.observed_event_dims = {name: trace.nodes[name]["fn"].event_dim for name in self.observed}
        # the rows every step evaluates where no plate subsamples (bridge/subsampling.py names them once)
        self.data_rows = data_rows(trace, {**{p.name: p.size for p in self.plates.values()}, **self.given_plates})
        if self.device is None:
            self.device = next((v["value"].device for _, v in self._latent_nodes(trace)), torch.device("cpu"))
        self._check_plate_sizes(trace)
        if self.values_checked:
            check_observed_values(self)

    # ------------------------------------------------------------------ discovery and checks
    def _trace(self, model: Callable, *, validate: bool, indices: Mapping[str, Tensor] | None = None):
        context = plate_indices(indices or {})  # also checks every plate's size (plates.py)
        tracer = pyro.poutine.trace(model)
        try:
            with _validation(validate), context:
                return tracer.get_trace(*self.args, **self.kwargs)
        except IndexError as error:
            # On the first trace the plates are not known yet; the partial trace has the plates entered so far.
            plates = getattr(self, "plates", None) or self._find_plates(tracer.msngr.trace)
            sizes = ", ".join(f"'{p.name}' (size {p.size})" for p in plates.values())
            largest = max((p.size for p in plates.values()), default=0)
            short = [
                f"{label} has {t.shape[0]} rows"
                for label, t in named_tensors(self.model, self.args, self.kwargs)
                if t.dim() and t.shape[0] < largest
            ]
            raise ModelError(
                f"indexing the data with the plate's indices failed ({error}){'; ' + ', '.join(short) if short else ''}"
                f"; the plate size must equal the number of data points{': plates ' + sizes if sizes else ''}. "
                "Pass N = len(data) to pyro.plate, and data of one length."
            ) from error
        except (RuntimeError, ValueError, TypeError) as error:
            explain_sequence_data(self.model, self.args, self.kwargs, error)
            if validate:
                explain_invalid_parameters(model, self.args, self.kwargs, tracer.msngr.trace, error)
            explain_latent_in_plate(tracer.msngr.trace, error)
            explain_integer_data(self.model, self.args, self.kwargs, tracer.msngr.trace, error)
            explain_mixed_tensors(tracer.msngr.trace, named_tensors(self.model, self.args, self.kwargs), error)
            raise

    def _latent_nodes(self, trace) -> Iterator[tuple[LatentSite, dict]]:
        for name, site in self.sites.items():
            yield site, trace.nodes[name]

    @staticmethod
    def _find_plates(trace) -> dict[str, DataPlate]:
        plates = {}
        dims = {
            frame.name: frame.dim
            for node in trace.nodes.values()
            if node["type"] == "sample"
            for frame in node["cond_indep_stack"]
        }
        for name, node in trace.nodes.items():
            if site_is_subsample(node):
                size, subsample = node["fn"].size, node["fn"].subsample_size
                if subsample is not None and subsample < size:
                    plates[name] = DataPlate(name, size, subsample, dims.get(name, -1))
        return plates

    def _find_latents(self, trace) -> dict[str, LatentSite]:
        subsampled = {
            name
            for name, node in trace.nodes.items()
            if site_is_subsample(node) and node["value"].shape[0] < node["fn"].size
        }
        params = [name for name, node in trace.nodes.items() if node["type"] == "param"]
        if params:
            warnings.warn(
                f"the model has pyro.param sites {params}; they are held fixed at their current values "
                "(use PyroSample / pyro.sample to give them a prior).",
                stacklevel=user_stacklevel(),
            )
        sites = {}
        self._supports = {}
        for name, node in trace.nodes.items():
            if node["type"] != "sample" or node["is_observed"] or site_is_subsample(node):
                continue
            fn = node["fn"]
            self._supports[name] = fn.support
            if fn.support.is_discrete:
                raise ModelError(
                    f"latent site '{name}' is discrete ({type(fn).__name__}); stochastic-gradient MCMC needs "
                    "continuous latents. Marginalise it out in the model, or observe it."
                )
            for frame in node["cond_indep_stack"]:
                if frame.name in subsampled:
                    raise ModelError(
                        f"latent site '{name}' is inside the subsampled plate '{frame.name}'. If it is meant to "
                        "be observed, its data did not reach it (obs=None): pass the data to run(...), e.g. "
                        "run(x, y) rather than run(x). If it is a latent, Pyro would scale its prior by N/B and "
                        "only a minibatch of it is visited each step: move it out of the plate (a global latent), "
                        "or marginalise it out."
                    )
            value = node["value"]
            if not value.is_floating_point():
                raise ModelError(f"latent site '{name}' has a non-float value ({value.dtype}).")
            try:
                transform = biject_to(fn.support)
            except NotImplementedError:
                raise ModelError(
                    f"latent site '{name}' has support {fn.support}, which has no bijection to unconstrained space "
                    "(torch.distributions.biject_to). Reparametrise it, e.g. a lower-Cholesky factor as "
                    "diag(positive scales) @ LKJCholesky, a covariance matrix from that factor."
                ) from None
            unconstrained = transform.inv(value)
            batch_dims = value.dim() - fn.event_dim
            plates = {batch_dims + f.dim: f.name for f in node["cond_indep_stack"] if batch_dims + f.dim >= 0}
            plates = tuple(plates.get(d) for d in range(value.dim()))
            bijective = not _is_identity(transform)
            sites[name] = LatentSite(name, value.shape, unconstrained.shape, transform, bijective, value.dtype, plates)
        return sites

    def _find_observed(self, trace) -> dict[str, dict[int, str]]:
        observed = {}
        for name, node in trace.nodes.items():
            if node["type"] == "sample" and node["is_observed"] and not node["infer"].get("_deterministic"):
                value = node["value"]
                if isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ModelError(f"observed site '{name}' holds NaN or Inf; drop or mask those points.")
                observed[name] = {frame.dim: frame.name for frame in node["cond_indep_stack"]}
        if not observed:
            raise ModelError(
                "the model has no observed site (no pyro.sample(..., obs=...)); there is no likelihood to "
                "sample from. Pass the data to the model and observe it."
            )
        return observed

    def _check_plate_sizes(self, trace) -> None:
        # Rows that no subsampled plate can reach are never visited. With several plates (rows and columns, a plain
        # outer plate around a subsampled inner one) a tensor may be indexed by any of them, so only rows beyond
        # every plate of the model are an error.
        largest = max(self.plates.values(), key=lambda p: p.size, default=None)
        reach = max(
            (
                f.full_size or f.size
                for node in trace.nodes.values()
                if node["type"] == "sample"
                for f in node["cond_indep_stack"]
                if f.size is not None
            ),
            default=0,
        )
        for label, tensor in named_tensors(self.model, self.args, self.kwargs) if largest is not None else ():
            rows = tensor.shape[0] if tensor.dim() else 0
            if rows > max(largest.size, reach):
                raise ModelError(
                    f"{label} has {rows} rows but plate '{largest.name}' has size {largest.size}; rows beyond "
                    f"{largest.size} would never be visited. Pass N = {rows} to pyro.plate('{largest.name}', N, ...)."
                )
        for plate in self.plates.values():
            last = torch.arange(max(plate.size - plate.subsample_size, 0), plate.size, device=self.device)
            self._trace(self.model, validate=True, indices={plate.name: last})
        for site, node in self._latent_nodes(self._trace(self.model, validate=False)):
            if not same_support(node["fn"].support, self._supports[site.name]):
                raise ModelError(
                    f"latent site '{site.name}' has a support that depends on other latents ({node['fn'].support} "
                    f"in one prior draw, {self._supports[site.name]} in another); the unconstrained space needs a "
                    "fixed support. Sample it on a fixed support and transform it in the model, e.g. "
                    "`x = upper * pyro.sample('x_unit', dist.Beta(a, b))` instead of `dist.Uniform(0, upper)`."
                )
            if self.device is not None and node["value"].device != self.device:
                raise ModelError(
                    f"latent site '{site.name}' is on {node['value'].device} but the data is on {self.device}; "
                    "create its prior's parameters on the data's device, e.g. "
                    "dist.Normal(torch.zeros(d, device=x.device), 1.0)."
                )

    # ------------------------------------------------------------------ the log posterior
    def log_posterior(self, latents: Latents, batch: Batch) -> Tensor:
        """Minibatch estimate of the log joint at unconstrained ``latents`` (N/B scaling by the plates).

        Replayed from a recorded graph of the model's tensor operations once a signature has passed the checks of
        :mod:`pyro_scalable.bridge.traced`; the model runs through Pyro otherwise.
        """
        return self.traced(latents, batch)

    def log_posterior_part(self, part: str, latents: Latents, batch: Batch) -> Tensor:
        """The prior's terms of :meth:`log_posterior` (``"prior"``) or the data's (``"data"``); the two sum to it.

        The prior's are the latent sites' densities and Jacobians, the same on every minibatch; the data's are the
        observed sites', scaled by the plates.
        """
        return self.traced_parts[part](latents, batch)

    @property
    def tracers(self) -> list[TracedLogDensity]:
        """The recorded densities: the log posterior's, then its parts' (a checkpoint keeps their histories)."""
        return [self.traced, *self.traced_parts.values()]

    def _run_log_posterior(self, latents: Latents, batch: Batch, part: str = "") -> Tensor:
        evaluate = Evaluate(self.sites, latents, part=part)
        with _validation(False), plate_indices(batch.indices), evaluate:
            self.model(*batch.args, **batch.kwargs)
        return evaluate.log_joint

    @property
    def log_posterior_fn(self) -> LogPosterior:
        """:meth:`log_posterior` as the engines' ``log_posterior_fn``, able to split a minibatch into examples."""
        return LogPosterior(self)

    def pointwise_log_likelihood(self, latents: Latents, batch: Batch) -> dict[str, Tensor]:
        """Unscaled ``log p(y_i | latents)`` of every observed site, on the data points of ``batch``."""
        evaluate = Evaluate(self.sites, latents, pointwise=True)
        with _validation(False), plate_indices(batch.indices, full_data=True), evaluate:
            self.model(*batch.args, **batch.kwargs)
        return evaluate.log_likelihood

    def trace_at(self, indices: Mapping[str, Tensor]):
        """The model's trace (validation off) with plates at ``indices``, every other subsampled plate in full."""
        with _validation(False), plate_indices(indices, full_data=True):
            return pyro.poutine.trace(self.model).get_trace(*self.args, **self.kwargs)

    def full_batch(self) -> Batch:
        """The batch that is the whole data set (every subsampled plate at all of its indices)."""
        return Batch(
            {p.name: torch.arange(p.size, device=self.device) for p in self.plates.values()}, self.args, self.kwargs
        )

    # ------------------------------------------------------------------ latents
    def init_latents(
        self, num_chains: int, init_strategy: Callable = init_to_uniform, seed: int | None = None
    ) -> Latents:
        """Initial unconstrained latents for each chain, shape ``(num_chains, *site_shape)``, by a Pyro strategy."""
        devices = [self.device.index] if self.device is not None and self.device.type == "cuda" else []
        chains: list[Latents] = []
        shapes = {name: site.shape for name, site in self.sites.items()}
        with torch.random.fork_rng(devices=devices):
            if seed is not None:
                torch.manual_seed(seed)
            for _ in range(num_chains):
                model = InitMessenger(checked_init(init_strategy, shapes, self._supports))(self.model)
                try:
                    with torch.no_grad():
                        trace = self._trace(pyro.poutine.block(model, hide_types=["param"]), validate=False)
                except ModelError as error:  # checked_init's, without the trace's shapes Pyro appends to it
                    raise ModelError(first_line(error)) from None
                chains.append(
                    {name: site.transform.inv(trace.nodes[name]["value"]) for name, site in self.sites.items()}
                )
        return {name: torch.stack([c[name] for c in chains]) for name in self.sites}

    def support(self, name: str):
        """The support of latent site ``name``'s prior (its constraint)."""
        return self._supports[name]

    def constrain(self, latents: Latents) -> Latents:
        """Map unconstrained latents (any leading batch dims) to the model's constrained values."""
        return {name: self.sites[name].transform(value) for name, value in latents.items()}

    def unconstrain(self, values: Latents) -> Latents:
        """Map constrained values (any leading batch dims) to unconstrained latents."""
        return {name: self.sites[name].transform.inv(value) for name, value in values.items()}

    def observed_data(self) -> dict[str, Tensor]:
        """The observed values of every observed site, on the full data."""
        trace = self._trace(FullDataModel(self.model), validate=False)
        return {name: trace.nodes[name]["value"] for name in self.observed}
