"""The EKF at its defaults on four GLMs (N = 2,000, three features) against their exact posteriors: right, or warned.

Right: every mean within 0.2 posterior sd of the exact posterior's, every sd within 10% of its sd, and no warning.
Where the filter is off, the check after its pass must say so. The references are in ``glms.py`` (closed form, or
importance sampling whose Monte-Carlo error is about 0.01 sd).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from pyro_scalable.infer import EKF
from tests.glm_models import glm, linear_gaussian_posterior
from tests.infer.ekf import glms

MEAN_TOLERANCE, SD_TOLERANCE = 0.2, 0.1


@functools.lru_cache
def reference(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    return glms.exact(family, *glms.data(family))


def errors(family: str, batch: int, **options) -> tuple[float, float, list[warnings.WarningMessage]]:
    """The largest mean error (in sds) and sd error (relative), and the run's warnings."""
    mean, sd = reference(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        posterior = EKF(glms.model(family, batch), seed=0, progress_bar=False, **options).run(*glms.data(family))
    mean_error = float(((posterior.mean[0] - mean) / sd).abs().max())
    sd_error = float((posterior.variance[0].sqrt() / sd - 1).abs().max())
    return mean_error, sd_error, list(caught)


@pytest.mark.parametrize("family", glms.FAMILIES)
def test_the_defaults_are_right_on_a_glm(family):
    """The dense, iterated filter (the defaults at d = 3 or 9) in minibatches of 100, with no warning."""
    mean_error, sd_error, caught = errors(family, 100)
    assert not caught, [str(w.message) for w in caught]
    assert mean_error < MEAN_TOLERANCE and sd_error < SD_TOLERANCE, (mean_error, sd_error)


def test_where_the_defaults_are_off_the_check_says_so():
    """Minibatches of 25 on the logistic model: 80 Gaussian approximations leave the mean 0.5 sd off, and warned."""
    mean_error, _, caught = errors("logistic", 25)
    assert mean_error > MEAN_TOLERANCE
    assert any("the EKF's mean is off the posterior's mode" in str(w.message) for w in caught)


@pytest.mark.slow
@pytest.mark.parametrize("covariance", ["auto", "diagonal"])
@pytest.mark.parametrize("batch", [10, 100, 1000])
@pytest.mark.parametrize("family", glms.FAMILIES)
def test_right_or_warned(family, batch, covariance):
    mean_error, sd_error, caught = errors(family, batch, covariance=covariance)
    right = mean_error < MEAN_TOLERANCE and sd_error < SD_TOLERANCE
    assert right or caught, (mean_error, sd_error)


@pytest.mark.parametrize("variant", ["scaled", "weighted", "mask"])
def test_a_weighted_likelihood_is_filtered_with_its_weights(variant):
    """``poutine.scale`` (constant or per row) and ``poutine.mask`` on the likelihood: the Kalman filter of the
    weighted data, exact (the closed form weights each row's precision)."""
    model, args = glm("linear-gaussian", variant)
    posterior = EKF(model, seed=0, progress_bar=False).run(*args)
    mean, covariance = linear_gaussian_posterior(variant)
    assert torch.allclose(posterior.mean[0], mean, rtol=1e-9, atol=1e-12)
    assert torch.allclose(posterior.covariance_matrix(), covariance, rtol=1e-9, atol=1e-15)
