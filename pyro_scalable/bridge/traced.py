r"""The model's log density recorded once as a graph of torch operations and replayed without Pyro.

Each evaluation of :meth:`ModelBridge.log_posterior` runs the user's model in Python: every ``pyro.sample`` builds a
message and passes it through the handler stack, and the bridge's handler substitutes the latents and sums the log
densities. On small models that is most of a step: each sample site's trip through the handlers costs far more than its
arithmetic. For one *signature* of the call — the shapes, dtypes and devices of the latents, the minibatch indices and
the data tensors, and the values of every other argument — a model that does not branch on tensor values runs the same
sequence of tensor operations on every call. :func:`.recording.record` records that sequence below autograd, as the
ATen operations on the call's tensors that ``make_fx`` records, without importing ``torch._dynamo``; replaying it gives
the same value and, through autograd or ``torch.func``, the same gradients, without running the model's Python. Data
the model reads from its closure are held by reference.

A signature is recorded after :data:`TRACE_AFTER` calls (short evaluations never pay for the recording), outside any
``torch.func`` transform (in a separate thread, where no transform is active) and with the random number generator
forked, and it is used only where it passed every check:

1. **No branch on a value**: the recording refuses ``bool(tensor)`` and ``.item()`` on a recorded tensor (the model
   branches on data or latents), and the signature stays on the Pyro path (``.tolist()`` reads the values without an
   operation the recording sees: the agreement check, 3, refuses it where the value read changes the result);
2. **No shape that depends on values** (``nonzero``, ``unique``, boolean masks, ...): refused, since the recorded
   operations after them hold the shapes of one call;
3. **Agreement**: at a second point (other latents, other minibatch indices) the graph's value and gradients equal
   the model's to rounding (:data:`RTOL`). This refuses a model that draws random numbers or whose recorded
   Python-side state differs between the two points.

What no check can see is Python state the model reads that changes *later* (a global the user edits between steps,
an object passed as an argument whose tensors are swapped). :func:`model_tracing` turns the recording off for such
a model; every refusal is kept with its reason in :attr:`TracedLogDensity.refused`.

Before replaying, the graph is rewritten without changing its values (:mod:`.graph_passes`): operations that do
nothing, repeated operations and values the model builds from nothing but literals are dropped.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from pyro_scalable.arguments import check_count
from pyro_scalable.bridge.checks import first_line
from pyro_scalable.bridge.graph_passes import bind_python, gather_rows, simplify, value_shaped
from pyro_scalable.bridge.recording import record
from pyro_scalable.bridge.records import Batch, Latents
from pyro_scalable.bridge.signature import CallSignature

__all__ = [
    "RTOL",
    "TRACE_AFTER",
    "TracedLogDensity",
    "compiling",
    "model_tracing",
    "recording_at_first_call",
    "portable_history",
    "under_transform",
]

TRACE_AFTER = 16  # calls of one signature on the Pyro path before it is recorded
MAX_SIGNATURES = 16  # recorded (or refused) signatures per bridge; calls of further ones stay on the Pyro path
RTOL = 1e-4  # the graph's value and gradients against the model's at the check point, relative

_enabled = True
_trace_after = TRACE_AFTER  # recording_at_first_call() lowers it to 1
_compile = False
_block_steps = 8  # model_tracing(compile=True)'s steps per compiled block (1: one step per graph)
_log = logging.getLogger(__name__)


@contextlib.contextmanager
def model_tracing(  # noqa: A002 -- compile: torch's word
    enabled: bool = True, *, compile: bool = False, block_steps: int = 8
) -> Iterator[None]:
    """Record the model's log density as a graph (the default) or run the model on every call (``False``).

    Turn it off for a model whose log density reads Python state that changes between steps. ``compile=True`` also
    hands each recorded graph to ``torch.compile`` (an opt-in: seconds of compiling per signature, paid back over
    thousands of steps; a graph that fails to compile, or whose compiled value or gradients differ from the graph's
    at the check point, is replayed uncompiled). ``StochasticMCMC`` then also compiles its sampling loop: blocks of
    ``block_steps`` steps as one graph, their minibatches and noise drawn outside it from the run's generator as the
    eager run draws them, so that the draws are the eager run's to rounding
    (:class:`~pyro_scalable.infer.sgmcmc.compiled_blocks.CompiledBlocks`); ``block_steps=1`` compiles one step per
    graph with its noise drawn inside it, other numbers than the eager run's
    (:class:`~pyro_scalable.infer.sgmcmc.compiled_step.CompiledStep`). Either way a block or step that fails to
    compile, or whose result differs from the eager one, leaves the run eager, with the reason logged.

    >>> with model_tracing(False):
    ...     pass  # engines built and run here evaluate the model through Pyro on every call
    """
    global _enabled, _compile, _block_steps
    steps = check_count("block_steps", block_steps, least=1)
    before = _enabled, _compile, _block_steps
    _enabled, _compile, _block_steps = bool(enabled), bool(compile), steps
    try:
        yield
    finally:
        _enabled, _compile, _block_steps = before


@contextlib.contextmanager
def recording_at_first_call() -> Iterator[None]:
    """Record each new signature at its first call, not its :data:`TRACE_AFTER`-th, while in this context.

    For a pass over the data in chunks, whose signatures recur on every pass: the full-data passes of a mode
    search (its first pass otherwise ran each chunk's model through Pyro, several times slower than the graph,
    and a last, shorter chunk stayed on the Pyro path for fifteen passes).
    """
    global _trace_after
    before, _trace_after = _trace_after, 1
    try:
        yield
    finally:
        _trace_after = before


def compiling() -> bool:
    """Whether ``model_tracing(compile=True)`` is in force: engines compile what they offer to compile."""
    return _compile


def block_steps() -> int:
    """The steps per compiled block ``model_tracing`` asks for (1: the one-step compiled graph)."""
    return _block_steps


def under_transform(x: Tensor) -> bool:
    """Whether ``x`` is a torch.func (vmap/grad) wrapper, whose values cannot be read outside the transform.

    Example:
        >>> import torch
        >>> seen = []
        >>> _ = torch.func.vmap(lambda x: seen.append(under_transform(x)) or x)(torch.ones(2, 3))
        >>> under_transform(torch.ones(2)), seen
        (False, [True])

    """
    if torch.compiler.is_compiling():  # read no values inside a compiled step: its gradients by torch.func, traced
        return True
    is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return True if is_wrapped is None else bool(is_wrapped(x))


class TracedLogDensity:
    """``evaluate(latents, batch)`` replayed from a recorded graph for every signature that passed the checks.

    ``sizes`` maps each plate to the number of data points its indices address, for the check point's indices.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import Batch, ModelBridge
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(y), subsample_size=2) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> bridge = ModelBridge(model, (torch.tensor([0.5, -0.2, 1.0, 0.3]),))
        >>> batch = Batch({"data": torch.tensor([0, 2])}, bridge.args, {})
        >>> values = [bridge.log_posterior({"mu": torch.tensor(0.1)}, batch) for _ in range(TRACE_AFTER + 1)]
        >>> len(bridge.traced.graphs), torch.allclose(values[0], values[-1])  # the last one replayed
        (1, True)

    """

    def __init__(self, evaluate: Callable[[Latents, Batch], Tensor], sizes: dict[str, int]):
        self.evaluate = evaluate
        self.sizes = sizes
        self.graphs: dict[Any, Callable] = {}
        self.refused: dict[Any, str] = {}  # signature -> why it stays on the Pyro path
        self.uncompiled: dict[Any, str] = {}  # signature -> why its graph is replayed uncompiled (compile=True)
        self._calls: dict[Any, int] = {}
        self._restored: dict[str, tuple[str, Any]] = {}  # a checkpoint's signatures not called since (restore)
        self._restored_kept = 0  # how many of those were recorded or refused (they count to MAX_SIGNATURES)

    def __call__(self, latents: Latents, batch: Batch) -> Tensor:
        if not _enabled:
            return self.evaluate(latents, batch)
        call = CallSignature(latents, batch)
        graph = self.graphs.get(call.key)
        if graph is not None:
            return graph(*call.tensors)
        if self._restored and call.key is not None and call.key not in self._calls and call.key not in self.refused:
            self._resume(call.key)
        kept = len(self.graphs) + len(self.refused) + self._restored_kept
        if call.key is None or call.key in self.refused or kept >= MAX_SIGNATURES:
            return self.evaluate(latents, batch)
        if len(self._calls) > 64 * MAX_SIGNATURES:  # arguments that change on every call: forget the counts
            self._calls.clear()
        count = self._calls[call.key] = self._calls.get(call.key, 0) + 1
        if count < _trace_after:
            return self.evaluate(latents, batch)
        del self._calls[call.key]
        graph, reason = _in_thread(lambda: self._record(call))
        if graph is None:
            self.refused[call.key] = reason
            _log.info("the model runs through Pyro for %s: %s", call.describe(), reason)
            return self.evaluate(latents, batch)
        self.graphs[call.key] = graph
        if reason:
            self.uncompiled[call.key] = reason
            _log.info("the recorded model for %s is replayed uncompiled: %s", call.describe(), reason)
        return graph(*call.tensors)

    # ------------------------------------------------------------------ the history a checkpoint keeps
    def history(self) -> tuple:
        """Which signatures are recorded or refused and how often each other one was called (cheap: every step).

        A run that resumes from a checkpoint goes on bitwise only if each call takes the path (Pyro or the graph) it
        took in the uninterrupted run: the graph's value agrees with the model's to rounding, not to the bit.
        :func:`portable_history` makes a checkpoint's entry of it, :meth:`restore` puts that back.
        """
        return dict(self._calls), tuple(self.graphs), dict(self.refused), dict(self._restored)

    def restore(self, saved: dict[str, tuple[str, Any]]) -> None:
        """Go on with the history :func:`portable_history` kept (this process's own so far is dropped).

        Each signature named there resumes at its first call: recorded then, refused, or counted on from its calls.
        """
        self.graphs, self.refused, self.uncompiled, self._calls = {}, {}, {}, {}
        self._restored = {name: (kind, value) for name, (kind, value) in saved.items()}
        self._restored_kept = sum(kind != "calls" for kind, _ in self._restored.values())

    def _resume(self, key: Any) -> None:
        """The first call of ``key`` since :meth:`restore`: its path as the checkpoint left it."""
        kind, value = self._restored.pop(_name(key), ("calls", 0))
        if kind == "calls":
            self._calls[key] = value
            return
        self._restored_kept -= 1
        if kind == "refused":
            self.refused[key] = value
        else:  # recorded in the run: recorded again at this call (the graph does not depend on the call's values)
            self._calls[key] = TRACE_AFTER - 1

    # ------------------------------------------------------------------ recording (in a thread of its own)
    def _standins(self, call: CallSignature, generator: torch.Generator | None) -> list[Tensor]:
        """Plain tensors for the call: its own where they are plain, else zeros (index 0, or latents at 0).

        Zero is a valid unconstrained point of every ``biject_to``: it maps inside the site's support. With a
        ``generator``, a second point: the latents moved by a standard normal draw, the indices redrawn.
        """
        out = []
        for path, x in zip(call.paths, call.tensors, strict=True):
            kind, name = path[0], path[1] if len(path) > 1 else None
            if kind == 0 and x.is_floating_point():
                value = torch.zeros(x.shape, dtype=x.dtype, device=x.device) if under_transform(x) else x.detach()
                if generator is not None:
                    value = value + torch.randn(x.shape, generator=generator, dtype=x.dtype, device="cpu").to(x.device)
            elif kind == 1 and name in self.sizes and not x.is_floating_point():
                if generator is None and not under_transform(x):
                    value = x
                elif generator is None:
                    value = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
                else:
                    draw = torch.randint(0, self.sizes[name], x.shape, generator=generator, device="cpu")
                    value = draw.to(dtype=x.dtype, device=x.device)
            elif under_transform(x):
                value = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
            else:
                value = x.detach()
            out.append(value)
        return out

    def _record(self, call: CallSignature) -> tuple[Callable | None, str]:
        def flat(*tensors):
            return self.evaluate(*call.rebuild(tensors))

        standins = self._standins(call, None)
        try:
            graph = record(flat, standins)
        except Exception as error:  # noqa: BLE001 -- any failure to record leaves the signature on the Pyro path
            return None, f"recording failed ({type(error).__name__}: {first_line(error)})"
        shaped = sorted(value_shaped(graph))
        if shaped:
            return None, f"operations whose shapes depend on values: {', '.join(shaped)}"
        simplify(graph, standins)
        rows = {k for k, path in enumerate(call.paths) if path[0] == 1 and path[1] in self.sizes}
        gather_rows(graph, standins, rows, data={k for k, path in enumerate(call.paths) if path[0] > 1})
        bind_python(graph, standins)
        check = self._standins(call, torch.Generator().manual_seed(0))
        try:
            mismatch = _disagreement(flat, graph.forward, check, call)
        except Exception as error:  # noqa: BLE001 -- the model itself fails at the check point: stay on Pyro
            return None, f"the check point failed ({type(error).__name__}: {first_line(error)})"
        if mismatch:
            return None, mismatch
        if _compile:
            return _compiled(graph, check, call)
        return graph.forward, ""


def _compiled(graph, check: list[Tensor], call: CallSignature) -> tuple[Callable, str]:
    """``torch.compile`` of the checked ``graph``, compiled here at the check point; the graph itself if that fails."""
    try:
        with warnings.catch_warnings():  # torch's compiler imports scripted modules: a torch internal's notice
            warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
            compiled = torch.compile(graph, dynamic=False)
            mismatch = _disagreement(graph.forward, compiled, check, call)
    except Exception as error:  # noqa: BLE001 -- an inductor or dynamo failure: replay the graph uncompiled
        return graph.forward, f"not compiled ({type(error).__name__}: {first_line(error)})"
    if mismatch:
        return graph.forward, f"not compiled ({mismatch})"
    return _Fallback(compiled, graph.forward), ""


def portable_history(history: tuple) -> dict[str, tuple[str, Any]]:
    """:meth:`TracedLogDensity.history` as a checkpoint keeps it: by each signature's ``repr`` (strings and numbers).

    A signature whose ``repr`` holds a memory address (an object argument) cannot be named in another process, nor
    two signatures with one ``repr`` told apart: those are left out, and resume counts their calls from 0.
    """
    calls, graphs, refused, restored = history
    live = [(k, ("calls", n)) for k, n in calls.items()] + [(k, ("recorded", None)) for k in graphs]
    named = [(_name(key), entry) for key, entry in live + [(k, ("refused", r)) for k, r in refused.items()]]
    counts = collections.Counter(name for name, _ in named)
    kept = {name: entry for name, entry in named if counts[name] == 1 and " at 0x" not in name}
    return {**restored, **kept}


def _name(key: Any) -> str:
    return repr(key)


class _Fallback:
    """The compiled graph, or the graph itself from the first call at which the compiled one raised."""

    def __init__(self, compiled: Callable, graph: Callable):
        self.compiled, self.graph = compiled, graph

    def __call__(self, *tensors):
        if self.compiled is not None:
            try:
                return self.compiled(*tensors)
            except Exception:  # noqa: BLE001 -- e.g. a recompilation under a transform that inductor refuses
                self.compiled = None
        return self.graph(*tensors)


def _in_thread(work: Callable[[], tuple]) -> tuple:
    """``work()`` in a fresh thread (no torch.func transform active there), the global random state left as it was."""
    result: list = []
    device = torch.get_default_device() if hasattr(torch, "get_default_device") else None  # thread-local

    def run():
        # a default device is a torch-function mode every torch call in the thread passes through (and whose first
        # call imports torch._dynamo): set only where it is not the CPU, every thread's default
        if device is not None and device.type != "cpu":
            torch.set_default_device(device)
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_initialized() else []):
            try:
                result.append(work())
            except Exception as error:  # noqa: BLE001 -- the signature stays on the Pyro path, with the reason
                result.append((None, f"recording failed ({type(error).__name__}: {first_line(error)})"))

    thread = threading.Thread(target=run, name="pyro_scalable-trace")
    thread.start()
    thread.join()
    return result[0]


def _disagreement(flat: Callable, graph: Callable, point: list[Tensor], call: CallSignature) -> str:
    """Why the graph and the model differ at ``point`` (value or gradients beyond :data:`RTOL`), or ``""``."""
    latent = [i for i, path in enumerate(call.paths) if path[0] == 0 and point[i].is_floating_point()]
    results = []
    for fn in (flat, graph):
        inputs = [x.detach().requires_grad_() if i in latent else x for i, x in enumerate(point)]
        with torch.enable_grad():
            value = fn(*inputs)
            wrt = [inputs[i] for i in latent]
            # a vector of terms: the gradient of an irregular weighting of them (a sum could hide a swap)
            weights = torch.cos(1.3 * torch.arange(value.numel(), device=value.device) + 0.7).reshape(value.shape)
            total = value if value.dim() == 0 else (value * weights.to(value.dtype)).sum()
            grads = torch.autograd.grad(total, wrt, allow_unused=True, materialize_grads=True) if wrt else []
        results.append([value.detach(), *grads])
    for label, a, b in zip(["value", *[str(call.paths[i][1]) for i in latent]], *results, strict=True):
        scale = a.abs().max() if a.numel() else a.new_zeros(())
        atol = float(RTOL * scale) if torch.isfinite(scale) else 0.0
        close = torch.isclose(a, b, rtol=RTOL, atol=atol, equal_nan=True)
        if not bool(close.all()):
            what = "the value" if label == "value" else f"the gradient of '{label}'"
            return f"{what} differs between the graph and the model at the check point (random draws in the model?)"
    return ""
