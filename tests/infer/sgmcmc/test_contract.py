"""The kernel contract is exactly what is read: every attribute of a kernel or its State that the driver, warm-up or
its rules read is written in ``program.KernelContract``/``program.ChainState`` or in the reading rule's
``kernel_reads``/``state_reads`` — and every registered kernel has all of it.

Read by scanning the modules outside the kernels (the driver, the phases, the stepper, warm-up, the rules, the
probes) for attribute reads on the names a kernel or its State goes by there.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
import torch

from pyro_scalable.infer import BAOAB, PSGLD, SGHMC, SGLD, SGNHT, CyclicalSGLD
from pyro_scalable.infer.sgmcmc import tuning
from pyro_scalable.infer.sgmcmc.program import ChainState, KernelContract

SGMCMC = Path(__file__).resolve().parents[3] / "pyro_scalable" / "infer" / "sgmcmc"
KERNEL_MODULES = {"sgld", "sghmc", "psgld", "sgnht", "baoab", "csgld", "kernel", "integrators", "sgd_limit", "mass"}
KERNEL_NAMES = {"kernel", "self.kernel", "run.kernel", "probe"}  # what a kernel is called outside the kernels
STATE_NAMES = {"state.kernel", "kernel_state", "chain"}  # and its State
CLASSES = [SGLD, SGHMC, PSGLD, SGNHT, BAOAB, CyclicalSGLD]


def _contract(protocol) -> set[str]:
    members = set(typing.get_type_hints(protocol)) | {
        name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")
    }
    return members


def _reads():
    """(module, enclosing class, what is read from, attribute) for every read outside the kernels."""
    for path in sorted(SGMCMC.glob("*.py")):
        if path.stem in KERNEL_MODULES:
            continue
        tree = ast.parse(path.read_text())
        for owner in [tree, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            body = owner.body
            name = owner.name if isinstance(owner, ast.ClassDef) else None
            for statement in body:
                if isinstance(statement, ast.ClassDef):
                    continue
                for node in ast.walk(statement):
                    if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
                        base = ast.unparse(node.value)
                        if base in KERNEL_NAMES | STATE_NAMES and isinstance(node.ctx, ast.Load):
                            yield path.stem, name, base, node.attr


def test_the_driver_and_warmup_read_of_a_kernel_only_its_written_contract():
    kernel_contract, state_contract = _contract(KernelContract), _contract(ChainState)
    rules = {type(rule).__name__: rule for rule in tuning.RULES.values()}
    outside = []
    for module, owner, base, attribute in _reads():
        rule = rules.get(owner) if module == "tuning" else None
        if module == "tuning" and owner is not None and rule is None:  # a base of rules: each rule under it declares
            under = [r for r in rules.values() if owner in {c.__name__ for c in type(r).__mro__}]
            # (the base rule's start reads friction and mass only for the rules that choose them)
            declared = [r for r in under if owner != "Rule" or attribute in r.chooses]
            if base in KERNEL_NAMES and declared and all(attribute in r.kernel_reads for r in declared):
                continue
        if base in KERNEL_NAMES and attribute not in kernel_contract | set(rule.kernel_reads if rule else ()):
            outside.append(f"{module}.{owner}: {base}.{attribute}")
        if base in STATE_NAMES and attribute not in state_contract | set(rule.state_reads if rule else ()):
            outside.append(f"{module}.{owner}: {base}.{attribute}")
    assert outside == []


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_kernel_has_the_whole_contract_and_what_its_rule_reads(cls):
    model = lambda: None  # noqa: E731  (no run: only the attributes are read)
    kernel = cls(model, step_size=0.1, cycle_length=10) if cls is CyclicalSGLD else cls(model, step_size=0.1)
    assert isinstance(kernel, KernelContract)
    state = kernel.init({"x": torch.zeros(2)})
    assert isinstance(state, ChainState)
    if kernel.warmup_rule is not None:
        rule = tuning.RULES[kernel.warmup_rule]
        assert all(hasattr(kernel, name) for name in rule.kernel_reads)
        assert all(name in state._fields for name in rule.state_reads)


def test_the_scan_sees_a_read_outside_the_contract():
    """The check cannot pass vacuously: the scan finds the rules' own reads (friction, square_count)."""
    found = {(module, owner, attribute) for module, owner, _, attribute in _reads()}
    assert ("tuning", "Momentum", "friction") in found
    assert ("tuning", "Preconditioned", "square_count") in found
    assert any(module == "mcmc" and attribute == "temperature" for module, _, attribute in found)
