r"""Recording a function's ATen operations on real tensors as a :class:`torch.fx.GraphModule`.

:func:`record` runs ``fn(*inputs)`` once under a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that
sees every operation below autograd and appends it to a graph: ``inputs`` become placeholders, each operation a
``call_function`` node on the nodes of its tensor arguments (the other arguments as literals), and a tensor that
no recorded operation made and that is not an input (data read from a closure, a module's buffer) a ``get_attr``
constant ``_tensor_constant<k>`` held by reference, so that an in-place change to it is seen by the replay. The
operations are those :func:`torch.fx.experimental.proxy_tensor.make_fx` records on real tensors without a
decomposition table, in the same order: a ``CompositeImplicitAutograd`` operation that reaches the mode is
decomposed where autograd would have decomposed it, ``torch.tensor(literal)``'s ``lift_fresh`` is recorded as a
copy (``lift_fresh_copy``), and ``bool(tensor)`` as ``ne`` then ``item``. Replaying the graph therefore runs the
kernels the function ran, and the gradients through it are autograd's of those kernels.

A value-dependent read (an operation tagged ``data_dependent_output``: ``.item()``, ``bool(tensor)``) of a tensor
computed from the inputs raises: the graph would hold one call's value. As in ``make_fx``, such a read is allowed,
and not recorded, where every tensor it reads is a *constant*: read from outside, or computed only from constants
with at most one element (a literal ``torch.tensor(2.0)``, a Python scalar's arithmetic). Each node's
``meta["val"]`` is a tensor on the ``meta`` device with the result's shape, strides and dtype (the rewrites in
:mod:`.graph_passes` read them).

Unlike ``make_fx`` it imports neither ``torch._inductor`` nor ``torch._dynamo`` (about two seconds of a process's
first recording) and makes no fake tensors or stack traces per operation.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, fx
from torch.utils._python_dispatch import TorchDispatchMode

try:
    from torch.utils._python_dispatch import autograd_would_have_decomposed
except ImportError:  # a torch older than this helper: make_fx records the graph instead (and imports torch._dynamo)
    autograd_would_have_decomposed = None
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["record"]

_aten = torch.ops.aten
_CONSTANT_NUMEL = 1  # as make_fx's CONSTANT_NUMEL_LIMIT: a value computed from constants is kept up to this size


def record(fn: Callable[..., Tensor], inputs: list[Tensor]) -> fx.GraphModule:
    """The graph of ATen operations ``fn(*inputs)`` runs, its placeholders ``inputs`` in order (module docstring).

    Example:
        >>> import torch
        >>> data = torch.tensor([1.0, 2.0, 3.0])
        >>> graph = record(lambda w, i: (data[i] * w).exp().sum(), [torch.tensor(0.5), torch.tensor([0, 2])])
        >>> [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        ['aten.index.Tensor', 'aten.mul.Tensor', 'aten.exp.default', 'aten.sum.default']
        >>> float(graph(torch.tensor(1.0), torch.tensor([1])))  # e^2
        7.38905...

    """
    if autograd_would_have_decomposed is None:
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(fn)(*inputs)
    root = torch.nn.Module()
    recorder = _Recorder(root)
    for k, x in enumerate(inputs):
        recorder.input(x, k)
    with recorder:
        out = fn(*inputs)
    recorder.graph.output(tree_map_only(Tensor, recorder.node, out))
    return fx.GraphModule(root, recorder.graph, getattr(fn, "__name__", "recorded"))


def _meta(x: Tensor) -> Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


class _Recorder(TorchDispatchMode):
    """Appends every operation it sees to :attr:`graph` (see :func:`record`)."""

    def __init__(self, root: torch.nn.Module):
        super().__init__()
        self.root, self.graph = root, fx.Graph()
        # tensor -> (its node, its value where it is a constant else None, whether it was read from outside); weak,
        # as make_fx's: a reference held here would make autograd wrap each fresh result in a recorded detach
        self.seen = WeakIdKeyDictionary()
        self.count = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless told not to, and that wrapper imports
        # torch._dynamo at its first call; a recording runs eagerly in a thread of its own, never under torch.compile
        return False

    def input(self, x: Tensor, k: int) -> fx.Node:
        node = self.graph.placeholder(f"arg{k}_1")
        node.meta["val"] = _meta(x)
        self.seen[x] = (node, None, False)
        return node

    def node(self, x: Tensor) -> fx.Node:
        """The node of tensor ``x``: a constant attribute where no recorded operation made it."""
        found = self.seen.get(x)
        if found is not None:
            return found[0]
        name = f"_tensor_constant{self.count}"
        self.count += 1
        setattr(self.root, name, x)
        node = self.graph.get_attr(name)
        node.meta["val"] = _meta(x)
        self.seen[x] = (node, None, True)
        return node

    def _constant(self, x: Tensor) -> Tensor | None:
        """``x``'s value where it is a constant (read from outside, or computed from constants), else None."""
        found = self.seen.get(x)
        return x if found is None or found[2] else found[1]

    def _made_constant(self, x: Tensor) -> bool:
        found = self.seen.get(x)
        return found is not None and not found[2] and found[1] is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
        if func not in (_aten.size.default, _aten.stride.default, _aten.storage_offset.default) and (
            autograd_would_have_decomposed(func, tensors)
        ):
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        if func is _aten.is_nonzero.default:
            with self:
                return (args[0] != 0).item()
        constants = [self._constant(x) for x in tensors]
        all_constant = all(c is not None for c in constants)
        # as make_fx: a result is a constant only where a constant the recording made (not one read from outside)
        # goes into it
        any_made = any(self._made_constant(x) for x in tensors)
        if torch.Tag.data_dependent_output in func.tags:
            if all_constant:
                const_args, const_kwargs = _swap(args, kwargs, tensors, constants)
                return func(*const_args, **const_kwargs)
            raise RuntimeError(f"a value read from a recorded tensor ({func}): the model branches on a value")
        if func is _aten.lift_fresh.default:
            func = _aten.lift_fresh_copy.default
        node_args, node_kwargs = tree_map_only(Tensor, self.node, (args, kwargs))
        out = func(*args, **kwargs)
        name = self.graph._target_to_str(func.overloadpacket.__name__)  # make_fx's names: the graph reads the same
        node = self.graph.call_function(func, node_args, node_kwargs, name=name)
        node.meta["val"] = tree_map_only(Tensor, _meta, out)
        constant = None
        if func is _aten.lift_fresh_copy.default and out.numel() <= _CONSTANT_NUMEL:
            constant = args[0].clone()
        elif (
            torch.Tag.nondeterministic_seeded not in func.tags
            and all_constant
            and any_made
            and all(x.numel() <= _CONSTANT_NUMEL for x in tree_flatten(out)[0] if isinstance(x, Tensor))
        ):
            const_args, const_kwargs = _swap(args, kwargs, tensors, constants)
            constant = func(*const_args, **const_kwargs)
        if isinstance(out, Tensor):
            self.seen[out] = (node, constant, False)
        elif isinstance(out, (tuple, list)):
            for i, x in enumerate(out):
                if isinstance(x, Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    item.meta["val"] = _meta(x)
                    self.seen[x] = (item, constant[i] if isinstance(constant, (tuple, list)) else None, False)
        return out


def _swap(args: Any, kwargs: dict, tensors: list[Tensor], values: list[Tensor]) -> tuple[Any, dict]:
    """``args`` and ``kwargs`` with each of ``tensors`` replaced by its value in ``values``."""
    by_id = {id(x): v for x, v in zip(tensors, values, strict=True)}
    return tree_map_only(Tensor, lambda x: by_id[id(x)], (args, kwargs))
