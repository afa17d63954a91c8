"""The problems of ``bench_peers.py`` as NumPyro and BlackJAX see them, and the exact reference of the linear ones.

**Exact reference** (``exact_reference``) for the regression with a latent noise scale and the hierarchical
regression: given the scales ``σ = e^s`` (and ``τ = e^t``) the coefficients ``θ = (w[, b])`` of
``y = X̃θ + σε`` (``X̃ = [x, Z]``, ``Z`` the one-hot groups) have a Gaussian prior of precision
``P = diag(1, …, 1[, τ⁻², …, τ⁻²])``, so their posterior is Gaussian, ``N(μ, A⁻¹)`` with ``A = X̃ᵀX̃/σ² + P`` and
``μ = A⁻¹X̃ᵀy/σ²``, and the scales' marginal posterior is known up to a constant::

    log p(s, t | y) = −n s − yᵀy/(2σ²) + ½ μᵀAμ − ½ log|A| + ½ log|P| + log p(s) + log p(t),

with ``log p(s) = −e^{2s}/2 + s`` (``σ ~ HalfNormal(1)`` in the log space, its Jacobian included). It needs only
``X̃ᵀX̃``, ``X̃ᵀy`` and ``yᵀy`` (one float64 pass over the data). A uniform grid over ``s`` (and ``t``), 8 posterior sds
either side of the mean (found in two refinements), gives the moments: ``E θ = Σ_g p_g μ_g``, ``E θ² = Σ_g p_g (diag
A_g⁻¹ + μ_g²)``, and those of ``s`` and ``t`` directly. A Riemann sum on a uniform grid of a smooth, rapidly decaying
density is exact to far below the criterion (0.1 sd) at 0.2 sd spacing: the reference is numerically exact, from none of
the samplers, with no Gaussian approximation in ``σ`` or ``τ``. Checked once against a long NumPyro NUTS run (``python
benchmarks/studies/peers_models.py``: the hierarchical model at N = 10⁴, 2 chains × 4,000 draws after 1,000 warm-up,
smallest ESS 10,800): worst mean 0.021 sd off, worst sd 2.2% off, over 62 coordinates, both within its Monte-Carlo
error; the Laplace approximation in ``(w, log σ)`` at the joint mode is 0.078 sd off the exact mean of ``log σ`` at N =
10⁴ (its mode ignores the d/2 degrees of freedom the weights take), 0.008 sd at 10⁶.

**NumPyro models**: the same priors and parameterisation as ``bench_accuracy.Problem.model`` (centred
``b_j ~ N(0, τ)``), handed the same float32 arrays.

**BlackJAX** (logistic regression only): see ``bench_peers.py``'s docstring.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
from bench_accuracy import CHUNK, Problem, unconstrained
from torch import Tensor

BATCH, CHAINS = 1000, 4
BURN_IN = {"sgld": 500, "sghmc": 100}  # steps, and SGHMC's draws (10 gradients each)


def import_peers():
    try:
        import blackjax
        import jax
        import numpyro
        import optax
    except ImportError as error:  # a benchmark against peers that are missing has nothing to report
        raise SystemExit(f"bench_peers needs the peers: pip install -e '.[peers]' ({error})") from error
    jax.config.update("jax_enable_x64", False)
    return jax, numpyro, blackjax, optax


# ====================================================================================== exact reference
def _statistics(problem: Problem) -> tuple[Tensor, Tensor, float]:
    """X̃ᵀX̃, X̃ᵀy and yᵀy in float64, X̃ = [x, one-hot groups]."""
    d, j = problem.x.shape[1], problem.num_groups
    gram = torch.zeros(d + j, d + j, dtype=torch.float64)
    cross = torch.zeros(d + j, dtype=torch.float64)
    squares = 0.0
    for start in range(0, problem.n, CHUNK):
        xb = problem.x[start : start + CHUNK].double()
        yb = problem.y[start : start + CHUNK].double()
        gram[:d, :d] += xb.T @ xb
        cross[:d] += xb.T @ yb
        squares += float(yb @ yb)
        if j:
            g = problem.groups[start : start + CHUNK]
            zx = torch.zeros(j, d, dtype=torch.float64).index_add_(0, g, xb)
            gram[d:, :d] += zx
            gram[d:, d:] += torch.diag(torch.bincount(g, minlength=j).double())
            cross[d:] += torch.zeros(j, dtype=torch.float64).index_add_(0, g, yb)
    gram[:d, d:] = gram[d:, :d].T
    return gram, cross, squares


def _grid_moments(problem, stats, s: Tensor, t: Tensor | None):
    """Posterior moments of (θ, s[, t]) from the grid s × t (uniform): means and variances."""
    gram, cross, squares = stats
    d, j, n = problem.x.shape[1], problem.num_groups, problem.n
    ss, tt = (s, None) if t is None else torch.meshgrid(s, t, indexing="ij")
    ss = ss.reshape(-1)
    inv_var = torch.exp(-2 * ss)
    prior = torch.ones(ss.shape[0], d + j, dtype=torch.float64)
    log_p = -n * ss - 0.5 * squares * inv_var - 0.5 * torch.exp(2 * ss) + ss
    if t is not None:
        tt = tt.reshape(-1)
        prior[:, d:] = torch.exp(-2 * tt)[:, None]
        log_p += j * -tt - 0.5 * torch.exp(2 * tt) + tt  # ½ log|P| and t's prior
    a = gram * inv_var[:, None, None] + torch.diag_embed(prior)
    chol = torch.linalg.cholesky(a)
    rhs = (cross * inv_var[:, None])[..., None]
    mu = torch.cholesky_solve(rhs, chol)[..., 0]
    log_p += 0.5 * (rhs[..., 0] * mu).sum(-1) - chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    weights = torch.softmax(log_p, 0)
    inverse_diag = torch.cholesky_inverse(chol).diagonal(dim1=-2, dim2=-1)
    mean = weights @ mu
    var = weights @ (inverse_diag + mu**2) - mean**2
    scales = [ss] if t is None else [ss, tt]
    for grid in scales:
        m = weights @ grid
        mean, var = torch.cat([mean, m.reshape(1)]), torch.cat([var, (weights @ (grid - m) ** 2).reshape(1)])
    return mean, var


def exact_reference(problem: Problem, points: int = 61) -> tuple[Tensor, Tensor]:
    """Posterior means and sds of (w[, b], log σ[, log τ]) by quadrature over the scales (module docstring)."""
    stats = _statistics(problem)
    gram, cross, squares = stats
    k, d, n = gram.shape[0], problem.x.shape[1], problem.n
    fit = torch.linalg.solve(gram + 1e-8 * torch.eye(k, dtype=torch.float64), cross)
    s0 = 0.5 * np.log((squares - 2 * fit @ cross + fit @ gram @ fit).item() / n)
    centre = [s0] + ([float(fit[d:].square().mean().sqrt().log())] if problem.num_groups else [])
    spread = [(0.5 / n) ** 0.5] + ([(0.5 / problem.num_groups) ** 0.5] if problem.num_groups else [])
    for width in (12.0, 8.0, 8.0):  # a wide first grid around the least-squares guess, then around the moments
        grids = [
            torch.linspace(c - width * w, c + width * w, points, dtype=torch.float64) for c, w in zip(centre, spread)
        ]
        mean, var = _grid_moments(problem, stats, grids[0], grids[1] if len(grids) > 1 else None)
        centre = [float(m) for m in mean[k:]]
        spread = [float(v) ** 0.5 for v in var[k:]]
    return mean, var.sqrt()


def importance_reference(problem: Problem, mode: Tensor, draws: int = 20000, seed: int = 0):
    """Logistic regression: the Laplace approximation corrected by self-normalised importance sampling.

    Proposal ``N(θ̂, H⁻¹)`` (the Laplace approximation at the float64 mode), weights ``p(θ | y) / q(θ)`` from the
    exact log joint (float32 products with the data, float64 sums). Returns the means, the sds and the weights'
    effective sample size (its Monte-Carlo error in the means: about ``1/√ESS`` sd).
    """
    from bench_accuracy import newton_system

    _, hessian = newton_system(problem, mode)
    chol = torch.linalg.cholesky(torch.linalg.inv(hessian))
    z = torch.randn(draws, mode.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    theta = mode + z @ chol.T
    log_w = -0.5 * theta.square().sum(1) + 0.5 * z.square().sum(1)  # prior − proposal (constants cancel)
    t32 = theta.float().T.contiguous()
    for start in range(0, problem.n, CHUNK // 16):
        f = problem.x[start : start + CHUNK // 16] @ t32  # (chunk, draws)
        yb = problem.y[start : start + CHUNK // 16, None]
        log_w += (yb * f - torch.nn.functional.softplus(f)).double().sum(0)
    weights = torch.softmax(log_w, 0)
    mean = weights @ theta
    sd = (weights @ (theta - mean) ** 2).sqrt()
    return mean, sd, float(1 / weights.square().sum())


# ====================================================================================== NumPyro
def jax_data(problem: Problem) -> tuple:
    """The problem's arrays as the JAX side gets them: x, y (float32)[, groups (int32)]."""
    jax = import_peers()[0]
    x = jax.numpy.asarray(problem.x.numpy())
    y = jax.numpy.asarray(problem.y.numpy().astype(np.float32))
    return (x, y) if problem.groups is None else (x, y, jax.numpy.asarray(problem.groups.numpy().astype(np.int32)))


def numpyro_model(problem: Problem):
    """The problem's model in NumPyro: same priors, same parameterisation, same arrays (``jax_data``)."""
    _, numpyro, _, _ = import_peers()
    import jax.numpy as jnp
    import numpyro.distributions as ndist

    def logistic(x, y):
        w = numpyro.sample("w", ndist.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
        numpyro.sample("obs", ndist.Bernoulli(logits=x @ w), obs=y)

    def regression(x, y):
        w = numpyro.sample("w", ndist.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
        scale = numpyro.sample("scale", ndist.HalfNormal(1.0))
        numpyro.sample("obs", ndist.Normal(x @ w, scale), obs=y)

    def hierarchical(x, y, groups):
        w = numpyro.sample("w", ndist.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
        scale = numpyro.sample("scale", ndist.HalfNormal(1.0))
        tau = numpyro.sample("tau", ndist.HalfNormal(1.0))
        with numpyro.plate("groups", problem.num_groups):
            b = numpyro.sample("b", ndist.Normal(0.0, tau))
        numpyro.sample("obs", ndist.Normal(x @ w + b[groups], scale), obs=y)

    if problem.groups is not None:
        return hierarchical
    return regression if problem.latent else logistic


def numpyro_draws(problem: Problem, samples: dict) -> Tensor:
    """NumPyro's draws in the reference's space (``bench_accuracy.unconstrained``)."""
    jax = import_peers()[0]
    return unconstrained(
        problem, {k: torch.from_numpy(np.asarray(jax.device_get(v)).copy()) for k, v in samples.items()}
    )


def gradient_seconds(problem: Problem, data: tuple) -> float:
    """Median seconds of one jitted full-data gradient of NumPyro's potential energy (after its compilation)."""
    jax = import_peers()[0]
    from numpyro.infer.util import initialize_model

    info = initialize_model(jax.random.PRNGKey(0), numpyro_model(problem), model_args=data)
    grad = jax.jit(jax.grad(info.potential_fn))
    z = info.param_info.z
    jax.block_until_ready(grad(z))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(grad(z))
        times.append(time.perf_counter() - start)
    return sorted(times)[2]


# ====================================================================================== BlackJAX
def control_variate_chains(estimator, algorithm: str, n: int, batch: int, chains: int):
    """BlackJAX's control-variate SGLD or SGHMC as one jitted sampler ``(num_steps, key, mode, step_size, alpha, xs,
    ys) -> (chains, num_steps, d)``: every step of ``chains`` vmapped chains from the mode, minibatches of ``batch``
    rows drawn with replacement, the control variate's full-data gradient once, at the start."""
    jax, _, blackjax, _ = import_peers()
    from blackjax.sgmcmc.gradients import control_variates

    @partial(jax.jit, static_argnums=0)
    def sample(num_steps: int, key, mode, step_size, alpha, xs, ys):
        controlled = control_variates(estimator, mode, (xs, ys))
        algo = blackjax.sgld(controlled) if algorithm == "sgld" else blackjax.sghmc(controlled, alpha=alpha)

        def chain(key, theta):
            def body(theta, key):
                pick, move = jax.random.split(key)
                idx = jax.random.randint(pick, (batch,), 0, n)
                theta = algo.step(move, theta, (xs[idx], ys[idx]), step_size)
                return theta, theta

            return jax.lax.scan(body, theta, jax.random.split(key, num_steps))[1]

        return jax.vmap(chain, in_axes=(0, None))(jax.random.split(key, chains), mode)

    return sample


def lbfgs_mode(neg_log_joint, n: int):
    """A jitted L-BFGS search (optax) for the minimum of ``neg_log_joint`` from a start: at most 100 iterations, until
    the gradient's norm is below ``1e-3 sqrt(n)``."""
    jax, _, _, optax = import_peers()
    solver = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(neg_log_joint)
    tolerance = 1e-3 * n**0.5

    @jax.jit
    def find_mode(start):
        def body(carry):
            theta, state = carry
            value, grad = value_and_grad(theta, state=state)
            updates, state = solver.update(grad, state, theta, value=value, grad=grad, value_fn=neg_log_joint)
            return optax.apply_updates(theta, updates), state

        def going(carry):
            count = optax.tree_utils.tree_get(carry[1], "count")
            grad = optax.tree_utils.tree_get(carry[1], "grad")
            return (count == 0) | ((count < 100) & (optax.tree_utils.tree_norm(grad) > tolerance))

        return jax.lax.while_loop(going, body, (start, solver.init(start)))[0]

    return find_mode


def blackjax_pipeline(x, y, algorithm: str):
    """Mode, step size, control variate and a block sampler, built fresh (new functions: compiled on first call)."""
    jax, _, blackjax, optax = import_peers()
    import jax.numpy as jnp
    from blackjax.sgmcmc.gradients import grad_estimator

    n = x.shape[0]

    def neg_log_joint(w):
        f = x @ w
        return 0.5 * jnp.sum(w**2) - jnp.sum(y * f - jax.nn.softplus(f))

    find_mode = lbfgs_mode(neg_log_joint, n)

    @jax.jit
    def largest_curvature(w):
        p = jax.nn.sigmoid(x @ w)
        return jnp.linalg.eigvalsh(jnp.eye(w.shape[0]) + (x * (p * (1 - p))[:, None]).T @ x)[-1]

    def log_likelihood(w, row):
        f = row[0] @ w
        return row[1] * f - jax.nn.softplus(f)

    estimator = grad_estimator(lambda w: -0.5 * jnp.sum(w**2), log_likelihood, n)

    chains = control_variate_chains(estimator, algorithm, n, BATCH, CHAINS)

    def run(num_draws: int, seed: int):
        mode = find_mode(jnp.zeros(x.shape[1], dtype=x.dtype))
        lam = largest_curvature(mode)
        # SGLD: 0.2 / λ_max keeps the stiffest direction's variance within 11%. BlackJAX's SGHMC moves the position
        # with the old momentum and the momentum with the old gradient (explicit Euler), whose energy grows by
        # h²λ per step unless friction removes it: h = 0.1 / √λ_max with α h = 0.1 holds that bias near 5%.
        step_size = 0.2 / lam if algorithm == "sgld" else 0.1 / jnp.sqrt(lam)
        alpha = 0.1 / step_size
        draws = chains(BURN_IN[algorithm] + num_draws, jax.random.PRNGKey(seed), mode, step_size, alpha, x, y)
        draws = jax.device_get(draws[:, BURN_IN[algorithm] :])
        return torch.from_numpy(draws.reshape(-1, draws.shape[-1]).copy()).double()

    return run


def check_reference(n: int = 10**4, seed: int = 7) -> None:
    """The hierarchical model's exact reference against a long NumPyro NUTS run (2 chains × 4,000 draws)."""
    import os

    from bench_accuracy import errors, make

    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    jax = import_peers()[0]
    from numpyro.diagnostics import summary
    from numpyro.infer import MCMC, NUTS

    problem = make("hierarchical", n, 10, BATCH)
    mean, sd = exact_reference(problem)
    mcmc = MCMC(NUTS(numpyro_model(problem)), num_warmup=1000, num_samples=4000, num_chains=2, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *jax_data(problem))
    ess = min(float(v["n_eff"].min()) for v in summary(mcmc.get_samples(group_by_chain=True)).values())
    worst_mean, worst_sd = errors(numpyro_draws(problem, mcmc.get_samples()), mean, sd)
    print(f"N = {n}: smallest ESS {ess:.0f}; worst mean {worst_mean:.3f} sd off, worst sd {worst_sd:.1%} off")


if __name__ == "__main__":
    check_reference()
