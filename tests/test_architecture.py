"""The claims of docs/developer/architecture.md that a test can check, checked.

* which modules outside ``bridge/`` use ``pyro.poutine`` (the three the page names, and no other);
* the minibatch density's contract (``infer/gradients/density.py``): every density the package makes implements all
  of it, and no module probes a density for a part of it (``getattr``/``hasattr`` of ``examples``, ``terms``,
  ``batched_gradient``, ``replacement``, ``control``, ``active``);
* nothing sets a density's attributes, or the stepper's density, from outside;
* nothing under ``infer/`` imports the ArviZ adapter (``inference_data.py``, ``groups.py``, ``sources.py``) in any
  form: the results convert themselves through the hook of ``infer/record.py``, which the adapter fills.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.bridge import Batch, ModelBridge
from pyro_scalable.infer import record
from pyro_scalable.infer.full_data import full_data_gradient
from pyro_scalable.infer.gradients import (
    AffineMap,
    ControlledDensity,
    FunctionDensity,
    MinibatchDensity,
    WhitenedDensity,
)
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.results import Draws
from pyro_scalable.inference_data import to_inference_data

PACKAGE = Path(__file__).resolve().parents[1] / "pyro_scalable"
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "developer" / "architecture.md"
POUTINE_OUTSIDE_THE_BRIDGE = {"groups.py", "infer/gaussian_prior/model.py", "infer/uncertainty.py"}
CONTRACT = {"examples", "terms", "batched_gradient", "replacement", "control", "active"}
ADAPTER = {"pyro_scalable.inference_data", "pyro_scalable.groups", "pyro_scalable.sources"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def _uses_poutine(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("pyro.poutine") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("pyro.poutine") or (
                node.module == "pyro" and any(a.name == "poutine" for a in node.names)
            ):
                return True
        if isinstance(node, ast.Attribute) and node.attr == "poutine" and ast.unparse(node.value) == "pyro":
            return True
    return False


def test_only_the_modules_the_page_names_use_poutine_outside_the_bridge():
    outside = {name for name, tree in _modules() if not name.startswith("bridge/") and _uses_poutine(tree)}
    assert outside == POUTINE_OUTSIDE_THE_BRIDGE
    page = ARCHITECTURE.read_text()
    assert all(f"`{name}`" in page for name in POUTINE_OUTSIDE_THE_BRIDGE)


def test_no_module_probes_a_density_for_its_contract():
    probes = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") and len(node.args) >= 2:
                attribute = node.args[1]
                if isinstance(attribute, ast.Constant) and attribute.value in CONTRACT:
                    probes.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert probes == []


def test_nothing_sets_a_density_or_the_steppers_density_from_outside():
    writes = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign | ast.AugAssign)
                else []
            )
            for target in targets:
                for part in ast.walk(target):
                    if not isinstance(part, ast.Attribute) or ast.unparse(part.value) == "self":
                        continue
                    if part.attr in CONTRACT | {"density", "log_posterior_fn", "inner", "affine"}:
                        writes.append(f"{name}:{node.lineno} {ast.unparse(target)}")
    assert writes == []


def _imports(name: str, tree: ast.AST):
    """Each import anywhere in the module ``name`` (its path in the package), with the modules it may import.

    ``import a.b`` imports ``a.b``; ``from a import b`` imports ``a``, and ``a.b`` where ``b`` is a module; a relative
    import is resolved against the module's package; ``importlib.import_module``/``__import__`` of a constant count.
    """
    package = ["pyro_scalable", *Path(name).parts[:-1]]  # a package's __init__ is in the package it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            yield node, [module, *(f"{module}.{alias.name}" for alias in node.names)]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            yield node, [str(node.args[0].value)]


def _imports_of_the_adapter(name: str, tree: ast.AST) -> list[str]:
    return [
        f"{name}:{node.lineno} {ast.unparse(node)}"
        for node, modules in _imports(name, tree)
        if any(module == target or module.startswith(f"{target}.") for module in modules for target in ADAPTER)
    ]


def test_the_import_check_sees_every_form_of_import():
    forms = [
        "import pyro_scalable.inference_data",
        "import pyro_scalable.groups as g",
        "from pyro_scalable.inference_data import to_inference_data",
        "from pyro_scalable import sources",
        "from ...inference_data import to_inference_data",
        "from ... import groups",
        "def f():\n    from ...sources import run_record",
        "import importlib\nimportlib.import_module('pyro_scalable.inference_data')",
    ]
    for form in forms:
        assert len(_imports_of_the_adapter("infer/laplace/posterior.py", ast.parse(form))) == 1, form
    for form in ("from .. import record", "from ..record import RunRecord", "from pyro_scalable import infer"):
        assert _imports_of_the_adapter("infer/laplace/posterior.py", ast.parse(form)) == [], form


def test_nothing_under_infer_imports_the_arviz_adapter():
    # the adapter sits on top and reads the results through infer/record.py's protocols; a result's
    # to_inference_data() calls the converter the adapter registers there, so no import points up, even in a function
    upward = [
        hit for name, tree in _modules() if name.startswith("infer/") for hit in _imports_of_the_adapter(name, tree)
    ]
    assert upward == []


def test_a_result_converts_through_the_converter_the_adapter_registers(monkeypatch):
    assert record._converter is to_inference_data  # registered on import (import pyro_scalable imports the adapter)
    seen = []
    monkeypatch.setattr(record, "_converter", lambda source, **options: seen.append((source, options)))
    result = Draws()
    result.to_inference_data(thin=2)
    assert seen == [(result, {"thin": 2})]
    monkeypatch.setattr(record, "_converter", None)
    with pytest.raises(RuntimeError, match="no converter to ArviZ data is registered: import pyro_scalable"):
        result.to_inference_data()


def _model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y), subsample_size=5) as idx:
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])


def test_every_density_the_package_makes_implements_the_whole_contract():
    bridge = ModelBridge(_model, (torch.arange(20.0),))
    plain = bridge.log_posterior_fn
    controlled = ControlledDensity(plain, full_data_gradient(bridge, {"mu": torch.tensor(9.5)}))
    affine = AffineMap(torch.tensor([9.5]), torch.tensor([0.2]))
    whitened = WhitenedDensity(controlled, ParameterLayout({"mu": torch.Size()}), affine)
    for density in (plain, controlled, whitened, FunctionDensity(lambda latents, batch: -(latents["mu"] ** 2))):
        assert isinstance(density, MinibatchDensity)
    # the wrappers hand on the model's groups of examples, and its terms in their own variables
    batch = Batch({"data": torch.tensor([0, 3, 7, 12, 19])}, bridge.args, {})
    groups = plain.examples(batch)
    for density in (controlled, whitened):
        split = density.examples(batch)
        assert torch.equal(split.batches.indices["data"], groups.batches.indices["data"])
        assert split.population_size == 20 and split.group_size == groups.group_size
        assert density.terms is not None and len(density.terms) == 2
    assert FunctionDensity(lambda latents, batch: latents["mu"]).terms is None
