r"""Rewrites of a recorded log density (:mod:`.traced`) that keep every value it computes.

A model run through Pyro does work that gives the same result on every call: each ``pyro.sample`` adds its term
to a running sum that starts at ``0.0``; ``biject_to(constraints.positive)`` computes ``exp(u)`` for the value and
again for ``log|det J|``, which adds ``zeros_like`` to ``u``; ``HalfNormal(1.)`` builds a tensor of ones and its
square and logarithm; ``group[idx]`` is indexed once per use. A replay pays for each of these operations
(forward and backward, and under ``torch.func.vmap`` each one's batching rule), so the graph is rewritten first:

1. **folding**: a value computed only from tensors the model creates from literals (``new_ones``, ``full_like``,
   ``scalar_tensor``, ``torch.tensor(1.)``: their inputs give at most a shape, dtype and device, which the
   recording's signature fixes) is computed once and becomes a constant. Tensors the model reads from outside —
   data, module buffers — are never folded, so an in-place change to them is still seen;
2. **identities**: ``x * 1``, ``x + 0`` and ``x - z`` for ``z`` zeros by construction, where the result has
   ``x``'s shape and dtype, become ``x``;
3. **common subexpressions**: a deterministic operation repeated with the same inputs is computed once;
4. **Python bindings** (:func:`bind_python`): the recording calls each operation as ``torch.ops.aten.<op>.<overload>``,
   whose boxed call converts every argument through the operation's schema; ``torch.<op>``, the tensor method or
   ``x[indices]`` reach the same kernel through torch's generated bindings, sooner per operation, and sooner again for
   its backward. A node is rebound only where, on the recording's own inputs, the binding dispatches exactly that one
   overload and returns the same result bit for bit (dtype, shape, strides, values); anything else keeps its ATen call;
5. **row lookups** (:func:`gather_rows`): ``x[idx]``, a data matrix's rows at a minibatch's indices, becomes
   ``torch.embedding(x, idx)`` (a vector's: ``x.index_select(0, idx)``), the same copy of the same rows: ATen's advanced
   indexing costs several times as much on the CPU, and more again under ``vmap`` over chains. Only where ``idx`` is the
   plate's subsample (never negative, which a lookup would refuse) and ``x`` is not a latent (no gradient flows back
   through it).

Folding and common subexpressions are skipped in a graph that mutates a tensor in place, where two equal-looking
operations need not give equal results; an operation that mutates or draws at random is never rebound.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, fx
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["bind_python", "gather_rows", "simplify", "value_shaped"]

_aten = torch.ops.aten
# operations whose output shape depends on their input's values
_VALUE_SHAPED = {"nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}
_VALUE_SHAPED |= {"repeat_interleave", "bincount", "nonzero_static", "argwhere", "_local_scalar_dense"}
# operations whose output depends on their tensor inputs' shape, dtype and device only
_FACTORIES = {"zeros", "ones", "full", "scalar_tensor", "new_zeros", "new_ones", "new_full"}
_FACTORIES |= {"zeros_like", "ones_like", "full_like"}
_FOLDED = "_folded_"  # the names of the constants folding makes
_VIEWS = {"expand", "clone", "view", "select", "unsqueeze", "_to_copy", "lift_fresh_copy", "alias"}


def _name(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema.name.split("::")[-1] if schema is not None else ""


def _pure(node: fx.Node) -> bool:
    """A call whose result depends on its arguments only (no random draw, no mutation)."""
    target = node.target
    if node.op != "call_function" or not hasattr(target, "_schema"):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ())


def _mutable(node: fx.Node) -> bool:
    return bool(getattr(getattr(node.target, "_schema", None), "is_mutable", False))


def value_shaped(graph: fx.GraphModule) -> set[str]:
    """The operations in ``graph`` whose output shape depends on values (a boolean mask as an index included).

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> value_shaped(make_fx(lambda x: x[x > 0].sum())(torch.randn(3)))
        {'index with a boolean mask'}

    """
    names = set()
    for node in graph.graph.nodes:
        name = _name(node)
        if name in _VALUE_SHAPED:
            names.add(name)
        if name == "index":
            for index in node.args[1]:
                value = getattr(index, "meta", {}).get("val")
                if value is not None and value.dtype == torch.bool:
                    names.add("index with a boolean mask")
    return names


def _folded(node: Any) -> Tensor | None:
    """The value of a constant this module folded (never a tensor the model read from outside)."""
    if isinstance(node, fx.Node) and node.op == "get_attr" and node.target.startswith(_FOLDED):
        return getattr(node.graph.owning_module, node.target)
    return None


def _is_zero(node: Any) -> bool:
    """Whether ``node`` is zeros by construction (a zeros factory, a folded zero, or a view or copy of one)."""
    if not isinstance(node, fx.Node):
        return False
    folded = _folded(node)
    if folded is not None:
        return not bool(folded.any())
    name = _name(node)
    if name in ("zeros", "new_zeros", "zeros_like"):
        return True
    if name in ("full_like", "full", "new_full"):
        fill = node.args[1] if len(node.args) > 1 else node.kwargs.get("fill_value")
        return _is_number(fill, 0)
    return name in _VIEWS and _is_zero(node.args[0])


def _is_number(x: Any, number: int) -> bool:
    return type(x) in (int, float) and x == number


def _same_as_first(node: fx.Node) -> bool:
    """Whether ``node`` is ``x * 1``, ``x + 0`` or ``x - zeros`` with the shape and dtype of ``x``."""
    if len(node.args) != 2 or node.kwargs:
        return False
    first, other = node.args
    value = node.meta.get("val")
    before = first.meta.get("val") if isinstance(first, fx.Node) else None
    if not (isinstance(value, Tensor) and isinstance(before, Tensor)):
        return False
    if before.shape != value.shape or before.dtype != value.dtype:
        return False
    if node.target in (_aten.mul.Tensor, _aten.mul.Scalar):
        folded = _folded(other)
        return _is_number(other, 1) or (folded is not None and bool((folded == 1).all()))
    if node.target in (_aten.add.Tensor, _aten.sub.Tensor, _aten.add.Scalar, _aten.sub.Scalar):
        return _is_number(other, 0) or _is_zero(other)
    return False


def _static(graph: fx.GraphModule) -> set[fx.Node]:
    """The nodes computed from literals alone (see the module docstring, 1)."""
    static: set[fx.Node] = set()
    for node in graph.graph.nodes:
        if not _pure(node):
            continue
        name = _name(node)
        inputs = node.all_input_nodes
        if name in _FACTORIES:
            static.add(node)
        elif name == "lift_fresh_copy" and inputs and inputs[0].op == "get_attr":
            static.add(node)  # torch.tensor(literal) inside the model: a fresh copy of a literal on every call
        elif inputs and all(a in static for a in inputs):
            static.add(node)
    return static


class _Values(fx.Interpreter):
    def __init__(self, graph: fx.GraphModule, keep: set[fx.Node]):
        super().__init__(graph)
        self.keep, self.values = keep, {}

    def run_node(self, node: fx.Node) -> Any:
        out = super().run_node(node)
        if node in self.keep:
            self.values[node] = out
        return out


def _fold(graph: fx.GraphModule, inputs: list[Tensor]) -> None:
    static = _static(graph)
    frontier = {n for n in static if isinstance(n.meta.get("val"), Tensor) and any(u not in static for u in n.users)}
    if not frontier:
        return
    with torch.no_grad():
        values = _Values(graph, frontier)
        values.run(*inputs)
    order = {node: i for i, node in enumerate(graph.graph.nodes)}
    for i, node in enumerate(sorted(frontier, key=order.__getitem__)):
        name = f"{_FOLDED}{i}"
        graph.register_buffer(name, values.values[node].detach().clone())
        with graph.graph.inserting_before(node):
            constant = graph.graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)


def _key(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_key, x))
    if isinstance(x, dict):
        return ("dict", *((k, _key(v)) for k, v in sorted(x.items())))
    if isinstance(x, float) and x != x:
        return ("nan",)
    return x


def _deduplicate(graph: fx.GraphModule) -> None:
    seen: dict[Any, fx.Node] = {}
    for node in list(graph.graph.nodes):
        if not _pure(node):
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
        else:
            seen[key] = node


def simplify(graph: fx.GraphModule, inputs: list[Tensor]) -> None:
    """Rewrite ``graph`` in place as the module docstring says; ``inputs``: placeholder values (shapes matter only).

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> graph = make_fx(lambda x: (x * 1 + 0).exp() + x.exp())(torch.randn(3))
        >>> simplify(graph, [torch.randn(3)])
        >>> [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        ['aten.exp.default', 'aten.add.Tensor']

    """
    mutates = any(_mutable(node) for node in graph.graph.nodes)
    if not mutates:
        _fold(graph, inputs)
    for node in list(graph.graph.nodes):  # in order: a chain of identities collapses
        if node.op == "call_function" and _same_as_first(node):
            node.replace_all_uses_with(node.args[0])
    if not mutates:
        _deduplicate(graph)
    graph.graph.eliminate_dead_code()
    graph.recompile()


class _Dispatched(TorchDispatchMode):
    """Records the ATen operations a call reaches below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # see recording._Recorder: torch would import torch._dynamo at the first call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _identical(a: Any, b: Any) -> bool:
    """The same result bit for bit: type, dtype, shape, strides and values (NaN where NaN)."""
    if isinstance(a, Tensor):
        if not isinstance(b, Tensor) or (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
            return False
        if a.layout != torch.strided or b.layout != torch.strided or a.stride() != b.stride():
            return False
        same = a == b
        if a.is_floating_point() or a.is_complex():
            same = same | (a.isnan() & b.isnan())
        return bool(same.all())
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_identical, a, b))
    return type(a) is type(b) and a == b


def _bindings(node: fx.Node) -> Iterator[tuple[str, Any, tuple, dict]]:
    """Faster calls that may stand for ``node``'s ATen call: ``(op, target, args, kwargs)`` as fx nodes take them."""
    name = _name(node)
    if name == "index" and len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], (list, tuple)):
        yield "call_function", operator.getitem, (node.args[0], tuple(node.args[1])), {}
    function = getattr(torch._C._VariableFunctions, name, None)
    if function is not None:
        yield "call_function", function, node.args, node.kwargs
    if hasattr(torch.Tensor, name) and node.args:
        yield "call_method", name, node.args, node.kwargs


def _rebind(node: fx.Node, op: str, target: Any, args: tuple, kwargs: dict) -> None:
    """Point ``node`` at another call of the same result, keeping its ATen call as ``node.meta["aten_call"]``."""
    node.meta["aten_call"] = (node.target, node.args, node.kwargs)
    node.op, node.target, node.args, node.kwargs = op, target, args, kwargs


def bind_python(graph: fx.GraphModule, inputs: list[Tensor]) -> int:
    """Call each ATen operation of ``graph`` through torch's Python bindings where that is the same call.

    Runs the graph once on ``inputs`` (its placeholders' values); returns how many nodes were rebound (module
    docstring, 4). A rebound node keeps its ATen call as ``node.meta["aten_call"]``: ``(target, args, kwargs)``.

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> graph = make_fx(lambda x, i: (x[i] * 2.0).exp().sum())(torch.randn(5), torch.tensor([0, 3]))
        >>> bind_python(graph, [torch.randn(5), torch.tensor([0, 3])])
        4
        >>> print(graph.code.strip().splitlines()[1].strip())
        index = x_1[(i_1,)];  x_1 = i_1 = None

    """
    values: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    bound = 0

    def load(arguments):
        return fx.node.map_arg(arguments, values.__getitem__)

    with torch.no_grad():
        for node in list(graph.graph.nodes):
            if node.op == "placeholder":
                values[node] = next(placeholders)
                continue
            if node.op == "output":
                continue
            if node.op == "get_attr":
                values[node] = getattr(graph, node.target)
                continue
            args, kwargs = load(node.args), load(node.kwargs)
            fn = getattr(args[0], node.target) if node.op == "call_method" else node.target
            values[node] = expected = fn(*(args[1:] if node.op == "call_method" else args), **kwargs)
            if not isinstance(node.target, torch._ops.OpOverload) or not _pure(node):
                continue
            for op, target, new_args, new_kwargs in _bindings(node):
                args, kwargs = load(new_args), load(new_kwargs)
                if op == "call_method" and not isinstance(args[0], Tensor):
                    continue
                seen = _Dispatched()
                try:
                    with seen:
                        got = (
                            getattr(args[0], target)(*args[1:], **kwargs)
                            if op == "call_method"
                            else target(*args, **kwargs)
                        )
                except (TypeError, RuntimeError, ValueError, IndexError):  # the binding takes other arguments
                    continue
                if seen.ops == [node.target] and _identical(expected, got):
                    _rebind(node, op, target, new_args, new_kwargs)
                    bound += 1
                    break
    graph.recompile()
    return bound


def gather_rows(graph: fx.GraphModule, inputs: list[Tensor], rows: set[int], data: set[int]) -> int:
    """Look up a minibatch's rows of a data tensor instead of indexing it (module docstring, 5); how many nodes.

    ``rows``: the positions of the placeholders that hold a plate's subsample indices; ``data``: those that hold no
    latent. A node is rewritten only where the lookup gives ``inputs``' result bit for bit; it keeps its ATen call
    as ``node.meta["aten_call"]``. Run before :func:`bind_python` (which rebinds the indexing otherwise).

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> x, i = torch.randn(5, 2), torch.tensor([4, 0])
        >>> graph = make_fx(lambda x, i: x[i].sum())(x, i)
        >>> gather_rows(graph, [x, i], rows={1}, data={0})
        1
        >>> print(graph.code.strip().splitlines()[1].strip())
        index = torch.embedding(x_1, i_1);  x_1 = i_1 = None

    """
    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    position = {node: k for k, node in enumerate(placeholders)}
    rewritten = 0
    for node in graph.graph.nodes:
        if node.target is not _aten.index.Tensor or len(node.args) != 2 or len(node.args[1]) != 1:
            continue
        x, value = node.args[0], node.args[1][0]
        if position.get(x) not in data or position.get(value) not in rows:
            continue
        tensor, index = inputs[position[x]], inputs[position[value]]
        if tensor.dim() == 2:
            target, args = torch.embedding, (x, value)
        elif tensor.dim() == 1 and index.dim() == 1:
            target, args = torch.index_select, (x, 0, value)
        else:
            continue
        try:
            with torch.no_grad():
                lookup = target(*[tensor if a is x else index if a is value else a for a in args])
        except (TypeError, RuntimeError, IndexError):  # an index the lookup does not take (dtype, device): kept
            continue
        if _identical(tensor[index], lookup):
            _rebind(node, "call_function", target, args, {})
            rewritten += 1
    graph.recompile()
    return rewritten
