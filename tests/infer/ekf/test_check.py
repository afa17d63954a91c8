"""The check after the filter's pass: its figures against their closed forms, and when it warns.

Gold: on a linear-Gaussian model the full-data GGN is the exact posterior precision :math:`H`, so for the filter's
result :math:`(m, \\Sigma)` the Newton step's length is :math:`\\sqrt{b^\\top H^{-1} b}` and the spread ratios are the
square roots of the eigenvalues of :math:`\\Sigma^{1/2} H \\Sigma^{1/2}` (with three latents the probes span every
direction), which the check must give to rounding.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import EKF, DiagonalEKF
from pyro_scalable.infer.ekf.check import MEAN_TOLERANCE
from tests.infer.ekf import glms

D = torch.float64
P, SIGMA, N = 3, 0.5, 400


def correlated(seed=0):
    """Features correlated 0.9, so the posterior's latents are strongly (negatively) correlated."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, P, generator=g, dtype=D) @ torch.linalg.cholesky(0.1 * torch.eye(P, dtype=D) + 0.9).T
    return x, x @ torch.tensor([1.0, -2.0, 0.5], dtype=D) + SIGMA * torch.randn(N, generator=g, dtype=D)


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, SIGMA), obs=None if y is None else y[idx])


def test_the_diagonal_filter_on_a_correlated_posterior_warns_with_the_exact_figures():
    x, y = correlated()
    with pytest.warns(UserWarning) as caught:
        posterior = DiagonalEKF(model, seed=0, progress_bar=False).run(x, y)
    messages = [str(w.message) for w in caught]
    assert any("the EKF's sds are off: checked along every direction" in m for m in messages), messages
    assert all("covariance='dense'" in m for m in messages)
    precision = x.T @ x / SIGMA**2 + torch.eye(P, dtype=D)
    root = posterior.variance[0].sqrt()
    ratios = torch.linalg.eigvalsh(root[:, None] * precision * root).sqrt()
    stats = posterior.stats
    assert stats["spread_low"] == pytest.approx(float(ratios.min()), rel=1e-8)
    assert stats["spread_high"] == pytest.approx(float(ratios.max()), rel=1e-8)
    assert stats["spread_high"] > 1.5  # along the latents' difference the diagonal is far too wide
    m = posterior.mean[0]
    b = x.T @ (y - x @ m) / SIGMA**2 - m
    newton = torch.linalg.solve(precision, b)
    assert stats["newton_step"] == pytest.approx(float((b @ newton).sqrt()), rel=1e-6)
    first = posterior.variance[0] * b  # the check's per-latent step: CG's first iterate from Σb
    step = first * (b @ first) / (first @ precision @ first)
    assert stats["mean_error"] == pytest.approx(float((step.abs() / root).max()), rel=1e-8)


def test_the_plain_empirical_fisher_filter_of_the_issue_warns_that_its_mean_is_far_off():
    """The previous defaults (diagonal, empirical Fisher, one iteration) on N = 2,000: over 100 sds off, and said."""
    x, y = glms.data("linear-gaussian")
    with pytest.warns(UserWarning) as caught:
        posterior = EKF(
            glms.model("linear-gaussian", 100),
            covariance="diagonal",
            curvature="ef",
            iterations=1,
            seed=0,
            progress_bar=False,
        ).run(x, y)
    mean, _ = glms.exact("linear-gaussian", x, y)
    assert posterior.stats["newton_step"] > 10 and float((posterior.mean[0] - mean).abs().max()) > 1.0
    messages = [str(w.message) for w in caught]
    assert any("the EKF's mean is off the posterior's mode" in m and "iterations=10" in m for m in messages)
    assert any("sds are off" in m and "the empirical Fisher" in m for m in messages)


def test_the_dense_filter_counts_its_passes_and_the_check_can_be_turned_off():
    x, y = correlated()
    twice = EKF(model, num_epochs=2, seed=0, progress_bar=False).run(x, y)  # the data counted twice: exact, quiet
    assert twice.stats["mean_error"] < 1e-8 and twice.stats["spread_high"] == pytest.approx(1.0, rel=1e-8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unchecked = DiagonalEKF(model, check_posterior=False, seed=0, progress_bar=False).run(x, y)
    assert "mean_error" not in unchecked.stats and "spread_low" not in unchecked.stats
    assert MEAN_TOLERANCE == 0.15
