"""Against ``posteriors``' ``ekf.diag_fisher`` (installed by ``scripts/install_peers.sh``; an error when absent,
unless ``PYRO_SCALABLE_NO_PEERS=1``): the same filter, step for step.

``posteriors`` averages each minibatch's per-example scores and squared scores and scales them by ``lr`` (an inverse
temperature); ``lr = B`` makes that the minibatch's sums, which is our plain diagonal update
(``covariance="diagonal", curvature="ef", iterations=1``). From the same start, on the same minibatches in the same
order, the two filters agree to rounding on a logistic regression.
"""

from __future__ import annotations

import os
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import EKF

try:
    with warnings.catch_warnings():  # posteriors' TensorClass states warn about their defaults at import
        warnings.simplefilter("ignore", FutureWarning)
        import posteriors
except ImportError as error:
    if os.environ.get("PYRO_SCALABLE_NO_PEERS") == "1":
        reason = f"PYRO_SCALABLE_NO_PEERS=1: the posteriors comparison is not run ({error})"
        pytest.skip(reason, allow_module_level=True)
    raise ImportError(
        f"posteriors does not import ({error}): bash scripts/install_peers.sh installs it; set "
        "PYRO_SCALABLE_NO_PEERS=1 to run the tests without the comparison"
    ) from error

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

D = torch.float64
N, P, B, PRIOR_SD = 400, 4, 50, 1.5


def test_empirical_fisher_filter_equals_posteriors_diag_fisher():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, P, generator=g, dtype=D)
    y = torch.bernoulli(torch.sigmoid(x @ torch.linspace(-1, 1, P, dtype=D)), generator=g)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=D), PRIOR_SD).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=B) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])

    ours = EKF(
        model,
        covariance="diagonal",
        curvature="ef",
        iterations=1,
        shuffle=False,
        check_posterior=False,
        progress_bar=False,
    ).run(x, y)

    def log_likelihood(w, batch):
        xb, yb = batch
        return dist.Bernoulli(logits=xb @ w).log_prob(yb), torch.tensor([])

    transform = posteriors.ekf.diag_fisher.build(log_likelihood, lr=float(B), per_sample=True, init_sds=PRIOR_SD)
    state = transform.init(torch.zeros(P, dtype=D))
    for start in range(0, N, B):
        state, _ = transform.update(state, (x[start : start + B], y[start : start + B]))
    assert ours.stats["steps"] == N // B
    assert torch.allclose(ours.mean[0], state.params, rtol=1e-10, atol=1e-12)
    assert torch.allclose(ours.variance[0], state.sd_diag**2, rtol=1e-10, atol=1e-14)
