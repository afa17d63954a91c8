"""Which parameters of a network are random: the choices of ``BayesianNetwork(random=...)``, resolved to names.

A choice is resolved against ``module.named_parameters()`` (shared parameters once, under their first name) into an
ordered list of dotted parameter names; every other parameter is held fixed. The choices:

* ``"all"``: every parameter;
* ``"last_layer"`` or :class:`LastLayers` ``(k)``: the parameters of the last ``k`` submodules that own parameters,
  in the order the network registers them (for a ``Sequential`` or a network whose ``__init__`` declares its layers
  in the order they run, the last layers applied);
* ``"lora"``: the low-rank adapters, the parameters whose name holds ``lora_`` (``peft``'s ``lora_A``/``lora_B``
  and its embedding adapters; a hand-made adapter named the same way is picked up too);
* a name, a ``fnmatch`` pattern or a submodule's dotted path (``"fc2"`` selects ``fc2.weight`` and ``fc2.bias``);
* a module type such as ``nn.Linear`` (the parameters that such modules own themselves);
* a list or tuple mixing the above (their union), or a callable ``(name, parameter) -> bool``.

A choice that selects nothing, and a name or pattern in a list that matches no parameter, is a ``ValueError``
naming the argument and the parameters and submodules there are to choose from.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any, Union

from torch import Tensor, nn

__all__ = ["LastLayers", "RandomChoice", "select_parameters"]


class LastLayers:
    """The parameters of the last ``k`` submodules that own parameters (``k = 1``: the last layer).

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> select_parameters(net, LastLayers(2))
        ['2.weight', '2.bias', '4.weight', '4.bias']

    """

    def __init__(self, k: int = 1):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"LastLayers(k): k must be an int >= 1, got {k!r}.")
        self.k = k

    def __repr__(self) -> str:
        return f"LastLayers({self.k})"


RandomChoice = Union[str, LastLayers, type, Sequence[Any], Callable[[str, Tensor], bool]]


def _owners(module: nn.Module) -> list[tuple[str, list[str]]]:
    """Each submodule that owns parameters, with the dotted names of the parameters it owns, in registration order."""
    names = {id(p): name for name, p in module.named_parameters()}  # shared parameters under their first name
    owners, seen = [], set()
    for path, sub in module.named_modules():
        own = [names[id(p)] for p in sub.parameters(recurse=False) if id(p) in names and id(p) not in seen]
        seen.update(id(p) for p in sub.parameters(recurse=False))
        if own:
            owners.append((path, own))
    return owners


def _choices(module: nn.Module) -> str:
    names = [name for name, _ in module.named_parameters()]
    listed = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
    paths = [path for path, _ in _owners(module)]
    modules = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
    return (
        f"the network's parameters are {listed}; its layers {modules}. Choose 'all', 'last_layer', LastLayers(k), "
        "'lora', parameter names, fnmatch patterns ('*.bias'), layer paths, a module type such as nn.Linear, or a "
        "callable (name, parameter) -> bool"
    )


def _matches(choice: str, name: str) -> bool:
    return name == choice or name.startswith(choice + ".") or fnmatch.fnmatchcase(name, choice)


def _resolve(module: nn.Module, choice: Any, names: list[str], strict: bool) -> set[str]:
    if isinstance(choice, str):
        if choice == "all":
            return set(names)
        if choice == "last_layer":
            return _resolve(module, LastLayers(1), names, strict)
        if choice == "lora":
            found = {name for name in names if "lora_" in name}
        else:
            found = {name for name in names if _matches(choice, name)}
        if strict and not found:
            what = "no parameter name holds 'lora_' (no LoRA adapter)" if choice == "lora" else "matches no parameter"
            raise ValueError(f"random={choice!r} {what}: {_choices(module)}.")
        return found
    if isinstance(choice, LastLayers):
        return {name for _, own in _owners(module)[-choice.k :] for name in own}
    if isinstance(choice, type) and issubclass(choice, nn.Module):
        found = {
            name for path, own in _owners(module) if isinstance(module.get_submodule(path), choice) for name in own
        }
        if strict and not found:
            raise ValueError(f"random={choice.__name__} matches no module that owns parameters: {_choices(module)}.")
        return found
    if isinstance(choice, (list, tuple)):
        if not choice:
            raise ValueError(f"random=[] selects no parameter: {_choices(module)}.")
        return set().union(*(_resolve(module, part, names, True) for part in choice))
    if callable(choice):
        parameters = dict(module.named_parameters())
        return {name for name in names if choice(name, parameters[name])}
    raise TypeError(
        f"random must be a string, LastLayers(k), a module type, a list of these or a callable, got {choice!r}."
    )


def select_parameters(module: nn.Module, random: RandomChoice = "all") -> list[str]:
    """The dotted names of the parameters ``random`` selects, in the network's order.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> select_parameters(net, "*.bias")
        ['0.bias', '2.bias']

    """
    names = [name for name, _ in module.named_parameters()]
    if not names:
        raise ValueError(f"the network {type(module).__name__} has no parameters to make random.")
    chosen = _resolve(module, random, names, strict=True)
    if not chosen:
        raise ValueError(f"random={random!r} selects no parameter: {_choices(module)}.")
    return [name for name in names if name in chosen]
