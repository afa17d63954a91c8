"""The blocks' moves (MALA, HMC, the Newton move) keep their target exactly, whatever the preconditioner and step."""

import math

import torch

from pyro_scalable.infer.multilevel.mala import DualAveraging, hmc, newton, precision_factor


def test_mala_keeps_a_gaussian_with_a_wrong_preconditioner():
    gen = torch.Generator().manual_seed(0)
    mean = torch.tensor([1.0, -2.0], dtype=torch.float64)
    covariance = torch.tensor([[2.0, 0.9], [0.9, 0.6]], dtype=torch.float64)
    precision = torch.linalg.inv(covariance)
    chol = torch.linalg.cholesky(covariance)
    blocks = 20_000  # independent blocks started at exact draws: after any number of moves, still exact draws
    x = mean + torch.randn(blocks, 2, generator=gen, dtype=torch.float64) @ chol.T

    def density(z):
        r = z - mean
        return -0.5 * ((r @ precision) * r).sum(-1), -(r @ precision)

    factor = precision_factor(torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64)).expand(blocks, 2, 2)
    value, gradient = density(x)
    accepted = 0.0
    for _ in range(10):
        move = hmc(x, value, gradient, factor, 1.7, 1, density, gen)  # one step: MALA
        x, value, gradient = move.x, move.log_density, move.gradient
        accepted += float(move.accept.mean()) / 10
    assert 0.1 < accepted < 0.9  # the test moves the blocks: neither all kept nor all taken
    _assert_gaussian(x, mean, covariance)


def test_precision_factor_floors_an_indefinite_curvature():
    factor = precision_factor(torch.tensor([[2.0, 0.0], [0.0, -1.0]]))
    values = torch.linalg.eigvalsh(factor @ factor.T)
    assert values.min() > 0 and math.isclose(float(values.max()), 2.0, rel_tol=1e-6)


def test_dual_averaging_finds_the_step_of_a_known_acceptance_curve():
    steps = DualAveraging(torch.ones(2, dtype=torch.float64), target=0.6)
    for _ in range(2000):  # acceptance exp(-h) and exp(-2h): 0.6 at h = -log 0.6 and half of it
        steps.update(torch.exp(-steps.step * torch.tensor([1.0, 2.0], dtype=torch.float64)))
    torch.testing.assert_close(
        steps.final, -math.log(0.6) / torch.tensor([1.0, 2.0], dtype=torch.float64), atol=0.02, rtol=0
    )


def test_hmc_keeps_a_gaussian_with_a_wrong_mass_matrix():
    gen = torch.Generator().manual_seed(1)
    mean = torch.tensor([1.0, -2.0], dtype=torch.float64)
    covariance = torch.tensor([[2.0, 0.9], [0.9, 0.6]], dtype=torch.float64)
    precision = torch.linalg.inv(covariance)
    blocks = 20_000
    x = mean + torch.randn(blocks, 2, generator=gen, dtype=torch.float64) @ torch.linalg.cholesky(covariance).T

    def density(z):
        r = z - mean
        return -0.5 * ((r @ precision) * r).sum(-1), -(r @ precision), r.square().sum(-1)

    factor = precision_factor(torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64)).expand(blocks, 2, 2)
    value, gradient, spread = density(x)
    accepted = 0.0
    for _ in range(5):
        move = hmc(x, value, gradient, factor, 0.8, 3, density, gen, (spread,))
        x, value, gradient, (spread,) = move.x, move.log_density, move.gradient, move.extra
        accepted += float(move.accept.mean()) / 5
    assert 0.1 < accepted < 0.95
    torch.testing.assert_close(spread, (x - mean).square().sum(-1))  # the extra output follows each block
    _assert_gaussian(x, mean, covariance)


def test_delayed_acceptance_on_a_wrong_proxy_keeps_the_target():
    """The trajectory runs on a proxy Gaussian (mean and covariance both wrong); the second stage makes it exact."""
    gen = torch.Generator().manual_seed(2)
    mean = torch.tensor([1.0, -2.0], dtype=torch.float64)
    covariance = torch.tensor([[2.0, 0.9], [0.9, 0.6]], dtype=torch.float64)
    precision = torch.linalg.inv(covariance)
    proxy_mean, proxy_precision = mean + 0.4, torch.diag(torch.tensor([0.4, 2.5], dtype=torch.float64))
    blocks = 20_000
    x = mean + torch.randn(blocks, 2, generator=gen, dtype=torch.float64) @ torch.linalg.cholesky(covariance).T

    def log_gaussian(z, centre, curvature):
        r = z - centre
        return -0.5 * ((r @ curvature) * r).sum(-1)

    def proxy(z):
        return log_gaussian(z, proxy_mean, proxy_precision), -((z - proxy_mean) @ proxy_precision)

    def gap(z):  # the target less the proxy
        return log_gaussian(z, mean, precision) - log_gaussian(z, proxy_mean, proxy_precision)

    def correct(z, more):
        return gap(z) - gap(x), more

    factor = precision_factor(proxy_precision).expand(blocks, 2, 2)
    accepted = 0.0
    for _ in range(5):
        value, gradient = proxy(x)
        move = hmc(x, value, gradient, factor, 0.9, 3, proxy, gen, (), correct)
        x = move.x
        accepted += float(move.accept.mean()) / 5
    assert 0.1 < accepted < 0.9
    _assert_gaussian(x, mean, covariance)


def _gaussian_blocks(seed, blocks):
    """Exact draws of a correlated 2-d Gaussian, and its log density and gradient."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.tensor([1.0, -2.0], dtype=torch.float64)
    covariance = torch.tensor([[2.0, 0.9], [0.9, 0.6]], dtype=torch.float64)
    x = mean + torch.randn(blocks, 2, generator=gen, dtype=torch.float64) @ torch.linalg.cholesky(covariance).T
    precision = torch.linalg.inv(covariance)

    def density(z):
        r = z - mean
        return -0.5 * ((r @ precision) * r).sum(-1), -(r @ precision)

    return gen, mean, covariance, x, density


def _assert_gaussian(x, mean, covariance):
    """The blocks' mean and covariance entries, each within 5 standard errors (Gaussian fourth moments)."""
    blocks = x.shape[0]
    se = (covariance.diagonal() / blocks).sqrt()
    assert ((x.mean(0) - mean).abs() < 5 * se).all()
    sample = torch.cov(x.T)
    var_se = ((covariance**2 + covariance.diagonal()[:, None] * covariance.diagonal()[None, :]) / blocks).sqrt()
    assert ((sample - covariance).abs() < 5 * var_se).all()


def test_the_newton_move_keeps_a_gaussian_with_a_wrong_preconditioner():
    blocks = 20_000
    gen, mean, covariance, x, density = _gaussian_blocks(3, blocks)
    factor = precision_factor(torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64)).expand(blocks, 2, 2)
    value, gradient = density(x)
    accepted = 0.0
    for _ in range(10):
        move = newton(x, value, gradient, factor, 0.8, density, gen)
        x, value, gradient = move.x, move.log_density, move.gradient
        accepted += float(move.accept.mean()) / 10
    assert 0.1 < accepted < 0.95  # the test moves the blocks and rejects some: the acceptance ratio is exercised
    _assert_gaussian(x, mean, covariance)


def test_the_newton_move_with_the_exact_precision_is_an_exact_draw_always_accepted():
    """At s = 1 a Gaussian block's move is a fresh draw of it: accepted always, independent of where it started."""
    blocks = 20_000
    gen, mean, covariance, x, density = _gaussian_blocks(4, blocks)
    precision = torch.linalg.inv(covariance)
    value, gradient = density(x)
    move = newton(x, value, gradient, precision_factor(precision).expand(blocks, 2, 2), 1.0, density, gen)
    torch.testing.assert_close(move.accept, torch.ones(blocks, dtype=torch.float64))
    _assert_gaussian(move.x, mean, covariance)
    for j in range(2):  # the draw forgets its start: correlation within 5 standard errors (1 / sqrt(n)) of 0
        assert abs(float(torch.corrcoef(torch.stack([x[:, j], move.x[:, j]]))[0, 1])) < 5 / math.sqrt(blocks)


def test_the_newton_move_keeps_a_skewed_target_and_its_delayed_acceptance_corrects_a_wrong_proxy():
    """A Gumbel target (skewed, not Gaussian), moved on a Gaussian proxy: the second stage makes it exact."""
    blocks = 40_000
    gen = torch.Generator().manual_seed(5)
    gumbel = torch.distributions.Gumbel(torch.tensor(0.5, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64))
    x = gumbel.sample((blocks, 1))

    def target(z):
        return gumbel.log_prob(z).sum(-1)

    def proxy(z):  # a Gaussian near the Gumbel's mean and spread, neither exact
        return -0.5 * ((z - 1.2) / 1.8).square().sum(-1), -(z - 1.2) / 1.8**2

    def correct(z, more):
        return (target(z) - proxy(z)[0]) - (target(x) - proxy(x)[0]), more

    factor = torch.full((blocks, 1, 1), 1 / 1.8, dtype=torch.float64)
    accepted = 0.0
    for _ in range(10):
        value, gradient = proxy(x)
        move = newton(x, value, gradient, factor, 1.0, proxy, gen, (), correct)
        x = move.x
        accepted += float(move.accept.mean()) / 10
    assert 0.3 < accepted < 0.99
    exact = gumbel.sample((blocks, 1))
    # the mean and variance, each within 5 standard errors of the law's
    sd = float(gumbel.stddev)
    assert abs(float(x.mean() - gumbel.mean)) < 5 * sd / math.sqrt(blocks)
    spread = float((exact - exact.mean()).square().std())  # the sd of a squared deviation, from exact draws
    assert abs(float(x.var() - gumbel.variance)) < 5 * spread / math.sqrt(blocks)
    # quantiles: the fraction below each of the law's deciles within 5 binomial standard errors
    for q in (0.1, 0.5, 0.9):
        below = float((x < gumbel.icdf(torch.tensor(q, dtype=torch.float64))).double().mean())
        assert abs(below - q) < 5 * math.sqrt(q * (1 - q) / blocks)


def test_a_quarter_period_trajectory_forgets_a_gaussians_place_and_mostly_its_spread():
    """Steps of pi/6 on N(0, 1) with the exact mass matrix: x(t) = x cos t + rho sin t, t the jittered length.

    At the sweep's cap, three steps (t uniform on [pi/4, 3pi/4]), the draws' correlation is E[cos t] = 0 and their
    squares' E[cos^2 t] = 1/2 - 1/pi; six steps, half a period (t on [pi/2, 3pi/2]): -2/pi and 1/2, antithetic and
    the spread slow.
    """
    blocks = 40_000
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(blocks, 1, generator=gen, dtype=torch.float64)

    def density(z):
        return -0.5 * z.square().sum(-1), -z

    factor = torch.ones(blocks, 1, 1, dtype=torch.float64)
    se = 5 / math.sqrt(blocks)
    for steps, mean_cos, mean_cos2 in ((3, 0.0, 0.5 - 1 / math.pi), (6, -2 / math.pi, 0.5)):
        value, gradient = density(x)
        moved = hmc(x, value, gradient, factor, math.pi / 6, steps, density, gen).x
        place = float(torch.corrcoef(torch.stack([x[:, 0], moved[:, 0]]))[0, 1])
        spread = float(torch.corrcoef(torch.stack([x[:, 0].square(), moved[:, 0].square()]))[0, 1])
        # within 5 standard errors, and 0.03 for the leapfrog's frequency error at these steps
        assert abs(place - mean_cos) < se + 0.03, (steps, place)
        assert abs(spread - mean_cos2) < 2 * se + 0.03, (steps, spread)
