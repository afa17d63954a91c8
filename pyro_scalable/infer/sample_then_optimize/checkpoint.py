"""Checkpoint and resume for ``SampleThenOptimize``: one file per run, rewritten after every few epochs.

Everything before the first solve — the MAP search, the linearisation, the prior draws and the perturbation pass —
is a deterministic function of the seed, so a resumed run redoes it and then puts back what the solves had reached:
the EM step, the prior precision and the EM history, and within the solve the step count, the optimiser state of
every row, the step size, the minibatch sampler and the generator. The rest of the run is then bitwise that of an
uninterrupted one. The file is written atomically, checksummed and checked against a fingerprint of the run — the
settings (by content too), the model's code, the data's values bound to the model's parameters, ``linearize_at``
and ``prior_precision`` by content — as the driver's checkpoints are (:mod:`pyro_scalable.infer.checkpoint`,
:mod:`pyro_scalable.infer.digest`); a component that cannot be identified is refused, named.

With ``seed=None`` the run draws its seed from torch's global generator; the checkpoint records the drawn seed and
a resumed run reads it back (:func:`run_seed`) instead of drawing another, so that redoing the steps before the
first solve gives the interrupted run's prior draws and perturbations, not those of a second run. The path is
checked before anything runs, and locked from the first solve to the end of the run (:meth:`SolveCheckpoint.close`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pyro_scalable.infer.checkpoint import CheckpointError, CheckpointLock, check_path, load, remove_partial_write, save
from pyro_scalable.infer.digest import call_arguments, identify
from pyro_scalable.infer.fingerprint import UNIDENTIFIED, check_fingerprint, describe, stable_repr
from pyro_scalable.infer.linearized.sampling import core

__all__ = ["FORMAT", "SolveCheckpoint", "run_seed"]

FORMAT = 4  # bumped when the layout changes (2: the kind, the model's code and the data's values in the fingerprint;
# 3: the EM noise scales; 4: the drawn seed, the settings by content, the data bound to the model's parameters)
KIND = "SampleThenOptimize"
_KEYS = ("fingerprint", "seed", "em_step", "progress", "generator", "alpha", "alphas", "gammas", "noises", "trace")

_SETTINGS = (
    "num_samples",
    "num_epochs",
    "step_size",
    "momentum",
    "max_grad_norm",
    "sites",
    "g_prior",
    "em_steps",
    "em_groups",
    "em_epochs",
    "variance_reduction",
    "map_steps",
    "chunk_size",
    "seed",
    "preconditioner",
    "refine_passes",
    "tolerance",
    "em_noise",
)


def fingerprint(engine: Any) -> dict[str, str]:
    """What a run's draws depend on: the settings, the model's name and code, the device and the data's values."""
    model = engine.kernel.model.model
    bridge = engine.bridge
    settings = {name: getattr(engine, name) for name in _SETTINGS}
    fields = {name: stable_repr(value) for name, value in settings.items()}
    fields["model"] = stable_repr(getattr(model, "__qualname__", type(model).__name__))
    fields["device"] = stable_repr(bridge.device.type)
    data = call_arguments(model, bridge.args, bridge.kwargs)
    parts = {
        "model_code": identify(model),
        "settings_values": identify(settings),  # a tensor or a callable setting by content, not by its repr
        "linearize_at": identify(engine.linearize_at),
        "prior_precision": identify(engine.prior_precision),
        "data_values": identify(data),
    }
    fields.update({name: part.digest for name, part in parts.items()})
    fields["data"] = describe(data)
    unidentified = [what for part in parts.values() for what in part.unidentified]
    if unidentified:
        fields[UNIDENTIFIED] = "; ".join(unidentified)
    return fields


def run_seed(engine: Any) -> int:
    """The run's seed, before anything runs: ``engine.seed``, or with ``seed=None`` the one its checkpoint recorded.

    Where there is no checkpoint to resume, ``seed=None`` draws one from torch's global generator. The checkpoint's
    path is checked here (:func:`~pyro_scalable.infer.checkpoint.check_path`), so that an unusable one fails before
    the linearisation, not at the first write.
    """
    if engine.checkpoint is not None:
        check_path(engine.checkpoint)
    if engine.seed is not None:
        return engine.seed
    if engine.checkpoint is not None and engine.resume:
        try:
            saved = load(engine.checkpoint, kind=KIND, version=FORMAT, keys=("seed",))
        except CheckpointError:
            saved = None  # refused with its reason when the solve resumes it
        if saved is not None:
            return int(saved["seed"])
    return int(torch.randint(0, 2**62, ()))


class SolveCheckpoint:
    """The engine's checkpoint of its solves (:class:`~pyro_scalable.infer.linearized.sampling.solve.Checkpoint`).

    :meth:`resume` hands the saved run back for the solve to put back; :meth:`on_epoch` writes one every
    ``engine.checkpoint_every`` epochs and at the end of each solve. Neither changes the engine or the problem.
    """

    def __init__(self, engine: Any, generator: torch.Generator, seed: int):
        self.generator = generator
        self.seed = seed  # the run's, drawn where seed=None: a resumed run reads it back (run_seed)
        self.path: str | os.PathLike = engine.checkpoint
        self.every: int = engine.checkpoint_every
        self.allowed: bool = engine.resume
        self.fingerprint = fingerprint(engine)
        check_path(self.path)
        self.lock = CheckpointLock(self.path)  # no second process writes this checkpoint meanwhile (until close)

    def close(self) -> None:
        """Release the checkpoint's lock (the run is over, or stopped)."""
        self.lock.release()

    def resume(self, device: torch.device) -> dict[str, Any] | None:
        """The saved run (the EM step, the solve's progress, the EM history and trace), its tensors on ``device``."""
        remove_partial_write(self.path)
        saved = load(self.path, kind=KIND, version=FORMAT, keys=_KEYS) if self.allowed else None
        if saved is None:
            return None
        check_fingerprint(saved["fingerprint"], self.fingerprint, self.path)
        if saved["seed"] != self.seed:  # only where a checkpoint appeared after run_seed read the path
            raise CheckpointError(
                f"the checkpoint {str(self.path)!r} was written with seed {saved['seed']}, and this run drew "
                f"{self.seed}: pass seed={saved['seed']} to resume it, or resume=False to start over."
            )
        progress = saved["progress"]
        progress["state"] = core.SampleState(**{k: v.to(device) for k, v in progress["state"].items()})
        progress["first"] = progress["first"].to(device)
        progress["generator"] = saved["generator"]
        saved["alpha"] = saved["alpha"].to(device)
        saved["alphas"] = [a.to(device) for a in saved["alphas"]]
        saved["gammas"] = [g.to(device) for g in saved["gammas"]]
        saved["noises"] = [s.to(device) for s in saved["noises"]]
        return saved

    def on_epoch(self, em_step: int, epochs: int, problem: Any, alphas: list, gammas: list, noises: list):
        """The ``on_epoch`` of ``Problem.solve`` in EM step ``em_step``: write every ``every`` epochs and at the end.

        Each write reads the problem's prior precision and trace, and the EM history, as they are then.
        """
        steps_per_epoch, every = problem.steps_per_epoch, self.every

        def write(progress: dict[str, Any]) -> None:
            epoch = progress["t"] // steps_per_epoch
            if epoch % every and epoch != epochs:
                return
            state = {k: v.detach().cpu() for k, v in progress["state"]._asdict().items()}
            save(
                self.path,
                {
                    "kind": KIND,
                    "format": FORMAT,
                    "fingerprint": self.fingerprint,
                    "seed": self.seed,
                    "em_step": em_step,
                    "progress": {**progress, "state": state, "first": progress["first"].detach().cpu()},
                    "generator": self.generator.get_state(),
                    "alpha": problem.alpha.cpu(),
                    "alphas": [a.cpu() for a in alphas],
                    "gammas": [g.cpu() for g in gammas],
                    "noises": [s.cpu() for s in noises],
                    "trace": problem.trace,
                },
            )

        return write
