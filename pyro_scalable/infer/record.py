"""What a run leaves behind, and the two ways a result hands it to the ArviZ adapter: the record and its protocols.

:class:`RunRecord` holds a run's draws and statistics, the model they belong to and its data. The adapter
(:mod:`pyro_scalable.sources`, :mod:`pyro_scalable.inference_data`) reads results through two protocols and imports
no engine: a run that keeps draws (:class:`RecordSource`: ``run_record()``), and a Gaussian posterior that draws on
request (:class:`GaussianSource`: ``bridge``, ``num_chains``, ``get_samples``).

The adapter sits above the results, so a result's ``to_inference_data()`` does not import it: it calls
:func:`convert`, which hands the result to the converter the adapter registered with :func:`register_converter`
when it was imported (``import pyro_scalable`` imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from pyro_scalable.bridge.model import ModelBridge

__all__ = ["GaussianSource", "RecordSource", "RunRecord", "convert", "register_converter"]


@dataclass
class RunRecord:
    """What a run leaves behind: its draws and their statistics, the model they belong to, and its data.

    ``draws`` are unconstrained, ``(chains, draws, *site shape)``; ``stats`` are ``(chains, draws)``. ``bridge`` is
    the model as the steps saw it (it maps the draws to constrained values); ``full_bridge`` the model on all the
    data, for the full-data log-likelihood and observed data (``None`` where a DataLoader run was given no full
    data). ``args``/``kwargs`` are the model's arguments on the full data.
    """

    bridge: ModelBridge
    full_bridge: ModelBridge | None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    draws: dict[str, Tensor] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)
    pinned: torch.device | None = None  # the GPU whose draws are copied into page-locked memory without waiting

    def allocate(self, latents: dict[str, Tensor], num_samples: int, device: torch.device) -> None:
        """Empty buffers on ``device`` for ``num_samples`` draws of each chain in ``latents`` (statistics: on use).

        Draws from a GPU kept on the CPU go to page-locked memory: each step's copy is then queued without waiting
        for the device (a copy to ordinary memory would wait for it on every kept step); :meth:`settle` waits.

        Example:
            >>> from collections import namedtuple
            >>> record = RunRecord(bridge=None, full_bridge=None)
            >>> record.allocate({"w": torch.zeros(2, 3)}, num_samples=4, device=torch.device("cpu"))
            >>> Info = namedtuple("Info", "log_posterior")
            >>> record.record(0, {"w": torch.ones(2, 3)}, Info(torch.tensor([-1.0, -2.0])))
            >>> record.settle()
            >>> record.draws["w"].shape, record.stats["lp"][:, 0]
            (torch.Size([2, 4, 3]), tensor([-1., -2.]))

        """
        first = next(iter(latents.values()))
        self.pinned = first.device if first.is_cuda and device.type == "cpu" else None
        shape = (first.shape[0], num_samples)
        self.draws = {name: self._empty(shape + x.shape[1:], x.dtype, device) for name, x in latents.items()}
        self.stats = {}

    def _empty(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
        if self.pinned is not None:
            try:
                return torch.empty(shape, dtype=dtype, device=device, pin_memory=True)
            except RuntimeError:  # more than the system lets be page-locked: ordinary memory (each copy then waits)
                pass
        return torch.empty(shape, dtype=dtype, device=device)

    def record(self, index: int, latents: dict[str, Tensor], info: Any) -> None:
        """Draw ``index`` of every chain and the step's statistics (``info``: a NamedTuple of per-chain values).

        One chain's values may be 0-d: they broadcast into the chains' dimension of the buffers.
        """
        for name, x in latents.items():
            self.draws[name][:, index].copy_(x.detach(), non_blocking=True)
        for stat, value in info._asdict().items():
            name = "lp" if stat == "log_posterior" else stat
            if name not in self.stats:  # shaped and placed as the draws' buffers
                buffer = next(iter(self.draws.values()))
                self.stats[name] = self._empty(buffer.shape[:2], value.dtype, buffer.device)
            self.stats[name][:, index].copy_(value.detach(), non_blocking=True)

    def settle(self) -> None:
        """Wait until the draws copied from a GPU have landed (before anything reads them)."""
        if self.pinned is not None:
            torch.cuda.synchronize(self.pinned)


@runtime_checkable
class RecordSource(Protocol):
    """A finished run that kept its draws (``StochasticMCMC``, ``SampleThenOptimize``)."""

    def run_record(self) -> RunRecord: ...


@runtime_checkable
class GaussianSource(Protocol):
    """A posterior that draws on request (Laplace, SWAG, the EKF); its chains are ``num_chains`` (SWAG's runs)."""

    bridge: ModelBridge
    num_chains: int

    def get_samples(
        self, num_samples: int | None = None, group_by_chain: bool = False, seed: int | None = None
    ) -> dict[str, Tensor]: ...


#: What :func:`convert` calls: the ArviZ adapter's ``to_inference_data``, once the adapter is imported.
_converter: Callable[..., Any] | None = None


def register_converter(converter: Callable[..., Any]) -> None:
    """Make ``converter`` what :func:`convert` calls (the ArviZ adapter registers its ``to_inference_data``)."""
    global _converter
    _converter = converter


def convert(source: RecordSource | GaussianSource, **options: Any) -> Any:
    """``source`` as ArviZ data: :func:`pyro_scalable.inference_data.to_inference_data` ``(source, **options)``.

    Raises:
        RuntimeError: no converter is registered (the adapter was not imported).

    """
    if _converter is None:
        raise RuntimeError(
            "no converter to ArviZ data is registered: import pyro_scalable (or pyro_scalable.inference_data), "
            "which registers pyro_scalable.inference_data.to_inference_data."
        )
    return _converter(source, **options)
