"""The compiled sampling loop (``model_tracing(compile=True)``): blocks of K steps as one ``torch.compile`` graph.

Contract. Where a run may step in blocks (:meth:`CompiledBlocks.length`), the driver (:mod:`.phases`) hands a block
of K = ``block_steps`` steps to :meth:`CompiledBlocks.run`. The block's minibatch indices and normal noise are drawn
*before* it, eagerly, from the run's own generator and minibatch sampler, in the order and shapes the eager loop
draws them (per step: the minibatch, then each chain's noise, latent by latent; vectorised chains: one
``(chains, ...)`` draw per latent, as ``vmap(randomness="different")`` draws it). One compiled function then runs the
K updates (a Python loop that dynamo unrolls, each step handed its noise as :class:`~.base.DrawnNoise`) and returns
the last state and each step's draw and Info; the driver records them as it records an eager step's. So a compiled
run's draws, its noise and its generator's stream are the eager run's, the draws equal to float rounding (the
compiled graph fuses and reorders float operations); torch's own generator is not used.

The first block of each graph is checked: it is also stepped eagerly from the same generator and sampler state, and
the eager steps must leave the generator where the block's draws left it and give the same states, draws and
statistics to :attr:`CompiledBlocks.RTOL` (relative to each leaf's largest value); the run keeps the eager steps'
results. A block that fails to compile, raises, or disagrees leaves the run eager from there on, with the reason
logged and kept in :attr:`CompiledBlocks.refused`; settings that step one at a time (below) are kept there too.

Which steps run in blocks: those of a program with a fixed step (the sampling phase, and all of warm-up for a kernel
that does not adapt: the :class:`~.adaptation.Tuned` program) that are not warm-up's with a metric schedule, after
each of their phases was stepped eagerly more than ``TRACE_AFTER`` times (the bridge records the model meanwhile),
in whole blocks that end where warm-up ends or the run ends (the rest runs eagerly). An adaptive warm-up changes its
step size between steps by reading the chains: it steps eagerly. Runs that are checkpointed, stop at a divergence,
read a ``DataLoader``'s batches, or reduce the gradient across processes step eagerly (each needs the driver between
steps). On a CUDA device the block is compiled with CUDA graphs (``mode="reduce-overhead"``).
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from pyro_scalable.bridge.checks import first_line
from pyro_scalable.bridge.traced import TRACE_AFTER
from pyro_scalable.infer.sgmcmc.base import draws_noise, gaussian_like
from pyro_scalable.infer.sgmcmc.chains import chains_draw
from pyro_scalable.infer.sgmcmc.compiled_step import _disagreement, _global_generator, _own_code
from pyro_scalable.infer.sgmcmc.run_state import stage_index

__all__ = ["CompiledBlocks"]

_log = logging.getLogger(__name__)

# what torch.compile raises where it cannot compile or run a block: dynamo's and inductor's errors (RuntimeError
# subclasses: Unsupported, BackendCompilerFailed, ...) and the built-in ones their passes let through. The eager steps
# that follow a refusal raise a model's own error again.
_COMPILE_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError, AttributeError)


class CompiledBlocks:
    """Blocks of ``size`` steps as one compiled graph each, their noise and minibatches drawn before the block."""

    RTOL = 1e-4  # the first block's states, draws and statistics against the eager steps', relative per leaf

    def __init__(self, size: int):
        self.size = size
        self.refused: str | None = None
        self.compiled_blocks = 0  # blocks whose results the run kept from a compiled graph
        self._graphs: dict[tuple, Callable] = {}  # checked graphs, by what they were traced for
        self._seen: Counter = Counter()  # eager steps per (stepper, program, phase): the bridge records after some
        self._pending: tuple | None = None  # the first block's compiled results, until the eager steps are in

    def length(self, run: Any, state: Any, t: int) -> int:
        """``size`` where steps ``t`` to ``t + size - 1`` run as one block, else 0 (step ``t`` then runs eagerly)."""
        if self.refused is not None:
            return 0
        settings = _one_at_a_time(run, state)
        if settings:
            self.refused = settings
            _log.info("the sampling loop steps one step at a time: %s", settings)
            return 0
        stepper = state.stepper
        program, warmup = stepper.program, t < run.num_warmup
        if program.sampler is not program or (warmup and state.schedule is not None):
            return 0  # adaptive warm-up (its step size moves between steps), or a metric stage's bookkeeping
        end = run.num_warmup if warmup else state.total
        start = stage_index(state, t)
        phases = [program.phase(start + k) for k in range(self.size)]
        owner = (id(stepper), id(program))
        if t + self.size > end or any(self._seen[owner, phase] <= TRACE_AFTER for phase in phases):
            self._seen[owner, program.phase(start)] += 1
            return 0
        return self.size

    def run(self, run: Any, state: Any, t: int, estimator: Any) -> list | None:
        """Steps ``t`` to ``t + size - 1`` compiled: each step's draw and Info, and the stepper moved past them.

        ``None`` where the driver steps them eagerly: the graph's first block (then :meth:`check` compares the
        eager results with the compiled ones), or a block that failed to compile (the reason in :attr:`refused`).
        """
        stepper, generator = state.stepper, state.generator
        start = stage_index(state, t)
        phases = tuple(stepper.program.phase(start + k) for k in range(self.size))
        stepper.estimator = estimator
        before = generator.get_state(), state.sampler.state_dict()
        batches, noises = _draw(self.size, state, draws_noise(run.kernel.temperature))
        arguments = (stepper.final_state, batches, noises, state.bridge.args, state.bridge.kwargs)
        dims = tuple((name, idx.dim()) for name, idx in batches[0].items())  # shared or per-chain minibatches
        key = (id(stepper), id(stepper.program), stepper.mode, id(estimator), phases, dims)
        cuda = generator.device.type == "cuda"
        drawn, cached = generator.get_state(), key in self._graphs
        own = _global_generator(generator.device)  # compiling may draw from torch's (e.g. to time kernels)
        saved = own.get_state()
        try:
            graph = self._graphs[key] if cached else self._compile(stepper, phases, cuda)
            with warnings.catch_warnings():  # torch's compiler imports scripted modules: a torch internal's notice
                warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
                final, out = self._call(graph, arguments, cuda)
        except _COMPILE_ERRORS as error:  # also a checked graph's recompilation (a guard that failed) may fail
            self._refuse(f"it failed to compile: {type(error).__name__}: {first_line(error)}")
        else:
            if cached:
                stepper.restore(stepper.mode, final)
                self.compiled_blocks += 1
                return out
            self._pending = (key, graph, drawn, final, out)
        finally:
            own.set_state(saved)
        generator.set_state(before[0])  # the eager steps draw the same numbers again
        state.sampler.load_state_dict(before[1])
        return None

    def check(self, state: Any, eager: list) -> None:
        """Compare the first block's compiled results with the eager steps' (``eager``: each step's draw and Info)."""
        if self._pending is None:
            return
        key, graph, drawn, final, out = self._pending
        self._pending = None
        if not torch.equal(state.generator.get_state(), drawn):
            self._refuse("the eager steps drew other random numbers than the block drew for them")
            return
        worst = _worst(tree_flatten((final, out))[0], tree_flatten((state.stepper.final_state, eager))[0])
        if worst > self.RTOL:
            self._refuse(f"its draws differ from the eager steps' by {worst:.1e} (relative)")
            return
        self._graphs[key] = graph

    def _refuse(self, reason: str) -> None:
        self.refused = reason
        _log.warning("the sampling loop runs eagerly: a compiled block of %d steps was refused (%s)", self.size, reason)

    def _compile(self, stepper: Any, phases: tuple, cuda: bool) -> Callable:
        def block(state, batches, noises, args, kwargs):
            out = []
            for phase, indices, noise in zip(phases, batches, noises, strict=True):
                state, info = stepper.advance(state, indices, args, kwargs, phase, noise)
                out.append((chains_draw(stepper.program, state), info))
            return state, out

        block = _own_code(block)  # torch.compile's graphs for it are this block's alone (.compiled_step)
        mode = "reduce-overhead" if cuda else None  # CUDA graphs: the block's kernels replayed as one graph
        return torch.compile(block, dynamic=False, mode=mode)

    @staticmethod
    def _call(graph: Callable, arguments: tuple, cuda: bool) -> tuple[Any, list]:
        if not cuda:
            return graph(*arguments)
        torch.compiler.cudagraph_mark_step_begin()  # the graph's outputs are overwritten by its next replay
        return tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, graph(*arguments))


def _one_at_a_time(run: Any, state: Any) -> str:
    """Why this run's settings step one step at a time ("" where blocks may run)."""
    if state.reducer is not None:
        return "a data-parallel run reduces each step's gradient across processes"
    if state.batch_iter is not None:
        return "each step reads the next batch of the DataLoader"
    if state.checkpoint is not None:
        return "a checkpointed run may write its state after any step"
    if run.on_divergence == "stop":
        return "on_divergence='stop' ends the run after the step that diverges"
    return ""


def _draw(size: int, state: Any, noise: bool) -> tuple[list, list]:
    """``size`` steps' minibatch indices and noise, drawn as the eager steps draw them (module docstring)."""
    stepper, generator = state.stepper, state.generator
    program, chains = stepper.program, stepper.final_state
    batches, noises = [], []
    for _ in range(size):
        batches.append(next(state.sampler))
        if not noise:
            noises.append(None)
        elif stepper.mode == "vectorized":
            noises.append(gaussian_like(program.latents(chains), generator))
        else:
            noises.append([gaussian_like(program.latents(chain), generator) for chain in chains])
    return batches, noises


def _worst(compiled: list, eager: list) -> float:
    """The largest relative difference of the floating-point leaves; infinite where the others differ."""
    if len(compiled) != len(eager):
        return float("inf")
    for a, b in zip(compiled, eager, strict=True):
        if isinstance(b, Tensor) and not b.is_floating_point() and not torch.equal(a, b):
            return float("inf")
    return _disagreement(compiled, eager)
