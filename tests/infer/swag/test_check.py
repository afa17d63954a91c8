"""The after-run check of a Gaussian against the full data's curvature (``pyro_scalable.infer.swag.check``).

Gold: a conjugate linear regression (known noise) whose posterior is exactly N(m, Σ), so the check's figures are
known in closed form for the exact Gaussian (mean error 0, every sd ratio 1), a mean moved by δ (its largest
|δ_j| / sd_j) and a covariance scaled by c² (every ratio c), on both paths: dense (d ≤ 64) and probed (d > 64,
where the conjugate-gradient step is exact for Σ = H⁻¹). Then SWAG on a regression whose predictors are on scales
four orders of magnitude apart warns, with the remedy.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.bridge import FullDataModel
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer import SWAG
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.swag.check import ApproximationWarning, check_gaussian

F64 = torch.float64
NOISE, PRIOR = 0.5, 2.0


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1], dtype=x.dtype), PRIOR).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=min(50, x.shape[0])) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, NOISE), obs=None if y is None else y[idx])


def _problem(d: int, n: int = 300):
    generator = torch.Generator().manual_seed(d)
    x = torch.randn(n, d, dtype=F64, generator=generator)
    y = x @ torch.randn(d, dtype=F64, generator=generator) + NOISE * torch.randn(n, dtype=F64, generator=generator)
    precision = x.T @ x / NOISE**2 + torch.eye(d, dtype=F64) / PRIOR**2
    covariance = torch.linalg.inv(precision)
    mean = covariance @ (x.T @ y) / NOISE**2
    bridge = ModelBridge(FullDataModel(model), (x, y), {})
    layout = ParameterLayout({name: site.unconstrained_shape for name, site in bridge.sites.items()})
    return bridge, layout, mean, covariance


def _check(bridge, layout, mean, covariance):
    # as a diagonal-plus-low-rank Σ: a tenth of it on the diagonal, the rest as a full-rank factor
    diagonal = 0.1 * covariance.diagonal()
    factor = torch.linalg.cholesky(covariance - torch.diag(diagonal))
    return check_gaussian(bridge, layout, mean, diagonal, factor, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("d", [5, 80], ids=["dense", "probed"])
def test_the_exact_posterior_passes_with_ratios_one(d):
    bridge, layout, mean, covariance = _problem(d)
    check = _check(bridge, layout, mean, covariance)
    assert check.exact == (d <= 64) and check.positive_definite and check.passed
    assert check.mean_error < 1e-6
    assert check.spread_low == pytest.approx(1.0, abs=1e-6) and check.spread_high == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("d", [5, 80], ids=["dense", "probed"])
def test_a_moved_mean_is_measured_in_sds(d):
    bridge, layout, mean, covariance = _problem(d)
    sds = covariance.diagonal().sqrt()
    delta = covariance @ torch.linspace(-1.0, 1.0, d, dtype=F64)
    delta = 0.5 * delta / float((delta.abs() / sds).max())  # the largest move: 0.5 sd
    check = _check(bridge, layout, mean + delta, covariance)
    assert check.mean_error == pytest.approx(0.5, rel=1e-6)
    assert not check.passed


@pytest.mark.parametrize("d", [5, 80], ids=["dense", "probed"])
@pytest.mark.parametrize("ratio", [0.5, 1.6])
def test_a_scaled_covariance_gives_its_sd_ratio(d, ratio):
    bridge, layout, mean, covariance = _problem(d)
    check = _check(bridge, layout, mean, ratio**2 * covariance)
    assert check.spread_low == pytest.approx(ratio, rel=1e-6) and check.spread_high == pytest.approx(ratio, rel=1e-6)
    assert not check.passed


def test_swag_warns_where_one_learning_rate_cannot_spread_every_direction():
    """Predictors on scales 1 and 10⁴: SGD's step is set by the stiff direction; the flat one barely moves."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(400, 2, dtype=F64, generator=generator) * torch.tensor([1.0, 1e4], dtype=F64)
    y = x @ torch.tensor([1.0, 1e-4], dtype=F64) + NOISE * torch.randn(400, dtype=F64, generator=generator)
    engine = SWAG(model, num_epochs=10, seed=0, progress_bar=False)
    with pytest.warns(ApproximationWarning, match="standardise the predictors"):
        engine.run(x, y)
    (check,) = engine.stats["check"]
    assert check.spread_low < 0.8
    assert not SWAG(model, num_epochs=2, seed=0, check=False, progress_bar=False).run(x, y).stats.get("check")
