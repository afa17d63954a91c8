"""The conjugate-gradient refinement (:mod:`pyro_scalable.infer.linearized.sampling.krylov`).

* gold: on a random SPD system, the returned rows solve it; the energy-error estimate is exactly the drop of
  :math:`\\lVert e\\rVert_H^2` over the last ``delay`` iterations (Hestenes-Stiefel's identity), in float64;
* the engine on a correlated regression where the diagonal preconditioner leaves the minibatch epochs several
  posterior sds off without saying so: with the defaults every row (each draw and the mean) ends within the
  tolerance of its exact solve in the energy norm (every direction), the reported estimates are not blind to the
  true errors, and a budget that ends first warns with the estimate.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import SampleThenOptimize
from pyro_scalable.infer.linearized.sampling.krylov import conjugate_gradient

F64 = torch.float64


def _spd(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    root = torch.randn(d, d, generator=g, dtype=F64)
    scales = torch.logspace(-1, 1, d, dtype=F64)
    return (root * scales) @ (root * scales).T + torch.eye(d, dtype=F64), g


@pytest.mark.parametrize("preconditioned", [True, False])
def test_cg_solves_and_its_estimate_is_the_energy_drop(preconditioned):
    d, rows, delay = 40, 3, 5
    h, g = _spd(d, 0)
    rhs = torch.randn(rows, d, generator=g, dtype=F64)
    start = torch.randn(rows, d, generator=g, dtype=F64)
    inverse = 1 / h.diagonal() if preconditioned else None
    exact = torch.linalg.solve(h, rhs.T).T

    def energy(x):
        e = x - exact
        return ((e @ h) * e).sum(-1)

    def product(v):
        return v @ h

    solved = conjugate_gradient(product, rhs, start, inverse, max_passes=400, tolerance=1e-9)
    assert solved.converged and solved.passes < 400
    assert torch.allclose(solved.rows, exact, rtol=1e-8, atol=1e-8)
    for passes in (8, 15):
        early = conjugate_gradient(product, rhs, start, inverse, max_passes=passes, tolerance=1e-12)
        later = conjugate_gradient(product, rhs, start, inverse, max_passes=passes + delay, tolerance=1e-12)
        assert not early.converged and later.passes == passes + delay
        drop = energy(early.rows) - energy(later.rows)
        assert torch.allclose(later.error.square(), drop, rtol=1e-7), (later.error.square(), drop)
        assert (energy(later.rows) <= energy(early.rows)).all()  # the energy error never grows


def test_a_solved_row_stays_put():
    """A row with a zero residual (zero curvature along its direction) is left as it is, not divided by zero."""
    h, g = _spd(10, 1)
    rhs = torch.stack([torch.zeros(10, dtype=F64), torch.randn(10, generator=g, dtype=F64)])
    out = conjugate_gradient(lambda v: v @ h, rhs, torch.zeros(2, 10, dtype=F64), None, max_passes=60, tolerance=1e-10)
    assert torch.equal(out.rows[0], torch.zeros(10, dtype=F64)) and float(out.error[0]) == 0.0
    assert torch.allclose(out.rows[1], torch.linalg.solve(h, rhs[1]), rtol=1e-8, atol=1e-9)


def _correlated(d=60, n=1500, sigma=0.5, seed=0):
    """Correlated features of scales spanning 30x: kappa(P^-1 H) in the hundreds, where SGD's epochs stall."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=F64) / d**0.5 + torch.eye(d, dtype=F64)
    x = torch.randn(n, d, generator=g, dtype=F64) @ mix * torch.logspace(-1, 0.5, d, dtype=F64)
    y = x @ torch.linspace(-1, 1, d, dtype=F64) + sigma * torch.randn(n, generator=g, dtype=F64)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(d, dtype=F64), 1.0).to_event(1))
        with pyro.plate("data", n, subsample_size=100) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w, sigma), obs=None if y is None else y[idx])

    h = x.T @ x / sigma**2 + torch.eye(d, dtype=F64)
    return model, x, y, h


def _energy_errors(engine, h):
    rows = engine.state.samples
    exact = torch.linalg.solve(h, engine.state.targets.T).T  # A = I: every row solves H z = A t
    e = rows - exact
    return ((e @ h) * e).sum(-1).sqrt()


def test_defaults_bring_every_row_within_tolerance_in_every_direction():
    model, x, y, h = _correlated()
    bare = SampleThenOptimize(model, num_samples=32, refine_passes=0, seed=0, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare.run(x, y)
    assert float(_energy_errors(bare, h)[-1]) > 1.0  # the epochs alone leave the mean more than an sd off
    engine = SampleThenOptimize(model, num_samples=32, seed=0, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine.run(x, y)
    true = _energy_errors(engine, h)
    assert (true <= engine.tolerance).all(), true
    reported = torch.cat([engine.sample_stats["cg_error"].flatten(), torch.tensor([engine.mean_error], dtype=F64)])
    # the estimate is a lower bound for the iterate `delay` passes back, which the returned one improves on: measured
    # 0.93x-12x the returned rows' true errors here; it must not be blind (half the truth at least)
    assert (reported >= 0.5 * true).all(), (reported / true).min()
    # the worst coordinate of the mean, in posterior sds, is within the energy error
    cov = torch.linalg.inv(h)
    mean = cov @ (x.T @ y) / 0.25
    assert float(((engine.get_mean()["w"] - mean) / cov.diagonal().sqrt()).abs().max()) <= float(true[-1])


def test_a_budget_that_ends_first_warns_with_the_estimate():
    model, x, y, h = _correlated()
    engine = SampleThenOptimize(model, num_samples=8, refine_passes=10, seed=0, progress_bar=False)
    with pytest.warns(UserWarning, match=r"not converged in refine_passes=10 .* posterior sds") as record:
        engine.run(x, y)
    assert len(record) == 1
    assert engine.mean_error > engine.tolerance
    assert float(_energy_errors(engine, h)[-1]) > engine.tolerance  # and it is right: the mean is not there
