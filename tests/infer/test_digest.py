"""Content digests of models and data: equal for the same code and values, different after any edit."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample

from pyro_scalable.infer import digest as digests
from pyro_scalable.infer.digest import digest, tensor_digest

SOURCE = """
SCALE = 1.0

def helper(x):
    return x * 2.0

class Scaler:
    def scale(self, v):
        return v * 4.0

def model(x, noise=1.0):
    def inner(v):
        return v + 1.0
    return Scaler().scale(inner(helper(x))) * SCALE * noise
"""


def build(source: str = SOURCE, *, module: str = "user_model", lines: int = 0, filename: str = "model.py"):
    """The ``model`` defined by ``source`` in a fresh module namespace (``lines`` blank lines above it)."""
    namespace = {"__name__": module}
    exec(compile("\n" * lines + textwrap.dedent(source), filename, "exec"), namespace)
    return namespace["model"]


def closure(scale: torch.Tensor):
    def model(x):
        return x * scale

    return model


def test_the_same_code_and_values_give_the_same_digest():
    assert digest(build()) == digest(build())
    assert digest(build(lines=30, filename="elsewhere.py")) == digest(build())  # moved, not edited
    assert digest(closure(torch.ones(3))) == digest(closure(torch.ones(3)))
    assert digest((torch.arange(5.0), {"y": [torch.zeros(2)]})) == digest((torch.arange(5.0), {"y": [torch.zeros(2)]}))


@pytest.mark.parametrize(
    "edit",
    [
        ("* SCALE * noise", "* SCALE * noise * 1.5"),  # body
        ("return v + 1.0", "return v + 2.0"),  # a nested function
        ("return x * 2.0", "return x * 3.0"),  # a helper in the same module
        ("return v * 4.0", "return v * 5.0"),  # a method of a class in the same module
        ("SCALE = 1.0", "SCALE = 1.1"),  # a global it reads
        ("noise=1.0", "noise=2.0"),  # a default
        ("model", "model"),  # no edit: the control
    ],
    ids=["body", "nested", "helper", "class", "global", "default", "control"],
)
def test_any_edit_changes_the_digest(edit):
    edited = SOURCE.replace(*edit)
    assert (digest(build(edited)) == digest(build())) == (edited == SOURCE)


def test_closures_modules_partials_and_methods_enter_by_value():
    ones = torch.ones(3)
    other = ones.clone()
    other[1] = 1.0 + 1e-7
    assert digest(closure(ones)) != digest(closure(other))

    net, same = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    same.load_state_dict(net.state_dict())
    assert digest(net) == digest(same)
    with torch.no_grad():
        same.weight[0, 0] += 1e-6
    assert digest(net) != digest(same)

    class Bayesian(PyroModule):
        def __init__(self, scale):
            super().__init__()
            self.w = PyroSample(dist.Normal(0.0, torch.tensor(scale)))

        def forward(self, x):
            return x * self.w

    assert digest(Bayesian(1.0)) == digest(Bayesian(1.0))
    assert digest(Bayesian(1.0)) != digest(Bayesian(2.0))

    assert digest(functools.partial(closure(ones), torch.zeros(2))) != digest(functools.partial(closure(ones), ones))

    class Data:
        def __init__(self, y):
            self.y = y

        def model(self, x):
            return x - self.y

    assert digest(Data(ones).model) == digest(Data(ones.clone()).model)
    assert digest(Data(ones).model) != digest(Data(other).model)


def test_tensors_enter_by_dtype_shape_and_every_byte():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert tensor_digest(x) == tensor_digest(x.clone())
    changed = x.clone()
    changed[999] = torch.nextafter(changed[999], torch.tensor(10.0))  # the smallest change there is
    assert tensor_digest(changed) != tensor_digest(x)
    assert tensor_digest(x.double()) != tensor_digest(x)  # dtype
    assert tensor_digest(x.reshape(10, 100)) != tensor_digest(x)  # shape
    matrix = x.reshape(10, 100)
    assert tensor_digest(matrix.T) == tensor_digest(matrix.T.contiguous())
    assert tensor_digest(x.bfloat16()) != tensor_digest(changed.bfloat16() * 2)
    assert tensor_digest(torch.tensor(True)) != tensor_digest(torch.tensor(False))


def test_the_device_sketch_sees_every_value_and_ignores_the_chunking(monkeypatch):
    # the reduction accelerators use, run here on the CPU: one changed value changes it; chunks do not
    data = torch.randn(1001, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sketch = digests._device_sketch(data.view(torch.uint8))
    for index in (0, 500, 1000):
        changed = data.clone()
        changed[index] = torch.nextafter(changed[index], torch.tensor(10.0, dtype=torch.float64))
        assert not torch.equal(digests._device_sketch(changed.view(torch.uint8)), sketch), index
    swapped = data.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(digests._device_sketch(swapped.view(torch.uint8)), sketch)
    monkeypatch.setattr(digests, "_CHUNK", 7)
    assert torch.equal(digests._device_sketch(data.view(torch.uint8)), sketch)
    odd = torch.arange(7, dtype=torch.uint8)  # a byte count that is not a multiple of 4
    assert not torch.equal(digests._device_sketch(odd), digests._device_sketch(odd.flip(0)))


def test_a_digest_does_not_depend_on_the_process(tmp_path):
    # sets (a constant of `x in {...}`) iterate in an order that changes with PYTHONHASHSEED
    script = tmp_path / "user_model.py"
    script.write_text(
        "import torch\n"
        "from pyro_scalable.infer.digest import digest\n"
        "def model(x, kind):\n"
        "    return x if kind in {'alpha', 'beta', 'gamma', 'delta'} else -x\n"
        "print(digest((model, {'x': torch.arange(3.0), 'tags': {'a', 'b', 'c'}})))\n"
    )
    root = str(Path(__file__).parents[2])
    outputs = {
        subprocess.run(
            [sys.executable, str(script)],
            env={**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1, outputs


CONFIGURED = """
import numpy as np

class Config:  # a plain object (as a dataclass instance is)
    def __init__(self):
        self.noise_sd = 1.0

CONFIG = Config()
WEIGHTS = np.array([1.0, 2.0])

def model(x):
    return x * CONFIG.noise_sd + float(WEIGHTS.sum())
"""


def test_numpy_arrays_and_plain_objects_the_model_reads_enter_by_value():
    first, second = build(CONFIGURED), build(CONFIGURED)
    assert digest(first) == digest(second)
    second.__globals__["CONFIG"].noise_sd = 3.0  # a config dataclass edited between two runs
    assert digest(first) != digest(second)
    third = build(CONFIGURED)
    third.__globals__["WEIGHTS"][1] = 2.5  # a module-level numpy array
    assert digest(first) != digest(third)


def test_what_has_no_content_is_named_unidentified():
    source = "import torch\nRNG = torch.Generator()\ndef model(x):\n    return x + torch.randn((), generator=RNG)\n"
    identity = digests.identify(build(source))
    assert identity.unidentified == ("the global 'RNG' read by model (a torch._C.Generator)",)
    assert digests.identify(build()).unidentified == ()  # functions, classes, numbers: all identified


def test_the_call_style_does_not_change_the_arguments():
    def model(x, y=None, *, scale=1.0):
        return x

    x, y = torch.arange(3.0), torch.ones(3)
    positional = digests.call_arguments(model, (x, y), {})
    assert digest(positional) == digest(digests.call_arguments(model, (x,), {"y": y}))
    assert digest(positional) == digest(digests.call_arguments(model, (), {"x": x, "y": y, "scale": 1.0}))
    assert digest(positional) != digest(digests.call_arguments(model, (x, y), {"scale": 2.0}))
