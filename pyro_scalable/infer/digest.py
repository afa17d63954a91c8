"""Content digests for checkpoint fingerprints: what a model computes and what its data hold, as one short string.

A checkpoint resumes a run only when the run would compute the same thing, so its fingerprint
(:func:`pyro_scalable.infer.checkpoint.check_fingerprint`) carries :func:`digest` of the model and of the data.

* **Tensors** enter by content (dtype, shape and every byte). A CPU tensor's bytes go through SHA-256 in chunks
  without a copy (about 0.05 s for 10^7 float32 values on one core with SHA extensions). A tensor on an
  accelerator is reduced on its device, chunk by chunk, to a 192-bit integer sketch (three sums, modulo 2^64, of
  its 32-bit words times pseudo-random weights drawn from the word's index), so that only 24 bytes cross to the
  host: any change of one value changes the sketch; it is not a defence against a crafted collision.
* **Functions** enter by their code: the bytecode, constants (nested functions' code included), names and local
  names, the defaults, the values in the closure, and the functions, classes, tensors, modules and plain values
  of the same module that the code reads as globals. The file name and line numbers do not enter, so moving a
  function leaves its digest alone, while any edit (even of its docstring) changes it. Bytecode differs between
  Python versions: a checkpoint resumes only on the Python version that wrote it.
* **``nn.Module`` / ``PyroModule``** instances enter by the code of their classes (every class in the MRO outside
  torch, Pyro and this library), every parameter and buffer by content, their plain attributes and PyroModule's
  priors (``PyroSample``) and constraints (``PyroParam``). Bound methods enter by function and instance,
  ``functools.partial`` by function and arguments, other objects by class (and its code) and attributes.
* Containers (tuples, lists, dicts, sets) recursively; numbers, strings and the like by ``repr``.

What a digest cannot see: values a model reads at run time from outside its code and arguments (a file, Pyro's
global parameter store, an attribute of an imported library), and the code of library functions it calls.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["digest", "tensor_digest"]

_CHUNK = 1 << 24  # bytes per SHA-256 update / elements per on-device reduction
_LIBRARIES = {"torch", "pyro", "pyro_scalable", "builtins", "numpy", "functools", "abc", "typing", "collections"}
_MAX_DEPTH = 4  # how deep attributes of plain objects are followed
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def digest(value: Any) -> str:
    """A ``"sha256:..."`` string that changes when the code or content of ``value`` does (see the module)."""
    hasher = _Hasher()
    hasher.feed(value)
    return "sha256:" + hasher.hash.hexdigest()


def tensor_digest(tensor: Tensor) -> bytes:
    """The bytes that stand for one tensor's content: its dtype, shape and data, hashed on its device."""
    tensor = tensor.detach()
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    head = f"{tensor.dtype}{list(tensor.shape)}".encode()
    if tensor.device.type == "meta":
        return head + b"meta"
    words = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    if tensor.device.type == "cpu":
        hasher = hashlib.sha256(head)
        data = words.numpy()
        for start in range(0, data.size, _CHUNK):
            hasher.update(data[start : start + _CHUNK])
        return hasher.digest()
    return head + _device_sketch(words).cpu().numpy().tobytes()


def _device_sketch(data: Tensor) -> Tensor:
    """Three sums modulo 2^64 over the 32-bit words of ``data`` (uint8, flat), computed on its device."""
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    words = data.view(torch.int32)
    total = torch.zeros(3, dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _CHUNK):
        value = words[start : start + _CHUNK].to(torch.int64)
        index = torch.arange(start, start + value.numel(), dtype=torch.int64, device=data.device)
        weight = index * -7046029254386353131 + 0x632BE59BD9B4E019  # a multiplicative hash of the index
        weight = weight ^ (weight >> 29)
        total[0] += (value * weight).sum()
        total[1] += ((value ^ weight) * (weight | 1)).sum()
        total[2] += (value * (index + 1)).sum()
    return total


class _Hasher:
    def __init__(self):
        self.hash = hashlib.sha256()
        self.seen: dict[int, Any] = {}  # id -> object, kept alive so that an id cannot be reused meanwhile
        self.classes: set[type] = set()  # classes whose code is in already

    def add(self, *parts: Any) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode()
            self.hash.update(len(data).to_bytes(8, "little") + data)

    def first_time(self, value: Any) -> bool:
        if id(value) in self.seen:
            self.add("<seen>")
            return False
        self.seen[id(value)] = value
        return True

    def feed(self, value: Any, depth: int = 0) -> None:
        if isinstance(value, Tensor):
            self.add("tensor", tensor_digest(value))
        elif isinstance(value, _ATOMS):
            self.add(type(value).__name__, repr(value))
        elif not self.first_time(value):
            return
        elif isinstance(value, (tuple, list)):
            self.add(type(value).__name__, len(value))
            for item in value:
                self.feed(item, depth)
        elif isinstance(value, Mapping):
            self.add(type(value).__name__, len(value))
            for key, item in value.items():
                self.feed(key, depth)
                self.feed(item, depth)
        elif isinstance(value, (set, frozenset)):
            self.add(type(value).__name__, *sorted(digest(item) for item in value))  # set order varies by process
        elif isinstance(value, functools.partial):
            self.add("partial")
            self.feed((value.func, value.args, value.keywords), depth)
        elif isinstance(value, types.MethodType):
            self.add("method")
            self.feed(value.__func__, depth)
            self.feed(value.__self__, depth)
        elif isinstance(value, types.FunctionType):
            self.function(value)
        elif isinstance(value, types.CodeType):
            self.code(value)
        elif isinstance(value, nn.Module):
            self.module(value)
        elif isinstance(value, type):
            self.cls(value)
        elif isinstance(value, (staticmethod, classmethod)):
            self.feed(value.__func__, depth)
        elif isinstance(value, property):
            self.feed((value.fget, value.fset, value.fdel), depth)
        elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
            self.add("numpy", getattr(value, "dtype", ""), getattr(value, "shape", ""), value.tobytes())
        elif isinstance(value, (types.ModuleType, types.BuiltinFunctionType)) or depth >= _MAX_DEPTH:
            self.add(_name(value))
        else:
            self.cls(type(value))
            attributes = getattr(value, "__dict__", None)
            self.feed(attributes if isinstance(attributes, dict) else _name(value), depth + 1)

    def function(self, function: types.FunctionType) -> None:
        self.add("function", function.__qualname__)
        self.code(function.__code__)
        self.feed((function.__defaults__, function.__kwdefaults__))
        for cell in function.__closure__ or ():
            try:
                self.feed(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                self.add("<empty cell>")
        namespace, module = function.__globals__, function.__module__
        for name in sorted(_global_names(function.__code__)):
            if name not in namespace:
                continue
            value = namespace[name]
            same_module = getattr(value, "__module__", None) == module
            if (
                isinstance(value, (Tensor, nn.Module, *_ATOMS))
                or (isinstance(value, (types.FunctionType, type)) and same_module)
                or (isinstance(value, (tuple, list, dict)) and not name.startswith("__"))
            ):
                self.add("global", name)
                self.feed(value)

    def code(self, code: types.CodeType) -> None:
        self.add("code", code.co_code, code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount)
        self.add(code.co_flags, code.co_freevars, code.co_cellvars)
        for constant in code.co_consts:
            if isinstance(constant, types.CodeType):
                self.code(constant)
            else:
                self.feed(constant)

    def cls(self, cls: type) -> None:
        self.add("class", _name(cls))
        for klass in cls.__mro__:
            if klass.__module__.split(".")[0] in _LIBRARIES or klass in self.classes:
                continue
            self.classes.add(klass)
            for name, attribute in sorted(vars(klass).items()):
                if isinstance(attribute, (types.FunctionType, staticmethod, classmethod, property, *_ATOMS)):
                    self.add(name)
                    self.feed(attribute)

    def module(self, module: nn.Module) -> None:
        for name, sub in module.named_modules(remove_duplicate=False):
            self.add("module", name)
            self.cls(type(sub))
            for key, value in sorted(vars(sub).items()):
                if isinstance(value, _ATOMS) or key in ("_pyro_samples", "_pyro_params"):
                    self.add(key)
                    self.feed(value, _MAX_DEPTH - 2)
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            self.add(name)
            self.feed(tensor)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names


def _name(value: Any) -> str:
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{getattr(value, '__module__', None) or type(value).__module__}.{name}"
