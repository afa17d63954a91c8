"""The problems every suite draws from, each defined once: its data, its model for each PPL, its reference.

A :class:`Problem` makes its data for a size ``n`` and a seed, and gives the same model to Pyro (``pyro_model``,
with a minibatch plate when ``batch_size`` is given) and to NumPyro (``numpyro_model``, the same priors and the same
parameterisation, on the same float32 arrays). Draws are compared in the unconstrained space the samplers work in
(``log σ`` for a scale), flattened in the order of ``sites``.

**Reference** (:func:`reference`): the "linear" problem's exact Gaussian posterior; for the others, the Laplace
approximation at the float64 mode of Pyro's own potential energy (L-BFGS, then Newton's method with the exact
Hessian), corrected by self-normalised importance sampling with that Gaussian as the proposal. On these posteriors
(d ≤ 12, N ≥ 10³) the weights' ESS is above 90% of the draws, so the reference's Monte-Carlo error (about 0.02 sd in
a mean with 4,000 draws) is a fifth of the accuracy criterion (0.1 sd); the record keeps the ESS. At d = 100 the
reference takes 16,000 draws, so that the worst of its 100 coordinates stays as far within the criterion. The digits
problem has no posterior reference: it is scored on held-out data. The ``teacher`` problem (a ReLU MLP 784-128-64-10 at
its MAP on inputs labelled by a random teacher network) is the Laplace cost suite's. The EKF's GLM problems
(``glm-<family>``) take their data and exact reference from ``tests/infer/ekf/glms.py``, where the EKF's tests
define them. The hierarchies (kind "hierarchy": :data:`HIERARCHIES`) have no reference: they are scored by ESS per
second and r_hat.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.mcmc.util import initialize_model
from torch import Tensor, nn

__all__ = ["HIERARCHIES", "PROBLEMS", "Data", "Problem", "digits", "reference", "teacher", "train_map", "unconstrained"]

NOISE = 0.7  # the noise sd that generates the regressions' data (and the "linear" model's known one)


@dataclass
class Data:
    x: Tensor
    y: Tensor


@dataclass(frozen=True)
class Problem:
    """A model and a data generator.

    ``kind``: "logistic" (Bernoulli), "regression" (a latent noise scale), "mlp" (a tanh MLP 20-50-1 with N(0, 1)
    weights, noise sd 0.5, on y = sin x₁ + x₂/2 + noise: the distributed suite's), "linear" (noise sd 0.7 known, so the
    posterior is Gaussian and :func:`reference` gives it exactly), "conjugate" (the same with noise sd 1,
    ``w`` drawn from its prior, float64: the calibration suite's) or "glm" (a case of ``tests/infer/ekf/glms.py``,
    N = 2,000 and three features, the family after ``glm-`` in the name, its data and exact reference there),
    "sto-linear" (:func:`sto_linear`) or "sto-mlp" (:func:`sto_mlp`): the sample-then-optimise suites'; "step"
    (:func:`make_step`: a :class:`StepProblem`, the step-cost suites').
    """

    name: str
    kind: str
    d: int
    description: str

    @property
    def noise(self) -> float:
        """The known noise sd of the "linear" and "conjugate" kinds."""
        return 1.0 if self.kind == "conjugate" else NOISE

    @property
    def width(self) -> int:
        """The "sto-mlp" kind's hidden width (``sto-mlp-h<width>``)."""
        return int(self.name.rsplit("-h", 1)[1])

    @property
    def family(self) -> str:
        return self.name.removeprefix("glm-")

    @property
    def sites(self) -> tuple[str, ...]:
        return ("w", "scale") if self.kind == "regression" else ("w",)

    def data(self, n: int, seed: int = 0) -> Data:
        if self.kind == "sto-linear":
            return sto_linear(self.d, n, seed, correlated="correlated" in self.name)
        if self.kind == "sto-mlp":
            return Data(*sto_mlp_data(self.width, n, seed))
        if self.kind == "mlp":
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(n, MLP_SIZES[0], generator=gen)
            return Data(x, torch.sin(x[:, 0]) + 0.5 * x[:, 1] + 0.5 * torch.randn(n, generator=gen))
        if self.kind == "glm":
            glms = glm_cases()
            assert n == glms.N, f"the GLM cases have N = {glms.N}"
            return Data(*glms.data(self.family, seed))
        gen = torch.Generator().manual_seed(seed)
        dtype = torch.float64 if self.kind == "conjugate" else torch.float32
        x = torch.randn(n, self.d, generator=gen, dtype=dtype)
        scale = 1.0 if self.kind == "conjugate" else 1.5 / math.sqrt(self.d)
        w = torch.randn(self.d, generator=gen, dtype=dtype) * scale
        if self.kind == "logistic":
            return Data(x, torch.bernoulli(torch.sigmoid(x @ w), generator=gen))
        return Data(x, x @ w + self.noise * torch.randn(n, generator=gen, dtype=dtype))

    def pyro_model(self, batch_size: int | None = None) -> Callable:
        kind, noise = self.kind, self.noise
        if kind == "mlp":
            return _mlp_model(batch_size)

        def model(x: Tensor, y: Tensor) -> None:
            w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
            scale = pyro.sample("scale", dist.HalfNormal(x.new_ones(()))) if kind == "regression" else None
            with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
                mean = x[idx] @ w
                if kind == "logistic":
                    likelihood = dist.Bernoulli(logits=mean)
                else:
                    likelihood = dist.Normal(mean, noise if scale is None else scale)
                pyro.sample("obs", likelihood, obs=y[idx])

        return model

    def numpyro_model(self, subsample_size: int | None = None) -> Callable:
        import jax.numpy as jnp
        import numpyro
        import numpyro.distributions as ndist

        kind = self.kind

        def model(x, y):
            w = numpyro.sample("w", ndist.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
            scale = numpyro.sample("scale", ndist.HalfNormal(1.0)) if kind == "regression" else None
            with numpyro.plate("data", x.shape[0], subsample_size=subsample_size):
                xb = numpyro.subsample(x, event_dim=1)
                yb = numpyro.subsample(y, event_dim=0)
                mean = xb @ w
                if kind == "logistic":
                    likelihood = ndist.Bernoulli(logits=mean)
                else:
                    likelihood = ndist.Normal(mean, NOISE if scale is None else scale)
                numpyro.sample("obs", likelihood, obs=yb)

        return model

    def flatten(self, latents: dict[str, Tensor], constrained: bool = True) -> Tensor:
        """Draws ``(..., d')`` in the unconstrained space, sites in ``self.sites`` order (``scale`` as ``log σ``)."""
        parts = []
        for site in self.sites:
            value = torch.as_tensor(latents[site]).double()
            if site == "scale":
                parts.append((value.log() if constrained else value).unsqueeze(-1))
            else:
                parts.append(value)
        return torch.cat(parts, -1)


MLP_SIZES = (20, 50)  # the "mlp" kind: inputs, hidden units (one output)


def _mlp_model(batch_size: int | None) -> Callable:
    d, h = MLP_SIZES

    def model(x: Tensor, y: Tensor) -> None:
        w1 = pyro.sample("w1", dist.Normal(torch.zeros(d, h), 1.0).to_event(2))
        b1 = pyro.sample("b1", dist.Normal(torch.zeros(h), 1.0).to_event(1))
        w2 = pyro.sample("w2", dist.Normal(torch.zeros(h), 1.0).to_event(1))
        b2 = pyro.sample("b2", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y), subsample_size=batch_size) as idx:
            f = torch.tanh(x[idx] @ w1 + b1) @ w2 + b2
            pyro.sample("obs", dist.Normal(f, 0.5), obs=y[idx])

    return model


_GLM_FAMILIES = ("linear-gaussian", "logistic", "poisson", "categorical")  # tests/infer/ekf/glms.py's FAMILIES

PROBLEMS: dict[str, Problem] = {
    p.name: p
    for p in (
        Problem("logistic", "logistic", 10, "logistic regression, d = 10, w ~ N(0, I)"),
        Problem("logistic-d100", "logistic", 100, "logistic regression, d = 100, w ~ N(0, I)"),
        Problem("regression", "regression", 10, "linear regression, d = 10, latent noise scale σ ~ HalfNormal(1)"),
        Problem("linear", "linear", 100, "linear regression, d = 100, noise sd 0.7 known: a Gaussian posterior"),
        Problem("mlp-regression", "mlp", 1101, "tanh MLP 20-50-1 regression, noise sd 0.5"),
        Problem("teacher", "teacher", 109_386, "ReLU MLP 784-128-64-10 at its MAP, labels from a teacher MLP"),
        Problem("conjugate", "conjugate", 2, "linear regression, d = 2, noise sd 1 known, float64: Gaussian"),
        *(Problem(f"glm-{f}", "glm", 3, f"{f} GLM, N = 2,000, 3 features") for f in _GLM_FAMILIES),
        Problem("ill-conditioned", "hierarchy", 10, "linear regression, d = 10, condition number about 5,000"),
        Problem("partial-pooling", "hierarchy", 27, "centred partial pooling, 11 groups, latent scales"),
        Problem("hierarchical-logistic", "hierarchy", 65, "non-centred hierarchical logistic regression, 60 groups"),
        *(
            Problem(f"sto-{f}-d{d}", "sto-linear", d, f"linear-Gaussian, float64, {f} features over two decades")
            for f, d in (("scaled", 100), ("correlated", 100), ("scaled", 1000), ("correlated", 1000), ("scaled", 2000))
        ),
        Problem("cold-digits", "cold", 2410, "digits, tanh MLP 64-32-10, N(0, 1) priors; OOD: the digits turned 90°"),
        Problem("step-logistic", "step", 100, "logistic regression, d = 100, B = 1,000: one step's cost"),
        Problem("step-logistic-d10", "step", 10, "logistic regression, d = 10, B = 1,000: one step's cost"),
        Problem("step-mlp", "step", 90_701, "Bayesian tanh MLP 100-300-200-1, B = 1,000: one step's cost"),
        *(Problem(f"sto-mlp-h{h}", "sto-mlp", h * h + 103 * h + 1, f"tanh MLP 100-{h}-{h}-1") for h in (64, 280, 950)),
    )
}


# ---------------------------------------------------------------------------------------------- hierarchies
# An ill-conditioned regression and two hierarchies (the ``hierarchies`` suite; ``benchmarks/studies/`` uses them
# too): each builder returns (title, model, data) with ``model(*data, batch=B)``, ``batch=None`` for the full data.
def ill_conditioned(n: int = 5000, seed: int = 0) -> tuple[str, Callable, tuple]:
    """y = Xw + ε, d = 10 correlated features whose scales span 300× (condition number about 5,000), B = 100."""
    g = torch.Generator().manual_seed(seed)
    d = 10
    u, _, v = torch.linalg.svd(torch.randn(d, d, generator=g))
    x = torch.randn(n, d, generator=g) @ (u @ torch.diag(torch.logspace(0, -2.5, d)) @ v)
    y = x @ torch.randn(d, generator=g) + torch.randn(n, generator=g)
    eig = torch.linalg.eigvalsh(x.double().T @ x.double() + torch.eye(d, dtype=torch.float64))

    def model(x, y, batch=100):
        w = pyro.sample("w", dist.Normal(x.new_zeros(d), 1.0).to_event(1))
        with pyro.plate("data", len(y), subsample_size=batch) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

    return f"ill-conditioned regression (d = 10, condition number {float(eig.max() / eig.min()):,.0f})", model, (x, y)


def partial_pooling(n: int = 220, seed: int = 0) -> tuple[str, Callable, tuple]:
    """Centred partial pooling: 11 groups (n / 11 rows each), group intercepts and slopes, latent scales, B = 44."""
    g = torch.Generator().manual_seed(seed + 1)
    groups, years = 11, n // 11
    group = torch.arange(groups).repeat_interleave(years)
    x = torch.randn(groups * years, generator=g)
    a = 1.0 + 0.8 * torch.randn(groups, generator=g)
    b = 0.5 + 0.3 * torch.randn(groups, generator=g)
    y = a[group] + b[group] * x + 0.5 * torch.randn(groups * years, generator=g)

    def model(x, group, y, batch=44):
        mu_a = pyro.sample("mu_a", dist.Normal(x.new_zeros(()), 5.0))
        mu_b = pyro.sample("mu_b", dist.Normal(x.new_zeros(()), 5.0))
        tau_a = pyro.sample("tau_a", dist.HalfNormal(x.new_ones(())))
        tau_b = pyro.sample("tau_b", dist.HalfNormal(x.new_ones(())))
        sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
        with pyro.plate("groups", groups):
            a = pyro.sample("a", dist.Normal(mu_a, tau_a))
            b = pyro.sample("b", dist.Normal(mu_b, tau_b))
        with pyro.plate("data", len(y), subsample_size=batch) as idx:
            pyro.sample("obs", dist.Normal(a[group[idx]] + b[group[idx]] * x[idx], sigma), obs=y[idx])

    return f"partial-pooling regression (11 groups × {years}, centred)", model, (x, group, y)


def hierarchical_logistic(n: int = 6366, seed: int = 0) -> tuple[str, Callable, tuple]:
    """Non-centred: n rows in 60 groups, 3 covariates, α_g = μ + τ z_g with z_g ~ N(0, 1), B = 256."""
    g = torch.Generator().manual_seed(seed + 2)
    groups, k = 60, 3
    group = torch.randint(groups, (n,), generator=g)
    x = torch.randn(n, k, generator=g)
    alpha = -0.5 + 0.7 * torch.randn(groups, generator=g)
    y = torch.bernoulli(torch.sigmoid(alpha[group] + x @ torch.tensor([0.8, -0.4, 0.2])), generator=g)

    def model(x, group, y, batch=256):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 5.0))
        tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
        beta = pyro.sample("beta", dist.Normal(x.new_zeros(k), 2.0).to_event(1))
        with pyro.plate("groups", groups):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
        alpha = mu + tau * z
        with pyro.plate("data", len(y), subsample_size=batch) as idx:
            pyro.sample("obs", dist.Bernoulli(logits=alpha[group[idx]] + x[idx] @ beta), obs=y[idx])

    return f"hierarchical logistic regression ({n:,} rows, 60 groups, non-centred)", model, (x, group, y)


HIERARCHIES = {
    "ill-conditioned": ill_conditioned,
    "partial-pooling": partial_pooling,
    "hierarchical-logistic": hierarchical_logistic,
}


def unconstrained(model: Callable, data: tuple, samples: dict[str, Tensor], chains: int) -> Tensor:
    """Draws ``(chains * draws, ...)`` per site as ``(chains, draws, coordinates)``, unconstrained (log of a scale)."""
    trace = pyro.poutine.trace(model).get_trace(*data)
    parts = []
    for name, value in samples.items():
        u = torch.distributions.biject_to(trace.nodes[name]["fn"].support).inv(value)
        parts.append(u.reshape(chains, u.shape[0] // chains, -1))
    return torch.cat(parts, -1).double()


def glm_cases():
    from tests.infer.ekf import glms  # the EKF's test cases, defined once there (the repository root is on sys.path)

    return glms


def reference(problem: Problem, data: Data, draws: int | None = None, seed: int = 0) -> dict:
    """Posterior means and sds (unconstrained, flattened) by importance-corrected Laplace (module docstring).

    ``draws``: the importance draws, by default 4,000 up to d = 12 and 16,000 above (the worst of d coordinates'
    Monte-Carlo errors grows with d: at d = 100 and 16,000 draws it is about 0.03 sd in a mean and 2% in an sd).
    """
    if problem.kind == "glm":  # closed form, or importance sampling with 20,000 draws (ESS > 10,000)
        mean, sd = glm_cases().exact(problem.family, data.x, data.y)
        return {"mean": mean, "sd": sd, "mode": mean, "ess": None, "draws": 20_000}
    x, y = data.x.double(), data.y.double()
    if problem.kind in ("linear", "conjugate"):  # N(A⁻¹Xᵀy/σ², A⁻¹), A = XᵀX/σ² + I: exact
        precision = x.T @ x / problem.noise**2 + torch.eye(problem.d, dtype=torch.float64)
        mean = torch.linalg.solve(precision, x.T @ y / problem.noise**2)
        sd = torch.linalg.inv(precision).diagonal().sqrt()
        return {"mean": mean, "sd": sd, "mode": mean, "ess": None, "draws": 0}
    draws = draws or (4000 if problem.d <= 12 else 16_000)
    _, potential_fn, _, _ = initialize_model(problem.pyro_model(), (x, y))
    sizes = {"w": problem.d, "scale": 1}

    def unflatten(theta: Tensor) -> dict[str, Tensor]:
        out, start = {}, 0
        for site in problem.sites:
            out[site] = theta[start : start + sizes[site]] if site == "w" else theta[start]
            start += sizes[site]
        return out

    def potential(theta: Tensor) -> Tensor:
        return potential_fn(unflatten(theta))

    theta = torch.zeros(sum(sizes[s] for s in problem.sites), dtype=torch.float64, requires_grad=True)
    _minimise([theta], lambda: potential(theta), 200, 1e-10)  # then Newton from near the mode: quadratic convergence
    theta = theta.detach()
    for _ in range(50):
        grad = torch.autograd.functional.jacobian(potential, theta)
        hess = torch.autograd.functional.hessian(potential, theta, vectorize=True)
        step = torch.linalg.solve(hess, grad)
        theta = theta - step
        if float(step.abs().max()) < 1e-10:
            break
    hess = torch.autograd.functional.hessian(potential, theta, vectorize=True)
    proposal = torch.distributions.MultivariateNormal(theta, precision_matrix=hess)
    eps = torch.randn(draws, theta.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sample = theta + eps @ proposal.scale_tril.T
    with torch.no_grad():
        log_w = _log_joints(problem, x, y, sample, potential) - proposal.log_prob(sample)
    weights = torch.softmax(log_w, 0)
    mean = weights @ sample
    sd = (weights @ (sample - mean) ** 2).sqrt()
    return {"mean": mean, "sd": sd, "mode": theta, "ess": float(1.0 / weights.square().sum()), "draws": draws}


def _log_joints(problem: Problem, x: Tensor, y: Tensor, thetas: Tensor, potential: Callable, chunk: int = 100):
    """The log joint (minus Pyro's potential energy) at each of ``thetas`` (``(S, d')``), unconstrained.

    The regressions' own closed form, a chunk of points per pass over the data (at N = 10⁶ and d = 100 a point
    at a time through Pyro takes an hour); it must agree with Pyro's potential at the first three points, else
    this raises.
    """
    w = thetas[:, : problem.d]
    out = []
    for part in range(0, thetas.shape[0], chunk):
        f = x @ w[part : part + chunk].T  # (N, chunk)
        if problem.kind == "logistic":
            log_lik = (y[:, None] * f - torch.nn.functional.softplus(f)).sum(0)
        else:  # (w, s), sigma = e^s ~ HalfNormal(1), the Jacobian's s included
            s = thetas[part : part + chunk, -1]
            log_lik = (-0.5 * ((y[:, None] - f) / s.exp()) ** 2 - s - 0.5 * math.log(2 * math.pi)).sum(0)
            log_lik = log_lik + 0.5 * math.log(2 / math.pi) - 0.5 * (2 * s).exp() + s
        prior = -0.5 * (w[part : part + chunk] ** 2).sum(-1) - 0.5 * problem.d * math.log(2 * math.pi)
        out.append(log_lik + prior)
    joints = torch.cat(out)
    pyro_joints = torch.stack([-potential(t) for t in thetas[:3]])
    if not torch.allclose(joints[:3], pyro_joints, rtol=1e-9, atol=1e-6):
        raise RuntimeError(f"the closed-form log joint {joints[:3].tolist()} is not Pyro's {pyro_joints.tolist()}")
    return joints


def _minimise(params: list[Tensor], loss: Callable[[], Tensor], steps: int, tolerance: float) -> None:
    """L-BFGS with a strong-Wolfe line search on ``loss()`` over ``params``, in place."""
    search = torch.optim.LBFGS(params, max_iter=steps, line_search_fn="strong_wolfe", tolerance_grad=tolerance)

    def closure() -> Tensor:
        search.zero_grad()
        value = loss()
        value.backward()
        return value

    search.step(closure)


# ---------------------------------------------------------------------------------------------- digits (Laplace)
DIGITS_SIZES = (64, 100, 10)
DIGITS_PRIOR = 1.0  # the MAP's prior precision


def digits(seed: int = 0) -> dict:
    """sklearn's digits (70/30 stratified split, standardised), a ReLU MLP 64-100-10 and its MAP (Adam, L-BFGS)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        raw.data, raw.target, test_size=0.3, random_state=0, stratify=raw.target
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    x_train = torch.tensor((x_train - mean) / std, dtype=torch.float32)
    x_test = torch.tensor((x_test - mean) / std, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    torch.manual_seed(seed)
    net = network()
    train_map(net, x_train, y_train, epochs=100, batch_size=64, lbfgs=500, seed=seed)
    data = {"x": x_train, "y": y_train, "x_test": x_test, "y_test": y_test}
    return {"sizes": DIGITS_SIZES, "net": net, "latents": latents_of(net), **data}


def train_map(net: nn.Module, x: Tensor, y: Tensor, epochs: int, batch_size: int, lbfgs: int, seed: int) -> None:
    """Adam on the negative log joint (cross-entropy summed, the minibatch's scaled by N/B, + ½ prior |θ|²), L-BFGS."""
    params = list(net.parameters())
    n = len(y)

    def loss(xb: Tensor, yb: Tensor, scale: float) -> Tensor:
        penalty = 0.5 * DIGITS_PRIOR * sum(p.square().sum() for p in params)
        return (scale * nn.functional.cross_entropy(net(xb), yb, reduction="sum") + penalty) / n

    optimizer = torch.optim.Adam(params, lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(n, generator=gen).split(batch_size):
            optimizer.zero_grad()
            loss(x[idx], y[idx], n / len(idx)).backward()
            optimizer.step()
    if lbfgs:
        _minimise(params, lambda: loss(x, y, 1.0), lbfgs, 1e-9)


def latents_of(net: nn.Sequential) -> dict[str, Tensor]:
    """The network's weights under the Pyro model's site names (``layers.<k>.weight``, ``layers.<k>.bias``)."""
    latents = {}
    for k, layer in enumerate(m for m in net if isinstance(m, nn.Linear)):
        latents[f"layers.{k}.weight"] = layer.weight.detach().clone()
        latents[f"layers.{k}.bias"] = layer.bias.detach().clone()
    return latents


TEACHER_SIZES = (784, 128, 64, 10)  # 109,386 weights


def teacher(n: int, seed: int = 0, epochs: int = 20, lbfgs: int = 100) -> dict:
    """Inputs N(0, I) labelled by a random teacher MLP, n training and n / 10 test points; the student's MAP."""
    gen = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed + 1)
    teacher_net = network(TEACHER_SIZES)
    x = torch.randn(n + n // 10, TEACHER_SIZES[0], generator=gen)
    with torch.no_grad():
        logits = 3.0 * teacher_net(x) / teacher_net(x).std()
    y = torch.distributions.Categorical(logits=logits).sample()
    torch.manual_seed(seed + 2)
    net = network(TEACHER_SIZES)
    train_map(net, x[:n], y[:n], epochs=epochs, batch_size=200, lbfgs=lbfgs, seed=seed + 3)
    return {"sizes": TEACHER_SIZES, "net": net, "latents": latents_of(net), "x": x[:n], "y": y[:n], "x_test": x[n:]}


def network(sizes: tuple[int, ...] = DIGITS_SIZES) -> nn.Sequential:
    """A ReLU MLP of layer widths ``sizes``."""
    layers: list[nn.Module] = []
    for k, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(fan_in, fan_out)] + ([nn.ReLU()] if k < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


def member_probs(samples: dict[str, Tensor], x: Tensor, activation: Callable = torch.relu) -> Tensor:
    """Class probabilities ``(draws, points, classes)``, float64, of the MLP of sites ``layers.<k>.weight`` and
    ``layers.<k>.bias`` (each ``(draws, ...)``: :func:`network`'s, or :func:`cold_mlp`'s with ``torch.tanh``)."""
    h = x.double()
    names = sorted({name.rsplit(".", 1)[0] for name in samples})
    for i, name in enumerate(names):
        w, b = samples[f"{name}.weight"].double(), samples[f"{name}.bias"].double()
        h = torch.einsum("pi,soi->spo" if h.dim() == 2 else "spi,soi->spo", h, w) + b[:, None]
        h = activation(h) if i < len(names) - 1 else h
    return torch.softmax(h, -1)


def pyro_network(chunk: int = 256, sizes: tuple[int, ...] = DIGITS_SIZES):
    """The same MLP as a Pyro model (weights ~ N(0, 1/prior)), its data plate subsampled in chunks."""
    scale = DIGITS_PRIOR**-0.5
    return pyro_mlp(sizes, lambda _: (scale, scale), torch.relu, _categorical, lambda n: min(chunk, n - 1))


def _categorical(logits: Tensor) -> dist.Distribution:
    return dist.Categorical(logits=logits)


def pyro_mlp(sizes: tuple[int, ...], prior: Callable, activation: Callable, likelihood: Callable, batch: Callable):
    """A ``PyroModule`` MLP of layer widths ``sizes`` (sites ``layers.<k>.weight`` and ``layers.<k>.bias``): normal
    priors of sds ``prior(fan_in)`` (weights', biases'), ``activation`` between the layers, ``likelihood(output)`` in
    a data plate subsampling ``batch(N)`` points (a call's ``batch_size``, ``None`` for all, overrides it)."""
    from pyro.nn import PyroModule, PyroSample

    class MLP(PyroModule):
        def __init__(self) -> None:
            super().__init__()
            layers = []
            for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
                weight_sd, bias_sd = prior(fan_in)
                layer = PyroModule[nn.Linear](fan_in, fan_out)
                layer.weight = PyroSample(dist.Normal(0.0, weight_sd).expand((fan_out, fan_in)).to_event(2))
                layer.bias = PyroSample(dist.Normal(0.0, bias_sd).expand((fan_out,)).to_event(1))
                layers.append(layer)
            self.layers = PyroModule[nn.ModuleList](layers)

        def forward(self, x: Tensor, y: Tensor | None = None, batch_size: int | None = -1) -> Tensor:
            size = batch(x.shape[0]) if batch_size == -1 else batch_size  # -1: the model's own
            data = pyro.plate("data", x.shape[0], subsample_size=size)
            f = x[data.indices]
            for k, layer in enumerate(self.layers):
                f = layer(f)
                f = activation(f) if k < len(self.layers) - 1 else f
            with data:
                return pyro.sample("y", likelihood(f), obs=None if y is None else y[data.indices])

    return MLP()


# ---------------------------------------------------------------------------------------------- sample-then-optimise
STO_INPUTS, STO_NOISE = 100, 0.1  # the "sto-mlp" kind: inputs of the tanh MLP 100-h-h-1, its likelihood's sd


def sto_linear(d: int, n: int, seed: int = 0, correlated: bool = False) -> Data:
    """Float64 features x_ij = z_ij s_j, s_j = (10/√d)·10^(−2j/(d−1)) (two decades; ``correlated``: each feature a
    random mixture of all before scaling), y = Xw + ε with w, ε ~ N(0, 1): H = XᵀX + I spreads over about 10³."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64
    scales = 10.0 / math.sqrt(d) * torch.logspace(0, -2, d, dtype=dtype)
    x = torch.randn(n, d, generator=gen, dtype=dtype)
    if correlated:
        x = x @ (torch.randn(d, d, generator=gen, dtype=dtype) / math.sqrt(d) + torch.eye(d, dtype=dtype))
    x = x * scales
    return Data(x, x @ torch.randn(d, generator=gen, dtype=dtype) + torch.randn(n, generator=gen, dtype=dtype))


def sto_linear_model(d: int, batch: int) -> Callable:
    """``w ~ N(0, I)``, ``y ~ Normal(x[idx] @ w, 1)`` in a plate subsampling ``batch``."""

    def model(x: Tensor, y: Tensor | None = None) -> None:
        w = pyro.sample("w", dist.Normal(torch.zeros(d, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=batch) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w, 1.0), obs=None if y is None else y[idx])

    return model


def sto_mlp(width: int, batch: int) -> tuple[nn.Module, tuple[int, ...]]:
    """The tanh MLP 100-h-h-1 as a ``PyroModule``: N(0, 1/fan_in) weights, N(0, 1) biases, Normal(f, 0.1)."""
    sizes = (STO_INPUTS, width, width, 1)

    def likelihood(f: Tensor) -> dist.Distribution:
        return dist.Normal(f.squeeze(-1), STO_NOISE)

    return pyro_mlp(sizes, lambda fan_in: (fan_in**-0.5, 1.0), torch.tanh, likelihood, lambda _: batch), sizes


def sto_mlp_weights(sizes: tuple[int, ...], seed: int) -> dict[str, Tensor]:
    """A draw from the MLP's prior, by site name: the linearisation point (no MAP search) and the teacher."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        out[f"layers.{k}.weight"] = torch.randn(fan_out, fan_in, generator=gen) * fan_in**-0.5
        out[f"layers.{k}.bias"] = torch.randn(fan_out, generator=gen)
    return out


def sto_forward(weights: dict[str, Tensor], x: Tensor) -> Tensor:
    layers = len(weights) // 2
    for k in range(layers):
        x = nn.functional.linear(x, weights[f"layers.{k}.weight"], weights[f"layers.{k}.bias"])
        x = torch.tanh(x) if k < layers - 1 else x
    return x.squeeze(-1)


def sto_mlp_data(width: int, n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Inputs N(0, I), responses of a random teacher of the same shape plus N(0, 0.1²) noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, STO_INPUTS, generator=gen)
    teacher_weights = sto_mlp_weights((STO_INPUTS, width, width, 1), seed + 1)
    with torch.no_grad():
        return x, sto_forward(teacher_weights, x) + STO_NOISE * torch.randn(n, generator=gen)


# ---------------------------------------------------------------------------------------------- one step's cost
# A Pyro model with a subsampled plate and the same log density in plain torch (the hand-written loops' and the
# peers'), on DEVICE (``python -m benchmarks run <suite> --device cuda``; the studies set it too).
DEVICE = torch.device("cpu")
STEP_BATCH, MLP_DIMS, MLP_NOISE = 1000, (100, 300, 200, 1), 0.5


def elapsed(start: float) -> float:
    """Seconds since ``start``, after the device's queued work has finished."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter() - start


def noise_generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


@dataclass
class StepProblem:
    label: str
    x: Tensor
    y: Tensor
    batch_size: int
    shapes: dict[str, tuple[int, ...]]  # latent shapes, for the hand-written loops and posteriors
    log_density: Callable[[dict[str, Tensor], Tensor, Tensor], Tensor]  # prior + N/B * minibatch log-likelihood
    model: Callable  # Pyro model(x, y): pyro.plate(..., subsample_size=B)
    step_size: float
    friction: float

    @property
    def num_data(self) -> int:
        return self.x.shape[0]


def make_step(problem: Problem, n: int, seed: int = 0) -> StepProblem:
    if problem.name == "step-mlp":
        return make_mlp(n, STEP_BATCH, seed)
    return make_logistic(n, problem.d, STEP_BATCH, seed)


def make_logistic(n: int, d: int, batch_size: int, seed: int) -> StepProblem:
    """The "logistic" kind's data and Pyro model in ``d`` dimensions, on :data:`DEVICE`."""
    logistic = Problem(f"logistic-d{d}", "logistic", d, "")
    data = logistic.data(n, seed)
    x, y, model = data.x.to(DEVICE), data.y.to(DEVICE), logistic.pyro_model(batch_size)

    def log_density(latents: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        w = latents["w"]
        log_lik = -nn.functional.binary_cross_entropy_with_logits(xb @ w, yb, reduction="sum")
        return -0.5 * w.square().sum() + (n / xb.shape[0]) * log_lik

    label = f"(a) logistic regression, N={n:.0e}, d={d}, B={batch_size}"
    return StepProblem(label, x, y, batch_size, {"w": (d,)}, log_density, model, step_size=1e-4, friction=100.0)


def mlp_forward(latents: dict[str, Tensor], x: Tensor) -> Tensor:
    h = x
    for i in range(len(MLP_DIMS) - 1):
        h = h @ latents[f"W{i}"] + latents[f"b{i}"]
        h = torch.tanh(h) if i < len(MLP_DIMS) - 2 else h
    return h.squeeze(-1)


def make_mlp(n: int, batch_size: int, seed: int) -> StepProblem:
    """A Bayesian tanh MLP 100-300-200-1 (90,701 weights, N(0, 1/fan_in) weights), Gaussian regression."""
    shapes, scales = {}, {}
    for i, (fan_in, fan_out) in enumerate(zip(MLP_DIMS[:-1], MLP_DIMS[1:])):
        shapes[f"W{i}"], shapes[f"b{i}"] = (fan_in, fan_out), (fan_out,)
        scales[f"W{i}"], scales[f"b{i}"] = fan_in**-0.5, 1.0
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, MLP_DIMS[0], generator=gen)
    teacher = {k: torch.randn(shape, generator=gen) * scales[k] for k, shape in shapes.items()}
    y = mlp_forward(teacher, x) + MLP_NOISE * torch.randn(n, generator=gen)
    x, y = x.to(DEVICE), y.to(DEVICE)

    def model(x: Tensor, y: Tensor) -> None:
        latents = {}
        for name, shape in shapes.items():
            prior = dist.Normal(x.new_zeros(()), scales[name])  # on the data's device
            latents[name] = pyro.sample(name, prior.expand(shape).to_event(len(shape)))
        with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            pyro.sample("obs", dist.Normal(mlp_forward(latents, x[idx]), MLP_NOISE), obs=y[idx])

    def log_density(latents: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        log_prior = sum(-0.5 * (value / scales[name]).square().sum() for name, value in latents.items())
        log_lik = -0.5 * ((yb - mlp_forward(latents, xb)) / MLP_NOISE).square().sum()
        return log_prior + (n / xb.shape[0]) * log_lik

    label = f"(b) Bayesian MLP 100-300-200-1 tanh (90,701 weights), N={n:.0e}, B={batch_size}"
    return StepProblem(label, x, y, batch_size, shapes, log_density, model, step_size=2e-5, friction=1000.0)


def epoch_batches(n: int, batch_size: int, gen: torch.Generator):
    """Shuffled minibatch indices, reshuffling when fewer than B remain (what StochasticMCMC's sampler does)."""
    while True:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size].to(DEVICE)


def uniform_init(problem: StepProblem, gen: torch.Generator) -> dict[str, Tensor]:
    """Pyro's ``init_to_uniform`` in unconstrained space (every latent here is real): U(-2, 2)."""
    return {name: (torch.rand(shape, generator=gen) * 4.0 - 2.0).to(DEVICE) for name, shape in problem.shapes.items()}


# ---------------------------------------------------------------------------------------------- the cold posterior
COLD_CLASSES, COLD_BATCH = 10, 128


def cold_digits(n: int) -> dict:
    """sklearn's digits / 16: 450 held out (and the same turned 90°: out of distribution), the first ``n`` of the
    other 1,347 for training (a fixed permutation)."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    images, labels = torch.tensor(raw.data, dtype=torch.float32) / 16.0, torch.tensor(raw.target)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    test, train = order[:450], order[450 : 450 + n]
    x_ood = torch.rot90(images[test].reshape(-1, 8, 8), 1, (1, 2)).reshape(-1, 64)
    return {"x": images[train], "y": labels[train], "x_test": images[test], "y_test": labels[test], "x_ood": x_ood}


def cold_mlp(widths: tuple[int, ...] = (64, 32, COLD_CLASSES)) -> nn.Module:
    """The tanh MLP 64-32-10, N(0, 1) priors on every weight and bias, its likelihood in a plate of ``batch_size``."""
    return pyro_mlp(widths, lambda _: (1.0, 1.0), torch.tanh, _categorical, lambda _: COLD_BATCH)
