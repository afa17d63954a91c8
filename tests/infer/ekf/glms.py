"""Four GLMs on N = 2,000 rows and three features, and their exact posteriors, for the EKF's accuracy tests.

The linear-Gaussian model's posterior is its closed form. The logistic, Poisson and categorical ones' are importance
sampling from a Student-t (5 degrees of freedom) centred at the MAP with the Hessian's covariance: exact as the draws
grow, and with 20,000 draws the effective sample size is above 10,000 on each (checked), so the reference's
Monte-Carlo error in a mean is about 0.01 posterior sd.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch

N, FEATURES, NOISE = 2000, 3, 0.5
D = torch.float64
FAMILIES = ("linear-gaussian", "logistic", "poisson", "categorical")
_CLASSES = torch.tensor([[1.0, -1.0, 0.0], [0.0, 1.5, -1.5], [0.5, 0.0, -0.5]], dtype=D)


def data(family: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(N, 3)`` standard Normal and ``y`` from the family at the true weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEATURES, generator=g, dtype=D)
    weights = torch.tensor([1.5, -2.0, 0.5], dtype=D)
    if family == "linear-gaussian":
        return x, x @ weights + NOISE * torch.randn(N, generator=g, dtype=D)
    if family == "logistic":
        return x, torch.bernoulli(torch.sigmoid(x @ weights), generator=g)
    if family == "poisson":
        return x, torch.poisson((x @ weights / 2).exp(), generator=g)
    return x, torch.multinomial(torch.softmax(x @ _CLASSES, -1), 1, generator=g).squeeze(-1)


def _shape(family: str) -> tuple[int, ...]:
    return (FEATURES, 3) if family == "categorical" else (FEATURES,)


def _likelihood(family: str, f: torch.Tensor):
    if family == "linear-gaussian":
        return dist.Normal(f, NOISE)
    if family == "logistic":
        return dist.Bernoulli(logits=f)
    if family == "poisson":
        return dist.Poisson(f.exp())
    return dist.Categorical(logits=f)


def model(family: str, batch: int):
    """The family's Pyro model, ``w ~ N(0, I)``, its likelihood in minibatches of ``batch``."""
    shape = _shape(family)

    def glm(x, y=None):
        w = pyro.sample("w", dist.Normal(x.new_zeros(shape), 1.0).to_event(len(shape)))
        with pyro.plate("data", x.shape[0], subsample_size=batch) as idx:
            pyro.sample("obs", _likelihood(family, x[idx] @ w), obs=None if y is None else y[idx])

    return glm


def exact(family: str, x: torch.Tensor, y: torch.Tensor, draws: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior's mean and sd, flat (closed form, or importance sampling: module docstring)."""
    if family == "linear-gaussian":
        covariance = torch.linalg.inv(x.T @ x / NOISE**2 + torch.eye(FEATURES, dtype=D))
        return covariance @ (x.T @ y / NOISE**2), covariance.diagonal().sqrt()
    d = FEATURES * (3 if family == "categorical" else 1)

    def log_joint(w):  # w: (..., d); the log-likelihoods written out (no distribution objects: many draws at once)
        f = torch.einsum("nf,...fk->...nk", x, w.reshape(w.shape[:-1] + (FEATURES, -1)))
        if family == "logistic":
            log_likelihood = y * f[..., 0] - torch.nn.functional.softplus(f[..., 0])
        elif family == "poisson":
            log_likelihood = y * f[..., 0] - f[..., 0].exp() - torch.lgamma(y + 1)
        else:
            log_likelihood = f.gather(-1, y.expand(f.shape[:-1])[..., None])[..., 0] - f.logsumexp(-1)
        return log_likelihood.sum(-1) - 0.5 * w.square().sum(-1)

    mode = torch.zeros(d, dtype=D)
    for _ in range(50):
        hessian = torch.autograd.functional.hessian(log_joint, mode)
        step = torch.linalg.solve(-hessian, torch.func.grad(log_joint)(mode))
        mode = mode + step
        if float(step.abs().max()) < 1e-12:
            break
    root = torch.linalg.cholesky(torch.linalg.inv(-torch.autograd.functional.hessian(log_joint, mode)))
    g = torch.Generator().manual_seed(0)
    df = 5.0
    z = torch.randn(draws, d, generator=g, dtype=D)
    chi2 = 2 * torch._standard_gamma(torch.full((draws,), df / 2, dtype=D), generator=g)
    samples = mode + (z @ root.T) / (chi2 / df).sqrt()[:, None]
    log_q = -(df + d) / 2 * torch.log1p(z.square().sum(-1) / chi2)  # the t's density, up to its constant
    log_p = torch.cat([log_joint(part) for part in samples.split(1000)])
    weights = torch.softmax(log_p - log_q, 0)
    ess = 1 / float(weights.square().sum())
    assert ess > 0.5 * draws, ess  # the proposal fits: the reference's error is small
    mean = weights @ samples
    return mean, (weights @ (samples - mean).square()).sqrt()
