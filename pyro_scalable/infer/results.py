"""The result surface every engine shares: ``pyro.infer.MCMC``'s, so that ArviZ and Pyro users read it as usual.

A run fills one :class:`~.record.RunRecord` (the draws, their statistics, the model as the steps saw it and on the full
data, the model's arguments) and sets it as ``results``. An engine that subclasses :class:`Draws` and has a
``kernel.model`` (the model on the full data) then offers ``get_samples``, ``diagnostics``, ``summary``,
``posterior_predictive``, ``to_inference_data`` and works with ``arviz.from_pyro``; the ArviZ adapter reads the
record, nothing private.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

import torch
from pyro.ops.stats import hpdi
from torch import Tensor

from pyro_scalable.arguments import check_count, check_flag, check_number, check_seed
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer.health import site_diagnostics
from pyro_scalable.infer.predictive import sample_posterior_predictive
from pyro_scalable.infer.record import RunRecord, convert
from pyro_scalable.infer.uncertainty import Uncertainty, draws_uncertainty, linearized_uncertainty

__all__ = ["DEFAULT_DRAWS", "Draws", "FullDataKernel", "GaussianDraws", "RunRecord"]

DEFAULT_DRAWS = 1000  # draws a Gaussian posterior hands out when not told how many


@dataclass
class FullDataKernel:
    """What ``arviz.from_pyro`` reads as ``posterior.kernel`` of an engine with no kernel: the model on the full data.

    Example:
        >>> from pyro_scalable.bridge import FullDataModel
        >>> FullDataKernel(FullDataModel(lambda: None)).model.model is not None
        True

    """

    model: Any


class Draws:
    """Draws of every latent site of a Pyro model, with per-draw statistics (the ``pyro.infer.MCMC`` surface)."""

    kernel: Any
    num_chains: int
    num_samples: int
    draws_device: torch.device
    results: RunRecord | None = None
    independent: bool = False  # the draws are independent, not chains: summary() shows no n_eff or r_hat

    @property
    def bridge(self) -> ModelBridge | None:
        """The model as the steps saw it (``None`` before ``run``)."""
        return None if self.results is None else self.results.bridge

    @property
    def _args(self) -> tuple:
        # read by arviz.from_pyro, as pyro.infer.MCMC's
        return () if self.results is None else self.results.args

    @property
    def _kwargs(self) -> dict:
        return {} if self.results is None else self.results.kwargs

    def __repr__(self) -> str:
        name = type(getattr(self, "kernel", None)).__name__  # (a driver whose arguments were refused has none)
        kernel = "" if name in ("FullDataKernel", "NoneType") else f"{name}, "
        if getattr(self, "results", None) is None:
            return f"{type(self).__name__}({kernel}not run)"
        chains = f"{self.num_chains} chain{'s' if self.num_chains != 1 else ''}"
        return f"{type(self).__name__}({kernel}{chains} x {self.num_samples} draws)"

    def _require_run(self) -> RunRecord:
        if self.results is None:
            raise RuntimeError("call run(...) before asking for results.")
        return self.results

    def run_record(self) -> RunRecord:
        """The record the run filled: what the ArviZ adapter reads (:class:`~.record.RecordSource`)."""
        return self._require_run()

    def get_samples(
        self, num_samples: int | None = None, group_by_chain: bool = False, seed: int | None = None
    ) -> dict[str, Tensor]:
        """Constrained draws, ``(num_chains * num_samples, *shape)``, or ``(num_chains, num_samples, *shape)``.

        Draws are stored unconstrained and mapped through each site's ``biject_to`` transform on request.
        ``num_samples``: that many of the pooled draws, picked at random without replacement (``seed``), as
        ``pyro.infer.MCMC.get_samples(num_samples)`` picks; not with ``group_by_chain``.
        """
        results = self._require_run()
        check_flag("group_by_chain", group_by_chain)
        bridge = results.bridge
        samples = bridge.constrain({k: v.to(bridge.device) for k, v in results.draws.items()})
        samples = {k: v.detach().to(self.draws_device) for k, v in samples.items()}
        if group_by_chain:
            if num_samples is not None:
                raise ValueError("num_samples picks from the pooled draws: leave it out with group_by_chain=True.")
            return samples
        pooled = {k: v.reshape((-1,) + v.shape[2:]) for k, v in samples.items()}
        if num_samples is None:
            return pooled
        total = self.num_chains * self.num_samples
        check_count("num_samples", num_samples)
        check_seed("seed", seed)
        if num_samples > total:
            raise ValueError(f"num_samples={num_samples} is more than the {total} draws this run kept.")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        picked = torch.randperm(total, generator=generator)[:num_samples]
        return {k: v[picked.to(v.device)] for k, v in pooled.items()}

    def get_unconstrained_samples(self, group_by_chain: bool = False) -> dict[str, Tensor]:
        """Draws in the unconstrained space the engine works in."""
        draws = self._require_run().draws
        check_flag("group_by_chain", group_by_chain)
        if group_by_chain:
            return dict(draws)
        return {k: v.reshape((-1,) + v.shape[2:]) for k, v in draws.items()}

    @property
    def sample_stats(self) -> dict[str, Tensor]:
        """Per-draw statistics, each ``(num_chains, num_samples)`` (the engine's: e.g. lp, grad_norm, diverging)."""
        return dict(self._require_run().stats)

    def diagnostics(self) -> dict[str, Any]:
        """Per-site ``n_eff``/``r_hat`` (Pyro's keys) plus ``divergences``: ``{"chain i": [draw indices]}``.

        ``r_hat`` is the rank-normalised split R̂ that ``az.summary`` and the :class:`~.health.HealthWarning` show,
        ``n_eff`` the warning's bulk ESS (:func:`~pyro_scalable.infer.health.site_diagnostics`), of the constrained
        draws. With fewer than 4 draws per chain (parallel SG-MCMC keeps one) they are NaN: split R̂ needs 4, and
        ``arviz.from_pyro`` reads the divergences from here.
        """
        samples = self.get_samples(group_by_chain=True)
        if self.num_samples >= 4:
            result = {name: _diagnostics(value) for name, value in samples.items()}
        else:
            result = {
                name: {"n_eff": _nan(value.shape[2:], value), "r_hat": _nan(value.shape[2:], value)}
                for name, value in samples.items()
            }
        width = len(str(self.num_chains - 1))
        diverging = self._require_run().stats.get(
            "diverging", torch.zeros(self.num_chains, self.num_samples, dtype=torch.bool)
        )
        # zero-padded so that the lexical sort arviz.from_pyro applies keeps chain order past 10 chains
        result["divergences"] = {
            f"chain {c:0{width}d}": diverging[c].nonzero().flatten().tolist() for c in range(self.num_chains)
        }
        return result

    def summary(self, prob: float = 0.9) -> None:
        """Print Pyro's summary table (mean, sd, interval, n_eff, r_hat) and the number of divergences.

        ``n_eff`` and ``r_hat`` as in :meth:`diagnostics`. Independent draws (sample-then-optimise) are no chains:
        their table has no ``n_eff`` or ``r_hat``, and says so.
        """
        check_number("prob", prob, positive=True)
        if not prob < 1:
            raise ValueError(f"prob must be in (0, 1), got {prob!r}.")
        samples = self.get_samples(group_by_chain=True)
        if self.independent:
            _print_summary(samples, prob, chains=False)
            return
        if self.num_samples < 4:
            raise ValueError(
                f"summary needs at least 4 draws per chain (for n_eff and r_hat); this run kept {self.num_samples}. "
                "Use get_samples() or to_inference_data() with arviz.summary(..., kind='stats')."
            )
        _print_summary(samples, prob, chains=True)
        divergences = sum(len(v) for v in self.diagnostics()["divergences"].values())
        print(f"Number of divergences: {divergences}")

    def posterior_predictive(
        self,
        *args: Any,
        group_by_chain: bool = False,
        seed: int | None = None,
        return_sites: list[str] | None = None,
        **kwargs: Any,
    ) -> dict[str, Tensor]:
        """One draw of the observed sites per posterior draw: on the run's full data, or at new inputs ``args``.

        With no arguments the model runs on the data given to ``run`` (its observed values are replaced by draws);
        otherwise on ``args``/``kwargs``, the model's own arguments without ``y`` (new inputs may have any length).
        Each site comes back as ``(num_chains * num_samples, *site shape)``, or ``(num_chains, num_samples, *site
        shape)`` with ``group_by_chain``. See :func:`pyro_scalable.infer.predictive.sample_posterior_predictive`.
        """
        results = self._require_run()
        check_flag("group_by_chain", group_by_chain)
        if not args and not kwargs:
            if results.full_bridge is None:
                raise ValueError(
                    "this run was given no full data (run(batches=...) without the data), so there is nothing to "
                    "predict at: pass the inputs, e.g. posterior_predictive(x, idx=torch.arange(len(x)))."
                )
            args, kwargs = results.args, results.kwargs
        device = results.bridge.device
        samples = {k: v.to(device) for k, v in self.get_samples().items()}
        draws = sample_posterior_predictive(
            results.bridge.model, samples, *args, seed=seed, return_sites=return_sites, **kwargs
        )
        draws = {k: v.to(self.draws_device) for k, v in draws.items()}
        if not group_by_chain:
            return draws
        return {k: v.reshape((self.num_chains, -1) + v.shape[1:]) for k, v in draws.items()}

    def uncertainty(self, *args: Any, site: str | None = None, **kwargs: Any) -> Uncertainty:
        """Total predictive uncertainty at the inputs ``args`` split into aleatoric + epistemic, over the draws.

        Entropy = expected entropy + mutual information for a classifier, the law of total variance otherwise
        (:mod:`pyro_scalable.infer.uncertainty`); ``args`` as for :meth:`posterior_predictive`, none: the run's data.
        """
        results = self._require_run()
        if not args and not kwargs:
            args, kwargs = results.args, results.kwargs
        device = results.bridge.device
        samples = {k: v.to(device) for k, v in self.get_samples().items()}
        return draws_uncertainty(results.bridge.model, samples, *args, site=site, **kwargs)

    def to_inference_data(self, **kwargs: Any):
        """An ``arviz.InferenceData`` with posterior, sample_stats, full-data log_likelihood and observed_data.

        Keyword arguments go to :func:`pyro_scalable.inference_data.to_inference_data`.
        """
        return convert(self, **kwargs)


def _nan(shape: torch.Size, like: Tensor) -> Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype if like.is_floating_point() else torch.float64)


def _diagnostics(value: Tensor) -> dict[str, Tensor]:
    ess, r_hat = site_diagnostics(value)
    dtype = value.dtype if value.is_floating_point() else torch.float64
    return {"n_eff": ess.to(dtype), "r_hat": r_hat.to(dtype)}


def _print_summary(samples: dict[str, Tensor], prob: float, chains: bool) -> None:
    """Pyro's table of ``{site: (chains, draws, *shape)}``: n_eff and r_hat as :meth:`Draws.diagnostics`'s, or none.

    Without ``chains`` the draws are independent: the table has no n_eff or r_hat, and a line says why.
    """
    columns = ["mean", "std", "median", f"{50 * (1 - prob):.1f}%", f"{50 * (1 + prob):.1f}%"]
    columns += ["n_eff", "r_hat"] if chains else []
    rows = []
    for name, value in samples.items():
        flat = value.reshape((-1,) + value.shape[2:])
        if not flat.is_floating_point():
            flat = flat.double()
        figures = [flat.mean(0), flat.std(0), flat.median(0).values, *hpdi(flat, prob=prob)]
        if chains:
            figures += list(_diagnostics(value).values())
        for index in product(*map(range, value.shape[2:])):
            label = name + (f"[{','.join(map(str, index))}]" if index else "")
            rows.append((label, [float(figure[index]) for figure in figures]))
    width = max([10] + [len(label) for label, _ in rows])
    print()
    print(" " * width + "".join(f" {column:>9}" for column in columns))
    for label, figures in rows:
        print(f"{label:>{width}}" + "".join(f" {figure:>9.2f}" for figure in figures))
    print()
    if not chains:
        num_draws = next(iter(samples.values())).shape[:2].numel()
        print(f"{num_draws} independent draws, not Markov chains: no n_eff or r_hat to read.")


class GaussianDraws:
    """The result surface of a Gaussian posterior (Laplace, SWAG, the EKF): independent draws on request.

    A subclass gives ``_draw(num_samples, seed, group_by_chain)`` (constrained draws by site) and ``num_chains``
    (1, or SWAG's runs); this gives ``get_samples``, ``diagnostics`` and ``summary`` with the calls of
    :class:`Draws`, over ``num_samples`` fresh draws (default :data:`DEFAULT_DRAWS`).
    """

    num_chains: int = 1
    bridge: ModelBridge

    def _draw(self, num_samples: int, seed: int | None, group_by_chain: bool) -> dict[str, Tensor]:
        raise NotImplementedError

    def get_samples(
        self, num_samples: int | None = None, group_by_chain: bool = False, seed: int | None = None
    ) -> dict[str, Tensor]:
        """Constrained draws of every latent site, ``(num_samples, *shape)``, or ``(chains, num_samples, *shape)``.

        ``num_samples`` per chain with ``group_by_chain`` (default :data:`DEFAULT_DRAWS`); ``seed`` makes them
        reproducible.
        """
        num_samples = DEFAULT_DRAWS if num_samples is None else num_samples
        check_count("num_samples", num_samples)
        check_flag("group_by_chain", group_by_chain)
        check_seed("seed", seed)
        return self._draw(num_samples, seed, group_by_chain)

    def diagnostics(self, num_samples: int | None = None, seed: int | None = None) -> dict[str, Any]:
        """Per-site ``n_eff``/``r_hat`` of fresh draws (about ``num_samples`` and 1: they are independent).

        The figures of :meth:`Draws.diagnostics`; for independent draws they only confirm that they are.
        """
        samples = self.get_samples(num_samples, group_by_chain=True, seed=seed)
        result: dict[str, Any] = {name: _diagnostics(value) for name, value in samples.items()}
        result["divergences"] = {f"chain {c}": [] for c in range(next(iter(samples.values())).shape[0])}
        return result

    def uncertainty(
        self,
        *args: Any,
        num_samples: int | None = None,
        seed: int | None = None,
        linearized: bool = False,
        site: str | None = None,
        **kwargs: Any,
    ) -> Uncertainty:
        """Total predictive uncertainty at ``args`` split into aleatoric + epistemic (none: the training data).

        ``linearized=False`` runs the model at ``num_samples`` weight draws; ``linearized=True`` splits the
        linearised predictive ``self.predict(*args, **kwargs)`` with ``num_samples`` draws of the outputs
        (:func:`~pyro_scalable.infer.uncertainty.linearized_uncertainty`; exact for a Normal likelihood).
        """
        check_flag("linearized", linearized)
        num_samples = DEFAULT_DRAWS if num_samples is None else num_samples
        if linearized:
            return linearized_uncertainty(self.predict(*args, **kwargs), num_samples=num_samples, seed=seed)
        bridge = self.bridge
        if not args and not kwargs:
            args, kwargs = bridge.args, bridge.kwargs
        samples = {k: v.to(bridge.device) for k, v in self.get_samples(num_samples, seed=seed).items()}
        return draws_uncertainty(bridge.model, samples, *args, site=site, **kwargs)

    def summary(self, prob: float = 0.9, num_samples: int | None = None, seed: int | None = None) -> None:
        """Print Pyro's summary table (mean, sd, interval) of fresh draws: independent, so no n_eff or r_hat."""
        check_number("prob", prob, positive=True)
        if not prob < 1:
            raise ValueError(f"prob must be in (0, 1), got {prob!r}.")
        _print_summary(self.get_samples(num_samples, group_by_chain=True, seed=seed), prob, chains=False)
