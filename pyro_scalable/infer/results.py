"""The result surface every engine shares: ``pyro.infer.MCMC``'s, so that ArviZ and Pyro users read it as usual.

An engine that subclasses :class:`Draws` fills ``_draws`` (unconstrained values, ``(chains, draws, *shape)``),
``_stats`` (``(chains, draws)``), ``bridge``/``_full_bridge``, ``_args``/``_kwargs`` and ``kernel.model`` (the model
on the full data); it then offers ``get_samples``, ``diagnostics``, ``summary``, ``to_inference_data`` and works
with ``arviz.from_pyro``.
"""

from __future__ import annotations

from typing import Any

import torch
from pyro.infer.mcmc.util import diagnostics as pyro_diagnostics
from pyro.infer.mcmc.util import print_summary
from torch import Tensor

from pyro_scalable.arguments import check_flag, check_number
from pyro_scalable.bridge.model import ModelBridge

__all__ = ["Draws"]


class Draws:
    """Draws of every latent site of a Pyro model, with per-draw statistics (the ``pyro.infer.MCMC`` surface)."""

    kernel: Any
    num_chains: int
    num_samples: int
    draws_device: torch.device
    bridge: ModelBridge | None = None
    _full_bridge: ModelBridge | None = None
    _draws: dict[str, Tensor]
    _stats: dict[str, Tensor]

    def _require_run(self) -> ModelBridge:
        if self.bridge is None:
            raise RuntimeError("call run(...) before asking for results.")
        return self.bridge

    def get_samples(self, group_by_chain: bool = False) -> dict[str, Tensor]:
        """Constrained draws, ``(num_chains, num_samples, *shape)``, or ``(num_chains * num_samples, *shape)``.

        Draws are stored unconstrained and mapped through each site's ``biject_to`` transform on request.
        """
        bridge = self._require_run()
        check_flag("group_by_chain", group_by_chain)
        samples = bridge.constrain({k: v.to(bridge.device) for k, v in self._draws.items()})
        samples = {k: v.detach().to(self.draws_device) for k, v in samples.items()}
        if group_by_chain:
            return samples
        return {k: v.reshape((-1,) + v.shape[2:]) for k, v in samples.items()}

    def get_unconstrained_samples(self, group_by_chain: bool = False) -> dict[str, Tensor]:
        """Draws in the unconstrained space the engine works in."""
        self._require_run()
        check_flag("group_by_chain", group_by_chain)
        if group_by_chain:
            return dict(self._draws)
        return {k: v.reshape((-1,) + v.shape[2:]) for k, v in self._draws.items()}

    @property
    def sample_stats(self) -> dict[str, Tensor]:
        """Per-draw statistics, each ``(num_chains, num_samples)`` (the engine's: e.g. lp, grad_norm, diverging)."""
        self._require_run()
        return dict(self._stats)

    def diagnostics(self) -> dict[str, Any]:
        """Pyro's per-site ``n_eff``/``r_hat`` plus ``divergences``: ``{"chain i": [draw indices]}``.

        With fewer than 4 draws per chain (parallel SG-MCMC keeps one) ``n_eff`` and ``r_hat`` are NaN: Pyro's
        split R-hat needs 4, and ``arviz.from_pyro`` reads the divergences from here.
        """
        samples = self.get_samples(group_by_chain=True)
        if self.num_samples >= 4:
            result = pyro_diagnostics(samples)
        else:
            result = {
                name: {"n_eff": _nan(value.shape[2:], value), "r_hat": _nan(value.shape[2:], value)}
                for name, value in samples.items()
            }
        width = len(str(self.num_chains - 1))
        diverging = self._stats.get("diverging", torch.zeros(self.num_chains, self.num_samples, dtype=torch.bool))
        # zero-padded so that the lexical sort arviz.from_pyro applies keeps chain order past 10 chains
        result["divergences"] = {
            f"chain {c:0{width}d}": diverging[c].nonzero().flatten().tolist() for c in range(self.num_chains)
        }
        return result

    def summary(self, prob: float = 0.9) -> None:
        """Print Pyro's summary table (mean, sd, interval, n_eff, r_hat) and the number of divergences."""
        check_number("prob", prob, positive=True)
        if not prob < 1:
            raise ValueError(f"prob must be in (0, 1), got {prob!r}.")
        if self.num_samples < 4:
            raise ValueError(
                f"summary needs at least 4 draws per chain (for n_eff and r_hat); this run kept {self.num_samples}. "
                "Use get_samples() or to_inference_data() with arviz.summary(..., kind='stats')."
            )
        print_summary(self.get_samples(group_by_chain=True), prob=prob)
        divergences = sum(len(v) for v in self.diagnostics()["divergences"].values())
        print(f"Number of divergences: {divergences}")

    def to_inference_data(self, **kwargs: Any):
        """An ``arviz.InferenceData`` with posterior, sample_stats, full-data log_likelihood and observed_data.

        Keyword arguments go to :func:`pyro_scalable.inference_data.to_inference_data`.
        """
        from pyro_scalable.inference_data import to_inference_data

        return to_inference_data(self, **kwargs)


def _nan(shape: torch.Size, like: Tensor) -> Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype if like.is_floating_point() else torch.float64)
