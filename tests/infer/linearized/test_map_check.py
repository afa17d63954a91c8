"""The one MAP check of both linearised engines: the Gauss-Newton gain ½ bᵀH⁻¹b, on the exact GGN.

Gold: on an explicit matrix the CG bound is exact after d iterations and a lower bound, nondecreasing, before.
Then the engines: at one point and prior, the Laplace guide (with any structure) and sample-then-optimise report
the same gain, the dense ½ bᵀH⁻¹b (before, "full", "kron" and the sampler gave three different figures).
"""

from __future__ import annotations

import re

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import AutoLinearizedLaplace, SampleThenOptimize
from pyro_scalable.infer.linearized.map_check import gauss_newton_gain

F64 = torch.float64


def test_cg_bound_is_exact_after_d_iterations_and_a_nondecreasing_lower_bound_before():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(12, 12, generator=g, dtype=F64)
    H = a @ a.T + 0.1 * torch.eye(12, dtype=F64)
    b = torch.randn(12, generator=g, dtype=F64)
    exact = 0.5 * float(b @ torch.linalg.solve(H, b))
    bounds = [gauss_newton_gain(lambda v: H @ v, b, iterations=k) for k in range(13)]
    assert bounds[0] == 0.0
    assert all(later >= earlier - 1e-12 for earlier, later in zip(bounds, bounds[1:]))
    assert all(bound <= exact * (1 + 1e-10) for bound in bounds)
    assert bounds[-1] == pytest.approx(exact, rel=1e-8)
    # an exact preconditioner: one iteration; the solution as the start: none
    assert gauss_newton_gain(lambda v: H @ v, b, solve=lambda r: torch.linalg.solve(H, r), iterations=1) == (
        pytest.approx(exact, rel=1e-10)
    )
    solution = torch.linalg.solve(H, b)
    assert gauss_newton_gain(lambda v: H @ v, b, start=solution, iterations=0) == pytest.approx(exact, rel=1e-10)


def _data(n=300):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g, dtype=F64)
    return x, (x[:, 0] * x[:, 1] > 0).long() + (x[:, 0] > 1).long()


def classifier(x, y=None):
    w1 = pyro.sample("w1", dist.Normal(x.new_zeros(4, 2), 1.0).to_event(2))
    w2 = pyro.sample("w2", dist.Normal(x.new_zeros(3, 4), 1.0).to_event(2))
    data = pyro.plate("data", x.shape[0], subsample_size=100)
    logits = torch.tanh(x[data.indices] @ w1.T) @ w2.T
    with data:
        pyro.sample("y", dist.Categorical(logits=logits), obs=None if y is None else y[data.indices])


def test_laplace_structures_and_sample_then_optimise_report_the_same_gain():
    x, labels = _data()
    g = torch.Generator().manual_seed(2)
    point = {
        "w1": 0.3 * torch.randn(4, 2, generator=g, dtype=F64),
        "w2": 0.3 * torch.randn(3, 4, generator=g, dtype=F64),
    }
    guide = AutoLinearizedLaplace(classifier)
    full = guide.laplace_approximation(x, labels, structure="full", map_latents=point, check_map=False)
    b = full.fit.gradient - full.prior_precision * (full.theta_star - full.prior_mean)
    exact = 0.5 * float(b @ torch.linalg.solve(full.precision.to_dense(), b))
    assert exact > 1.0  # a point that is not a MAP: the check must fire
    gains = {}
    for structure in ("full", "kron", "diag"):
        with pytest.warns(UserWarning, match="not a MAP") as record:
            guide.laplace_approximation(x, labels, structure=structure, map_latents=point)
        gains[structure] = float(re.search(r"at least ([0-9.e+]+) nats", str(record[0].message)).group(1))
    engine = SampleThenOptimize(
        classifier, num_samples=8, num_epochs=50, linearize_at=point, seed=0, progress_bar=False
    )
    with pytest.warns(UserWarning, match="not a MAP") as record:
        engine.run(x, labels)
    message = next(str(w.message) for w in record if "not a MAP" in str(w.message))
    gains["sample-then-optimise"] = float(re.search(r"at least ([0-9.e+]+) nats", message).group(1))
    for name, gain in gains.items():  # the message rounds to 3 digits; CG from the structure: within 2%
        assert gain == pytest.approx(exact, rel=0.02), (name, gains, exact)
