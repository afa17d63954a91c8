"""A log-density call's signature: what a recorded graph of the model stands for (:mod:`.traced`).

A call ``log_density(latents, batch)`` is split into its tensors — the graph's inputs — and everything else: the
nesting of its arguments (dicts, lists, tuples), the shapes, dtypes and devices of its tensors, and the values of
its other leaves. Two calls with the same signature run the same tensor operations in a model that does not branch
on values, so one recording serves both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor

from pyro_scalable.bridge.records import Batch, Latents

__all__ = ["CallSignature"]


class CallSignature:
    """One call's arguments split into tensors (the graph's inputs) and everything else (part of the signature).

    ``key`` is the signature, ``None`` where an argument cannot be hashed (such a call is never recorded).
    """

    def __init__(self, latents: Latents, batch: Batch):
        self.slots: list = []
        self.spec = _flatten((latents, batch.indices, batch.args, batch.kwargs), self.slots)
        self.paths = [path for path, leaf in self.slots if isinstance(leaf, Tensor)]
        self.tensors = [leaf for _, leaf in self.slots if isinstance(leaf, Tensor)]
        described = tuple((tuple(t.shape), t.dtype, t.device) for t in self.tensors)
        others = tuple((path, leaf) for path, leaf in self.slots if not isinstance(leaf, Tensor))
        self.key: Any = (self.spec, described, others)
        try:
            hash(self.key)
        except TypeError:
            self.key = None

    def describe(self) -> str:
        """The call's latents and minibatch indices with their shapes, for a log message."""
        parts = [f"{path[1]} {tuple(t.shape)}" for path, t in zip(self.paths, self.tensors, strict=True) if path[0] < 2]
        return "latents and indices " + ", ".join(parts)

    def rebuild(self, tensors) -> tuple[Latents, Batch]:
        """The call's ``(latents, batch)`` with ``tensors`` in place of its tensors."""
        values = iter(tensors)
        leaves = (next(values) if isinstance(leaf, Tensor) else leaf for _, leaf in self.slots)
        latents, indices, args, kwargs = _unflatten(self.spec, leaves)
        return latents, Batch(indices, args, kwargs)


def _flatten(tree: Any, slots: list, path: tuple = ()) -> Any:
    """The structure of ``tree`` (dicts, lists, tuples) as a hashable spec; its leaves appended to ``slots``."""
    if isinstance(tree, dict):
        return ("dict", tuple((key, _flatten(value, slots, (*path, key))) for key, value in tree.items()))
    if type(tree) in (tuple, list):
        return (type(tree).__name__, tuple(_flatten(value, slots, (*path, i)) for i, value in enumerate(tree)))
    slots.append((path, tree))
    return None


def _unflatten(spec: Any, leaves: Iterator) -> Any:
    if spec is None:
        return next(leaves)
    kind, children = spec
    if kind == "dict":
        return {key: _unflatten(child, leaves) for key, child in children}
    values = [_unflatten(child, leaves) for child in children]
    return tuple(values) if kind == "tuple" else values
