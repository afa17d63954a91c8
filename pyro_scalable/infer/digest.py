"""Content digests for checkpoint fingerprints: what a model computes and what its data hold, as one short string.

A checkpoint resumes a run only when the run would compute the same thing, so its fingerprint
(:func:`pyro_scalable.infer.fingerprint.check_fingerprint`) carries :func:`digest` of the model and of the data.

* **Tensors** enter by content (dtype, shape and every byte). A CPU tensor's bytes go through SHA-256 in chunks without
  a copy. A tensor on an accelerator is reduced on its device, chunk by chunk, to a 192-bit integer sketch (three sums,
  modulo 2^64, of its 32-bit words times pseudo-random weights drawn from the word's index), so that only 24 bytes cross
  to the host: any change of one value changes the sketch; it is not a defence against a crafted collision.
* **Functions** enter by their code: the bytecode, constants (nested functions' code included), names and local
  names, the defaults, the values in the closure, and every global the code reads: functions and classes of the
  user's code by their code, tensors, numpy arrays, modules and plain objects (a configuration dataclass) by value.
  The file name and line numbers do not enter, so moving a function leaves its digest alone, while any edit (even
  of its docstring) changes it. Bytecode differs between Python versions: a checkpoint resumes only on the Python
  version that wrote it. Functions, classes and other named objects of libraries (the standard library, installed
  packages, torch, Pyro, this one) enter by their importable name.
* **``nn.Module`` / ``PyroModule``** instances enter by the code of their classes (every class in the MRO outside
  torch, Pyro and this library), every parameter and buffer by content, their plain attributes and PyroModule's
  priors (``PyroSample``) and constraints (``PyroParam``). Bound methods enter by function and instance,
  ``functools.partial`` by function and arguments, other objects by class (and its code) and attributes.
* Containers (tuples, lists, dicts, sets) recursively; numbers, strings and the like by ``repr``.
* What has no content to read — a random number generator (whose state moves as a run goes on), an object of
  the user's code without attributes to read or nested too deep, a library's object that is neither named nor
  readable — is *unidentified*: :func:`identify` names it, and a checkpoint refuses to resume a run with such a
  component rather than guess.

What a digest cannot see: values a model reads at run time from outside its code and arguments (a file, Pyro's
global parameter store, an attribute of an imported library), and the code of library functions it calls.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
import sysconfig
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["Identity", "call_arguments", "digest", "identify", "tensor_digest"]

_CHUNK = 1 << 24  # bytes per SHA-256 update / elements per on-device reduction
_LIBRARIES = {"torch", "pyro", "pyro_scalable", "builtins", "numpy", "functools", "abc", "typing", "collections"}
_MAX_DEPTH = 6  # how deep attributes of plain objects are followed
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class Identity(NamedTuple):
    """A value's digest, and what in it could not be identified (empty where everything was)."""

    digest: str
    unidentified: tuple[str, ...]


def identify(value: Any) -> Identity:
    """The digest of ``value`` and the parts of it that have no content to read (see the module)."""
    hasher = _Hasher()
    hasher.feed(value)
    return Identity("sha256:" + hasher.hash.hexdigest(), tuple(dict.fromkeys(hasher.unidentified)))


def digest(value: Any) -> str:
    """A ``"sha256:..."`` string that changes when the code or content of ``value`` does (see the module)."""
    return identify(value).digest


def call_arguments(function: Callable, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """The arguments of a call by parameter name (defaults filled in), however they were passed.

    ``model(x, y)`` and ``model(x, y=y)`` bind the same values: a digest of this does not see the call style. Where
    ``function`` has no signature to bind to (or the call does not bind), ``(args, kwargs)`` as given.
    """
    try:
        target = function.forward if isinstance(function, nn.Module) else function
        bound = inspect.signature(target).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return (tuple(args), dict(kwargs))
    bound.apply_defaults()
    return dict(bound.arguments)


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
        self.unidentified: list[str] = []  # what had no content to read, named
        self.where = "the value"  # what is being fed, for naming what is unidentified

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
        elif _named(value):  # a library's function, class or other named object
            self.add("named", _name(value))
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
        elif isinstance(value, (types.ModuleType, types.BuiltinFunctionType)):
            self.add(_name(value))
        else:
            self.instance(value, depth)

    def instance(self, value: Any, depth: int) -> None:
        """An object by its class and attributes; named as unidentified where those cannot be read."""
        kind = type(value)
        attributes = getattr(value, "__dict__", None)
        slots = [name for klass in kind.__mro__ for name in getattr(klass, "__slots__", ()) if hasattr(value, name)]
        readable = isinstance(attributes, dict) or slots
        library = _library(kind.__module__)
        if isinstance(value, (torch.Generator, *_RANDOM_STATES)) or (
            (depth >= _MAX_DEPTH or not readable) and not library
        ):
            self.unidentified.append(f"{self.where} (a {_name(kind)})")
            self.add("unidentified", _name(kind))
            return
        self.cls(kind)
        if depth >= _MAX_DEPTH or not readable:  # a library's object (a lock, a logger's handler): by its class
            return
        self.feed(attributes if isinstance(attributes, dict) else {}, depth + 1)
        for name in slots:
            self.add(name)
            self.feed(getattr(value, name), depth + 1)

    def function(self, function: types.FunctionType) -> None:
        self.add("function", function.__qualname__)
        self.code(function.__code__)
        where, self.where = self.where, f"the defaults or closure of {function.__qualname__}"
        self.feed((function.__defaults__, function.__kwdefaults__))
        for cell in function.__closure__ or ():
            try:
                self.feed(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                self.add("<empty cell>")
        namespace = function.__globals__
        for name in sorted(_global_names(function.__code__)):
            if name not in namespace or name.startswith("__"):
                continue
            self.where = f"the global {name!r} read by {function.__qualname__}"
            self.add("global", name)
            self.feed(namespace[name])
        self.where = where

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


_RANDOM_STATES = tuple(
    getattr(sys.modules["numpy"].random, name)
    for name in ("Generator", "RandomState")
    if "numpy" in sys.modules and hasattr(sys.modules["numpy"].random, name)
)
_LIBRARY_PATHS = tuple(path for path in {sysconfig.get_paths().get(key) for key in ("purelib", "platlib")} if path)


@functools.lru_cache(maxsize=1024)
def _library(module: str | None) -> bool:
    """Whether ``module`` is a library's (this one, torch, Pyro, the standard library, an installed package)."""
    if not module or module in ("__main__", "__mp_main__"):
        return not module
    top = module.split(".")[0]
    if top in _LIBRARIES or top in sys.stdlib_module_names:
        return True
    file = getattr(sys.modules.get(module), "__file__", None) or ""
    return bool(file) and file.startswith(_LIBRARY_PATHS)


def _named(value: Any) -> bool:
    """Whether ``value`` is a library's object that its importable name identifies (a function, a class, a ufunc)."""
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str) or not _library(module) or isinstance(value, Tensor):
        return False
    found = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    return found is value


def _name(value: Any) -> str:
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{getattr(value, '__module__', None) or type(value).__module__}.{name}"
