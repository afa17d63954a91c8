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
from pyro_scalable.infer.linearized.map_check import DECIDING_ITERATIONS, ITERATIONS, gauss_newton_gain

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


def _bounded(H, prior, b, threshold: float, solve) -> tuple[float, float, int, int]:
    """The gain with the prior's upper bound and without it, and the GGN products each took."""
    calls = {"bounded": 0, "full": 0}

    def counted(key):
        def matvec(v):
            calls[key] += 1
            return H @ v

        return matvec

    full = gauss_newton_gain(counted("full"), b, solve=solve, iterations=3)
    gain = gauss_newton_gain(
        counted("bounded"), b, solve=solve, iterations=3, floor_solve=lambda r: r / prior, threshold=threshold
    )
    return gain, full, calls["bounded"], calls["full"]


def test_cg_stops_when_the_prior_bound_shows_the_gain_is_below_the_threshold_and_never_changes_the_verdict():
    # H = G + P, G psd: g = ½ bᵀH⁻¹b <= q(s) + ½ rᵀP⁻¹r at every iterate, so a stop below the threshold is certain
    g = torch.Generator().manual_seed(1)
    d, threshold, stops = 30, 1.0, {"at 0": 0, "later": 0, "none": 0}
    for trial in range(60):
        a = torch.randn(d, 1 + trial % 4, generator=g, dtype=F64) * (0.3 + trial % 5)
        prior = torch.rand(d, generator=g, dtype=F64) + 0.2
        H = a @ a.T + torch.diag(prior)
        b = torch.randn(d, generator=g, dtype=F64) * (0.05 * 1.15**trial)
        exact = 0.5 * float(b @ torch.linalg.solve(H, b))
        diagonal = torch.diagonal(H) if trial % 2 else prior  # two preconditioners
        gain, full, calls, full_calls = _bounded(H, prior, b, threshold, lambda r, m=diagonal: r / m)
        assert gain <= exact * (1 + 1e-10)
        assert (gain > threshold) == (full > threshold)  # the same verdict
        if calls < full_calls:  # stopped early: only where the gain is certainly not above the threshold
            assert exact <= threshold and gain <= full * (1 + 1e-12)
        else:
            assert gain == full
        if 0.5 * float(b @ (b / prior)) <= threshold:
            assert calls == 0  # decided at s = 0: no GGN product
        stops["at 0" if calls == 0 else "later" if calls < full_calls else "none"] += 1
        if trial % 3 == 0:  # a small G: ½ bᵀP⁻¹b just above the threshold, the gain below it (a stop after one step)
            H = 0.01 * (a @ a.T) + torch.diag(prior)
            b = b * (1.05 * threshold / (0.5 * float(b @ (b / prior)))) ** 0.5
            gain, full, calls, full_calls = _bounded(H, prior, b, threshold, lambda r, m=prior: r / m)
            assert gain == full or (calls < full_calls and full <= threshold)
            stops["at 0" if calls == 0 else "later" if calls < full_calls else "none"] += 1
    assert all(stops.values()), stops  # every case came up


def test_with_both_bounds_cg_goes_on_until_they_decide_a_gain_three_iterations_would_miss():
    # slow CG (a spread spectrum, no preconditioner): three iterations stay far below the true gain
    d, threshold = 40, 1.0
    H = torch.diag(torch.logspace(-1, 2, d, dtype=F64))  # = G + P with P = 0.1 I, G = H - P psd
    b = torch.full((d,), 0.25, dtype=F64)
    exact = 0.5 * float(b @ torch.linalg.solve(H, b))
    three = gauss_newton_gain(lambda v: H @ v, b, iterations=ITERATIONS)
    assert three <= threshold < exact  # the fixed count's verdict would be wrong
    products = []
    gain = gauss_newton_gain(
        lambda v: products.append(1) or H @ v, b, floor_solve=lambda r: r / 0.1, threshold=threshold
    )
    assert threshold < gain <= exact * (1 + 1e-10)  # decided: above, from the lower bound itself
    assert ITERATIONS < len(products) <= DECIDING_ITERATIONS


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
