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
3. **common subexpressions**: a deterministic operation repeated with the same inputs is computed once.

Folding and common subexpressions are skipped in a graph that mutates a tensor in place, where two equal-looking
operations need not give equal results.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, fx

__all__ = ["simplify", "value_shaped"]

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
