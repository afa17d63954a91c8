"""Checkpoint and resume of ``StochasticMCMC``: a run's whole state in one file (written by :mod:`..checkpoint`).

A sampling run is a deterministic function of its seed: every random number the driver and the kernels use
(minibatch permutations, injected noise) comes from one ``torch.Generator``. A checkpoint therefore holds
everything the next step reads — the kernel state of every chain (stacked along a leading chain dimension,
whether the chains ran vectorised or one after another), the chain stepper's mode, the generator's state, the
minibatch sampler's permutations and positions, and which of the model's signatures replay its recorded graph
(:mod:`pyro_scalable.bridge.traced`: the graph agrees with the model to rounding, not to the bit, so a resumed run
must replay it from the call the uninterrupted run did) — with what the run has produced so far (draws and
``sample_stats``, the step index, the number of draws kept, the warm-up divergences) and a fingerprint of the
run (:func:`run_fingerprint`: the settings, the model's code and the data's values). A run resumed from it goes
on bitwise as the uninterrupted run would have.

Within warm-up the kernel state is the adaptation wrapper's (:class:`~.adaptation.AdaptationState`), after it the
tuned chain's (:class:`~.adaptation.TunedState`): resuming a checkpoint written after warm-up ends warm-up first.
Files are written atomically and checksummed (:func:`pyro_scalable.infer.checkpoint.save`); a ``.tmp`` left by a
killed write is removed when the run resumes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from pyro_scalable.bridge.plates import FullDataModel
from pyro_scalable.bridge.traced import portable_history
from pyro_scalable.infer.checkpoint import CheckpointError, CheckpointLock, check_path, load, remove_partial_write, save
from pyro_scalable.infer.digest import call_arguments, identify
from pyro_scalable.infer.fingerprint import UNIDENTIFIED, check_fingerprint, describe, stable_repr

__all__ = ["FORMAT", "RunCheckpoint", "run_fingerprint", "stack_chains", "to_device", "unstack_chains"]

# bumped when the layout of a run checkpoint changes (2: warm-up's state apart from the kernel's; 3: the kind, the
# model's code and the data's values in the fingerprint; 4: the control variate's centre and full-data gradient,
# and warm-up's metric; 5: warm-up's metric window per chain, its log-density window and restarted chains;
# 6: the gradient noise's average in the program's state, not the kernel's; 7: the kernel's values, every setting,
# the data bound to the model's parameters and what cannot be identified in the fingerprint; 8: the model tracing's
# history, which calls replay the recorded graph; 9: the control variate's policy as the run went on with it;
# 10: the tracing history of the log posterior's prior and data terms too; 11: the gradient estimator's state, with
# the noise's average and its count, in place of the program's noise average)
FORMAT = 11
KIND = "StochasticMCMC"
_KEYS = (
    "fingerprint",
    "step",
    "kept",
    "stopped",
    "mode",
    "state",
    "generator",
    "sampler",
    "draws",
    "stats",
    "warmup_divergences",
    "control_variate",
    "metric",
    "window",
    "restarted",
    "tracing",
    "option",
)


def stack_chains(state: Any) -> list[Tensor]:
    """The leaves of a kernel state, each ``(num_chains, ...)`` on the CPU: a vmapped state, or a list of chains."""
    if isinstance(state, list):
        per_chain = [tree_flatten(chain)[0] for chain in state]
        return [torch.stack(leaves).cpu() for leaves in zip(*per_chain)]
    return [leaf.detach().cpu().clone() for leaf in tree_flatten(state)[0]]


def unstack_chains(leaves: list[Tensor], template: Any, mode: str) -> Any:
    """Undo :func:`stack_chains` in ``mode``, onto the structure and devices of a fresh ``template``.

    Each leaf keeps the dtype it was saved with, not the template's: a leaf can change dtype as a run goes on (a
    float32 step size that the first steps promote to float64 on a float64 model), and casting it back to a fresh
    state's dtype would round the resumed run away from the uninterrupted one.
    """
    chain = template[0] if isinstance(template, list) else template
    like, spec = tree_flatten(chain)
    num_chains = len(template) if isinstance(template, list) else like[0].shape[0]
    expected = [(num_chains, *x.shape) if isinstance(template, list) else tuple(x.shape) for x in like]
    if [tuple(x.shape) for x in leaves] != expected:
        raise CheckpointError("the kernel state in the checkpoint does not fit this kernel and model.")
    leaves = [saved.to(device=x.device) for saved, x in zip(leaves, like)]
    if mode == "vectorized":
        return tree_unflatten(leaves, spec)
    return [tree_unflatten([leaf[c].clone() for leaf in leaves], spec) for c in range(num_chains)]


def run_fingerprint(run: Any, record: Any, batches: Any = None) -> dict[str, str]:
    """What a driver run's draws depend on: a checkpoint resumes only a run whose fingerprint is the same.

    Every setting of the driver that changes a draw enters, and the kernel by what it computes
    (:func:`pyro_scalable.infer.digest.identify` of its hyperparameters: a schedule by its code, closure and the
    globals it reads, a tensor step size by content, ``init_strategy`` and the control variate likewise), besides its
    readable ``repr``. The model enters by name and by its code (its bytecode, closure, defaults and globals, numpy
    arrays and plain objects included; a module's class code, parameters and buffers), the data by dtype, shape and
    content, bound to the model's parameters (``model(x, y)`` and ``model(x, y=y)`` are the same run). Where
    ``batches`` (a DataLoader) feeds the steps there is no full data to hash: the fingerprint then holds the first
    minibatch's dtypes and shapes, the loader's type, length and batch size, the content of its dataset where it is
    a ``TensorDataset`` (any dataset with ``tensors``), and the full data given to ``run``, if any. What cannot be
    identified (a random number generator, an object with nothing to read) is named under ``"unidentified"``, and
    such a checkpoint is refused rather than resumed (:func:`pyro_scalable.infer.fingerprint.check_fingerprint`).
    """
    model = run.kernel.model
    model = model.model if isinstance(model, FullDataModel) else model  # the model as written
    bridge = record.bridge  # the model on the steps' data (:class:`~pyro_scalable.infer.record.RunRecord`)
    fields = {
        "kernel": run.kernel,
        "model": getattr(model, "__qualname__", type(model).__name__),
        "num_samples": run.num_samples,  # as requested: the checkpoint is opened before any draw is dropped
        "num_warmup": run.num_warmup,
        "num_chains": run.num_chains,
        "thin": run.thin,
        "seed": run.seed,
        "chain_method": run.chain_method,
        "on_divergence": run.on_divergence,
        "metric": run.metric,
        "minibatches": run.minibatches,
        "shared_minibatches": run.shared_minibatches,
        "distributed": run.distributed,
        "device": bridge.device.type,
        "batches": None if batches is None else type(batches).__name__,
    }
    data = call_arguments(model, bridge.args, bridge.kwargs)
    parts = {
        "model_code": identify(model),
        "kernel_values": identify((type(run.kernel), {k: v for k, v in vars(run.kernel).items() if k != "model"})),
        "data_values": identify(
            data if batches is None else (call_arguments(model, record.args, record.kwargs), _loader(batches))
        ),
    }
    unidentified = [what for part in parts.values() for what in part.unidentified]
    return {
        **{name: stable_repr(value) for name, value in fields.items()},
        **{name: part.digest for name, part in parts.items()},
        "data": describe(data),
        **({UNIDENTIFIED: "; ".join(unidentified)} if unidentified else {}),
    }


def _loader(batches: Any) -> Any:
    """What can be said of a DataLoader's data without iterating it: its size, batch size and dataset's tensors."""
    dataset = getattr(batches, "dataset", None)
    try:
        length = len(batches)
    except TypeError:  # a generator, or a DataLoader over an IterableDataset
        length = None
    return {
        "length": length,
        "batch_size": getattr(batches, "batch_size", None),
        "dataset": type(dataset).__name__,
        "tensors": getattr(dataset, "tensors", None),
    }


class RunCheckpoint:
    """A run's checkpoint file: read the run's value back, remember each step's, write it when due.

    The run's value (:class:`~.run_state.RunValue`: the chains, the generator's and the sampler's states, warm-up's
    and the draws taken) is handed to :meth:`remember` after every completed step; the checkpoint holds nothing of
    the run but that value and writes it every ``every`` steps (warm-up included), at the end of warm-up
    (``num_warmup``), at the end of the run (``total``), when the run stops at a divergence, and on
    ``KeyboardInterrupt``: an interrupt in the middle of a step loses nothing and adds nothing. The path is checked
    and locked when the checkpoint is opened (before the first step), until the run's last write (at its end, its
    stop or an interruption) or a failed one; a run that ends with another error leaves the lock to the garbage
    collector (:class:`~pyro_scalable.infer.checkpoint.CheckpointLock`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        every: int,
        fingerprint: dict[str, str],
        *,
        total: int,
        warmup: int,
        settle: Any = None,
    ):
        self.path = path
        self.settle = settle  # waits for draws still being copied from a device (RunRecord.settle) before a write
        self.every = every
        self.fingerprint = fingerprint  # run_fingerprint's: a checkpoint resumes only the same run
        check_path(path)  # before the first step: an unusable path fails now, not at the first write
        self.lock = CheckpointLock(path)  # no second process writes this checkpoint meanwhile (released by close)
        self.total, self.warmup = total, warmup
        self._last: Any = None

    def close(self) -> None:
        """Release the checkpoint's lock: the run is over (finished, stopped, interrupted, or a write failed)."""
        self.lock.release()

    def read(self, existing: bool = True) -> dict[str, Any] | None:
        """The value a checkpoint of this run holds (its fields as :class:`~.run_state.RunValue`'s, on the CPU).

        ``None`` where there is none (or ``existing`` is false: the run starts over). A checkpoint of another run,
        a damaged one or one of another format is refused with a :class:`CheckpointError` naming why (the lock
        released); a finished run's is read back with the lock released (nothing more is written).
        """
        remove_partial_write(self.path)
        try:
            saved = load(self.path, kind=KIND, version=FORMAT, keys=_KEYS) if existing else None
            if saved is not None:
                check_fingerprint(saved["fingerprint"], self.fingerprint, self.path)
        except CheckpointError:
            self.close()  # refused: this run ends here
            raise
        if saved is not None and (saved["stopped"] or saved["step"] == self.total):
            self.close()  # a finished run, read back: nothing more is written
        return saved

    def remember(self, value: Any) -> None:
        """The run's value after its last completed step (references and small copies: cheap every step)."""
        self._last = value

    def step_done(self, value: Any) -> None:
        """Remember the run's value after a step, and write it if a checkpoint is due."""
        self.remember(value)
        step = value.step
        if value.stopped or step % self.every == 0 or step == self.warmup or step == self.total:
            self.write()

    def write(self) -> None:
        """Write the run's value as last remembered."""
        last = self._last
        if self.settle is not None:
            self.settle()
        over = last.stopped or last.step == self.total or sys.exc_info()[0] is not None  # or interrupted
        try:
            self._save(last)
        except BaseException:
            self.close()  # the run ends with the write's error
            raise
        if over:
            self.close()  # the next run on this path (a resumed one) may take the lock

    def _save(self, last: Any) -> None:
        sampler, kept = last.sampler, last.kept
        if sampler is not None:
            sampler = {"orders": {k: v.cpu() for k, v in sampler["orders"].items()}, "position": sampler["position"]}
        control = last.control_variate
        save(
            self.path,
            {
                **last._asdict(),
                "kind": KIND,
                "format": FORMAT,
                "fingerprint": self.fingerprint,
                "state": stack_chains(last.state),
                "sampler": sampler,
                "draws": {k: v[:, :kept].detach().cpu().clone() for k, v in last.draws.items()},
                "stats": {k: v[:, :kept].detach().cpu().clone() for k, v in last.stats.items()},
                "control_variate": to_device(control and control._asdict(), "cpu"),
                "metric": to_device(last.metric, "cpu"),
                "window": to_device(last.window, "cpu"),
                "warmup_divergences": to_device(last.warmup_divergences, "cpu"),
                "tracing": [portable_history(history) for history in last.tracing],
            },
        )


def to_device(value: Any, device: Any) -> Any:
    """``value``'s tensors (nested dicts) moved to ``device``; ``None`` as it is."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        return value.to(device)
    if not isinstance(value, dict):
        return value
    return {name: to_device(x, device) for name, x in value.items()}
