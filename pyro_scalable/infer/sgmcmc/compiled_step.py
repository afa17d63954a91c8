"""The one-step compiled graph (``model_tracing(compile=True, block_steps=1)``): one ``torch.compile`` graph per phase.

:class:`CompiledStep` compiles a stepper's whole step (:mod:`.chains`: minibatch, gradient and the kernel's update),
checks its first compiled step against the eager one, and leaves the run eager where the two disagree or compiling
fails.

``torch.compile`` keeps the graphs it made for a function on the function's *code object*, at most
``torch._dynamo.config.recompile_limit`` (8) of them; a new run (its recorded log density a new object, a guard that
fails) adds one. With one code object for every run, the ninth compiled run in a process would find the limit reached:
dynamo would then run the step's outer frame eagerly and compile its parts apart, which draws the step's normal noise in
another order, so the first-step check would refuse it and the run go on eagerly. Each phase's step therefore gets a
code object of its own (:func:`_own_code`, a copy); its graphs go with it when the run is done.
"""

from __future__ import annotations

import logging
import math
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from pyro_scalable.bridge.checks import first_line
from pyro_scalable.bridge.model import Batch
from pyro_scalable.bridge.traced import TRACE_AFTER
from pyro_scalable.infer.sgmcmc.base import Phase

__all__ = ["CompiledStep"]

_log = logging.getLogger(__name__)


class CompiledStep:
    """``torch.compile`` of a stepper's whole step (:meth:`~.chains.ChainStepper.advance`), one graph per phase.

    A phase runs eagerly for its first ``TRACE_AFTER`` steps (the bridge records the log density meanwhile), then
    compiled. The normal draws are made inside the graph (a draw from a ``torch.Generator`` would break it, and
    under ``vmap`` keep the whole step eager), by torch's global generator seeded for each step from the run's
    generator and restored after (inductor's ``fallback_random``: torch's own normal draws): reproducible from the
    run's seed, but other numbers than the eager step's. The first compiled step is checked: the eager step from
    the same seed must give the same new state to rounding (:attr:`RTOL`). A step that fails to compile, raises
    or disagrees leaves the run eager from there on, with the reason logged and kept in :attr:`refused`.
    """

    RTOL = 1e-4  # the compiled step's new state against the eager one's, relative to each leaf's largest value

    def __init__(self):
        self.steps: dict[tuple, Any] = {}  # by phase, mode and the indices' vmap dims
        self.seen: dict[tuple, int] = {}
        self.refused: str | None = None

    def __call__(self, stepper: Any, batch: Batch, phase: Phase) -> tuple[Any, Any] | None:
        """The new state and Info, or ``None`` where this step runs eagerly."""
        if self.refused is not None:
            return None
        key = (phase, stepper.mode, tuple((name, idx.dim()) for name, idx in batch.indices.items()))  # vmap dims
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] <= TRACE_AFTER:
            return None
        arguments = (stepper.final_state, batch.indices, batch.args, batch.kwargs)
        generator = stepper.generator
        first = None if key in self.steps else generator.get_state()  # a step that fails to compile draws nothing
        seed = int(torch.randint(2**62, (), generator=generator, device=generator.device))
        own = _global_generator(generator.device)  # torch's generator, the user's: its state is put back
        saved = own.get_state()
        try:
            if first is not None:
                return self._first(stepper, key, phase, arguments, seed)
            own.manual_seed(seed)
            return self.steps[key](*arguments)
        except Exception as error:  # noqa: BLE001 -- any compiler failure: the eager step, which raises a model error
            if first is not None:
                generator.set_state(first)
            self.refused = f"{type(error).__name__}: {first_line(error)}"
            _log.warning("the sampling step runs eagerly: it failed to compile (%s)", self.refused)
            return None
        finally:
            own.set_state(saved)

    def _first(self, stepper: Any, key: tuple, phase: Phase, arguments: tuple, seed: int) -> tuple[Any, Any]:
        def step(state, indices, args, kwargs):
            return stepper.advance(state, indices, args, kwargs, phase)

        step = _own_code(step)  # torch.compile's graphs for it are this phase's alone (module docstring)

        with warnings.catch_warnings():  # torch's compiler imports scripted modules: a torch internal's notice
            warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
            compiled = torch.compile(step, dynamic=False, options={"fallback_random": True})
            compiled(*arguments)  # compiling may draw from torch's generator (e.g. to time kernels): not the step's
        own = _global_generator(stepper.generator.device)
        own.manual_seed(seed)
        result = compiled(*arguments)
        own.manual_seed(seed)
        generator, stepper.generator = stepper.generator, None  # the eager step draws as the compiled one does
        try:
            eager = step(*arguments)
        finally:
            stepper.generator = generator
        worst = _disagreement(tree_flatten(result[0])[0], tree_flatten(eager[0])[0])
        if worst > self.RTOL:
            self.refused = f"its new state differs from the eager step's by {worst:.1e} (relative)"
            _log.warning("the sampling step runs eagerly: %s", self.refused)
            return eager
        self.steps[key] = compiled
        return result


def _global_generator(device: torch.device) -> torch.Generator:
    """The default generator for ``device``: a compiled step draws from it (seeded directly, not by manual_seed)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    return torch.default_generator


def _disagreement(compiled: list, eager: list) -> float:
    """The largest difference between floating-point leaves, relative to each eager leaf's largest magnitude.

    The magnitude is at least 1; the difference is infinite where the two are not finite at the same places.
    """
    worst = 0.0
    for a, b in zip(compiled, eager, strict=True):
        if isinstance(b, Tensor) and b.is_floating_point() and b.numel():
            finite = b.isfinite()
            if not torch.equal(a.isfinite(), finite):
                return math.inf
            if finite.any():
                scale = b[finite].abs().max().clamp(min=1.0)
                worst = max(worst, float((a - b)[finite].abs().max() / scale))
    return worst


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a copy of its code object: what ``torch.compile`` makes of it is not shared with other copies."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
