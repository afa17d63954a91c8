"""densities._covers: torch.broadcast_shapes's answer without its import of sympy."""

import itertools
import subprocess
import sys

import torch

from pyro_scalable.bridge.densities import _covers


def test_covers_is_whether_the_shape_is_the_broadcast():
    dims = [(), (1,), (3,), (4,), (1, 3), (2, 3), (2, 1), (3, 3), (2, 1, 3), (5, 2, 3)]
    for a, b in itertools.product(dims, repeat=2):
        try:
            expected = torch.Size(a) == torch.broadcast_shapes(torch.Size(a), torch.Size(b))
        except RuntimeError:  # shapes that do not broadcast
            expected = False
        assert _covers(torch.Size(a), torch.Size(b)) is expected, (a, b)


def test_the_normal_fast_path_does_not_import_sympy():
    script = (
        "import sys, torch\n"
        "from torch.distributions import Normal\n"
        "from pyro_scalable.bridge.densities import summed_log_prob\n"
        "fn = Normal(torch.zeros(3), torch.tensor(2.0).expand(3))\n"
        "print(float(summed_log_prob(fn, torch.ones(3), 1.0, None)), 'sympy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    value, imported = out.stdout.split()
    expected = torch.distributions.Normal(torch.zeros(3), 2.0).log_prob(torch.ones(3)).sum()
    assert abs(float(value) - float(expected)) < 1e-5 * abs(float(expected))
    assert imported == "False"
