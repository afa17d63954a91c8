"""The peers' reference: its importance weights' closed-form log joint is Pyro's potential energy, negated.

``benchmarks.problems.reference`` weighs its draws by the regressions' own log joint, a chunk of draws per pass over
the data (at N = 10⁶ and d = 100 a draw at a time through Pyro takes an hour), and checks it against Pyro's at three
draws. Here it is checked at every draw, across chunk boundaries, and the check is shown to fail on a wrong one.
"""

from __future__ import annotations

import pytest
import torch
from pyro.infer.mcmc.util import initialize_model

from benchmarks.problems import Problem, _log_joints


def _pyro_potential(problem: Problem, x, y):
    _, potential_fn, _, _ = initialize_model(problem.pyro_model(), (x, y))

    def potential(theta):
        latents = {"w": theta[: problem.d]}
        if problem.kind == "regression":
            latents["scale"] = theta[problem.d]  # unconstrained: log sigma
        return potential_fn(latents)

    return potential


@pytest.mark.parametrize("kind", ["logistic", "regression"])
def test_closed_form_log_joint_is_pyros_at_every_draw(kind):
    problem = Problem("test", kind, 3, "")
    data = problem.data(400, seed=1)
    x, y = data.x.double(), data.y.double()
    potential = _pyro_potential(problem, x, y)
    thetas = 0.5 * torch.randn(7, 3 + (kind == "regression"), generator=torch.Generator().manual_seed(0)).double()
    joints = _log_joints(problem, x, y, thetas, potential, chunk=3)  # chunks of 3, 3 and 1 draws
    expected = torch.stack([-potential(t) for t in thetas])
    torch.testing.assert_close(joints, expected, rtol=1e-10, atol=1e-8)


def test_a_log_joint_that_is_not_pyros_is_refused():
    problem = Problem("test", "logistic", 3, "")
    data = problem.data(400, seed=1)
    x, y = data.x.double(), data.y.double()
    potential = _pyro_potential(problem, x, y)
    thetas = torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="is not Pyro's"):
        _log_joints(problem, x, y, thetas, lambda t: potential(t) + 1e-3)
