"""No import circle in the package: not at module level, and not hidden in a function body.

Every ``import``/``from ... import`` of a ``pyro_scalable`` module counts, wherever it stands, but for those under
``if TYPE_CHECKING:`` (annotations only); a package's ``__init__`` counts as the module ``package``, and
``from package import submodule`` as an import of the submodule. A circle
means two layers that each need the other: the architecture (docs/developer/architecture.md) has none.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pyro_scalable"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import submodule`` imports the submodule (the package's __init__ runs before any of
            # its submodules anyway); ``from module import name`` imports the module
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name for name in submodules if name in modules] or [node.module]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    cycles = _cycles(_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_torch_dynamo():
    """Importing every module leaves ``torch._dynamo`` unimported: its import costs a process about a second.

    torch imports it itself at a process's first ``torch.func`` gradient (so a run pays it once); a ``torch.compile``
    or ``torch._dynamo`` reference at import time would make every import pay it.
    """
    script = (
        "import importlib, pkgutil, sys, pyro_scalable\n"
        "for m in pkgutil.walk_packages(pyro_scalable.__path__, 'pyro_scalable.'):\n"
        "    importlib.import_module(m.name)\n"
        "    if 'torch._dynamo' in sys.modules:\n"
        "        sys.exit(m.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT.parent)
    last = (done.stderr.strip().splitlines() or [""])[-1]  # the module that imported it, or the error
    assert done.returncode == 0, f"torch._dynamo imported by: {last}"


def test_a_default_run_imports_neither_torch_dynamo_nor_the_forward_mode_rules():
    """A default SGHMC run, from the mode search to the post-run probe and the ArviZ export, imports neither.

    ``torch._dynamo``: torch imports it at a process's first ``torch.func`` gradient (its ``_autograd_grad`` enters
    ``torch._dynamo.compiled_autograd``), over a second on a CPU; every gradient a run takes outside a user's
    transform is plain autograd: warm-up's noise and curvature for every chain at once
    (``infer/gradients/batched.py``), the metric's Hessian, the control probe, and the log joint's recording
    (``bridge/recording.py``). The forward-mode rules: the mode search's exact Hessian is d backward passes over the
    gradient, where ``torch.func.hessian``'s forward mode would have torch script its jvp decompositions
    (``torch._decomp.decompositions_for_jvp``, a few tenths of a second), and it is several times slower.
    """
    script = (
        "import sys, warnings, torch, pyro, pyro.distributions as dist\n"
        "from pyro_scalable.infer import SGHMC, StochasticMCMC\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(4000, 3, generator=g)\n"
        "y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.0, -0.5, 0.25])), generator=g)\n"
        "def model(x, y):\n"
        "    w = pyro.sample('w', dist.Normal(torch.zeros(3), 1.0).to_event(1))\n"
        "    with pyro.plate('data', len(x), subsample_size=100) as i:\n"
        "        pyro.sample('y', dist.Bernoulli(logits=x[i] @ w), obs=y[i])\n"
        "mcmc = StochasticMCMC(SGHMC(model), num_samples=100, num_warmup=200, num_chains=2, seed=0,\n"
        "                      progress_bar=False)\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    mcmc.run(x, y)\n"
        "    mcmc.to_inference_data()\n"
        "if mcmc.mode_search is None or mcmc.mode_search.hessian_passes < 1:\n"
        "    sys.exit(f'the run took no exact Hessian: {mcmc.mode_search}')\n"
        "if 'torch._decomp.decompositions_for_jvp' in sys.modules:\n"
        "    sys.exit('the forward-mode rules were loaded')\n"
        "if 'torch._dynamo' in sys.modules:\n"
        "    sys.exit('torch._dynamo was imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT.parent)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    assert done.returncode == 0, last
