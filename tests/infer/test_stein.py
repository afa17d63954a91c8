"""Gold tests of the kernel Stein discrepancy (``pyro_scalable/infer/stein.py``), in float64 on closed forms.

The conjugate linear regression's posterior is N(m, P⁻¹), so its score is -P(w - m): the bridge's full-data score
must be that, the chunked KSD must be a direct O(n²) sum written here from it, draws from the exact posterior must
sit at the V-statistic's exact-draws scale (its floor, and a second exact set), and draws one posterior sd off must
be far above it.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.bridge import FullDataModel, ModelBridge
from pyro_scalable.infer.stein import full_data_scores, stein_discrepancy
from tests.conftest import LinearRegression


@pytest.fixture(scope="module")
def problem():
    regression = LinearRegression(num_data=500, dim=3, batch_size=50)
    bridge = ModelBridge(FullDataModel(regression.model), (regression.x, regression.y))
    return regression, bridge


def exact_draws(regression, num, seed, chains=1):
    g = torch.Generator().manual_seed(seed)
    root = torch.linalg.cholesky(regression.cov)
    w = regression.mean + torch.randn(chains * num, len(regression.mean), generator=g, dtype=torch.float64) @ root.T
    return w.reshape(chains, num, -1)


def closed_score(regression, w):
    return -(w - regression.mean) @ torch.linalg.inv(regression.cov)


def direct_ksd(x, s, chains, c=1.0, beta=-0.5):
    """The V- and U-statistics and each chain's V-statistic, term by term over all pairs (no expansion, no blocks)."""
    length = x.std(0, correction=0)
    z, s = (x - x.mean(0)) / length, s * length
    n, d = z.shape
    diff = z[:, None, :] - z[None, :, :]
    r2 = (diff**2).sum(-1)
    q = c**2 + r2
    kp = (
        -2 * beta * d * q ** (beta - 1)
        - 4 * beta * (beta - 1) * q ** (beta - 2) * r2
        + 2 * beta * q ** (beta - 1) * (diff * (s[None, :, :] - s[:, None, :])).sum(-1)
        + q**beta * (s @ s.T)
    )
    v = kp.mean().sqrt()
    u = (kp.sum() - kp.diagonal().sum()) / (n * (n - 1))
    per = n // chains
    per_chain = torch.stack([kp[i * per : (i + 1) * per, i * per : (i + 1) * per].mean().sqrt() for i in range(chains)])
    return v, u, per_chain, (kp.diagonal().mean() / n).sqrt()


def test_the_score_is_the_closed_form_gradient(problem):
    regression, bridge = problem
    w = exact_draws(regression, 40, seed=1)[0]
    scores = full_data_scores(bridge, {"w": w}, data_chunk_size=77, draws_chunk_size=9)
    torch.testing.assert_close(scores, closed_score(regression, w), rtol=1e-10, atol=1e-10)


def test_the_score_includes_the_log_jacobian():
    """sigma ~ HalfNormal(1), y_i ~ N(0, sigma): in u = log sigma the score is 1 - sigma² - N + sum y²/sigma²."""
    y = torch.randn(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def model(y):
        sigma = pyro.sample("sigma", dist.HalfNormal(y.new_tensor(1.0)))
        with pyro.plate("data", len(y), subsample_size=20) as idx:
            pyro.sample("obs", dist.Normal(0.0, sigma), obs=y[idx])

    bridge = ModelBridge(FullDataModel(model), (y,))
    u = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    scores = full_data_scores(bridge, {"sigma": u}, data_chunk_size=30)[:, 0]
    sigma = u.exp()
    torch.testing.assert_close(scores, 1 - sigma**2 - len(y) + (y**2).sum() / sigma**2, rtol=1e-10, atol=1e-9)


def test_the_chunked_sum_equals_the_direct_one(problem):
    regression, bridge = problem
    x = exact_draws(regression, 100, seed=2, chains=3)
    x[2] += regression.cov.diagonal().sqrt()  # a chain off the posterior: the terms are not all alike
    result = stein_discrepancy(bridge, {"w": x}, block_size=64, data_chunk_size=128, draws_chunk_size=16)
    flat = x.reshape(-1, 3)
    v, u, per_chain, floor = direct_ksd(flat, closed_score(regression, flat), chains=3)
    torch.testing.assert_close(result.ksd, v, rtol=1e-10, atol=0)
    torch.testing.assert_close(result.ksd_squared_unbiased, u, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(result.per_chain, per_chain, rtol=1e-10, atol=0)
    torch.testing.assert_close(result.floor, floor, rtol=1e-10, atol=0)
    torch.testing.assert_close(result.scale, flat.std(0, correction=0), rtol=1e-12, atol=0)
    assert result.per_chain[2] > 2 * result.per_chain[:2].max()


@pytest.mark.parametrize(
    ("block_size", "data_chunk_size", "draws_chunk_size"), [(1, 50, 1), (7, None, 64), (999, 499, 5)]
)
def test_chunk_and_block_sizes_change_nothing(problem, block_size, data_chunk_size, draws_chunk_size):
    regression, bridge = problem
    x = exact_draws(regression, 60, seed=3, chains=2)
    reference = stein_discrepancy(bridge, {"w": x})
    result = stein_discrepancy(
        bridge, {"w": x}, block_size=block_size, data_chunk_size=data_chunk_size, draws_chunk_size=draws_chunk_size
    )
    for got, expected in zip(result, reference, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-14)


def test_exact_draws_are_at_the_exact_scale_and_shifted_draws_far_above(problem):
    regression, bridge = problem
    n = 2000
    first = stein_discrepancy(bridge, {"w": exact_draws(regression, n, seed=4)})
    second = stein_discrepancy(bridge, {"w": exact_draws(regression, n, seed=5)}, scale=first.scale)
    shifted_draws = exact_draws(regression, n, seed=4) + regression.cov.diagonal().sqrt()  # 1 sd in every coordinate
    shifted = stein_discrepancy(bridge, {"w": shifted_draws}, scale=first.scale)
    # exact draws: V-statistic² has mean floor² (off-diagonal terms have mean 0); the two exact sets agree
    for exact in (first, second):
        assert 0.5 < float(exact.ksd / exact.floor) < 2
    assert 0.5 < float(first.ksd / second.ksd) < 2
    assert shifted.ksd > 5 * max(first.ksd, second.ksd)
    # the unbiased KSD² of exact draws is within a few of its own scale of 0; the shifted one is not
    assert abs(first.ksd_squared_unbiased) < first.floor**2
    assert shifted.ksd_squared_unbiased > 20 * first.floor**2
    d = len(regression.mean)
    assert math.isclose(float(first.floor), math.sqrt(2 * d / n), rel_tol=0.25)  # module docstring: about sqrt(2d/n)


def test_the_euclidean_kernel_and_a_given_scale(problem):
    regression, bridge = problem
    x = exact_draws(regression, 50, seed=6)
    euclid = stein_discrepancy(bridge, {"w": x}, scale=1.0)
    assert torch.equal(euclid.scale, torch.ones(3, dtype=torch.float64))
    flat = x[0]
    s = closed_score(regression, flat)
    z = flat - flat.mean(0)
    r2 = ((z[:, None] - z[None]) ** 2).sum(-1)
    q = 1 + r2
    cross = ((z[:, None] - z[None]) * (s[None] - s[:, None])).sum(-1)
    kp = 3 * q**-1.5 - 3 * q**-2.5 * r2 - q**-1.5 * cross + q**-0.5 * (s @ s.T)
    torch.testing.assert_close(euclid.ksd, kp.mean().sqrt(), rtol=1e-10, atol=0)


def test_bad_arguments_are_named(problem):
    regression, bridge = problem
    x = exact_draws(regression, 10, seed=7)
    with pytest.raises(ValueError, match="scale must be 'sd'"):
        stein_discrepancy(bridge, {"w": x}, scale="std")
    with pytest.raises(ValueError, match=r"a \(3,\) tensor"):
        stein_discrepancy(bridge, {"w": x}, scale=torch.ones(2))
    with pytest.raises(ValueError, match="positive finite"):
        stein_discrepancy(bridge, {"w": x}, scale=0.0)
    with pytest.raises(ValueError, match="beta must be in"):
        stein_discrepancy(bridge, {"w": x}, beta=0.5)
    with pytest.raises(ValueError, match="c must be a positive"):
        stein_discrepancy(bridge, {"w": x}, c=0)
    with pytest.raises(ValueError, match=r"of site\(s\) \['w'\] do not vary"):
        stein_discrepancy(bridge, {"w": x[:, :1].expand(1, 10, 3)})
