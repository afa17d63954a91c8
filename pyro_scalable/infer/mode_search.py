r"""The posterior mode search (SG-MCMC's control variate, SWAG's and sample-then-optimise's MAP).

**The search** (:func:`find_mode`) minimises :math:`f(\theta) = -\ell(\theta)/N` over the unconstrained latents by
L-BFGS (two-loop recursion, weak-Wolfe line search by bisection; Nocedal & Wright 2006, Alg. 7.4; Lewis & Overton
2013), in stages:

1. on fixed random subsamples :math:`\mathcal{S}` of :math:`S`, :math:`8S`, ... points (S a chunk's, while the
   data hold :data:`SUBSAMPLE_FACTOR` times as many), whose estimates
   :math:`\ell_{\mathcal{S}} = \log p(\theta) + \frac{N}{|\mathcal{S}|}\sum_{\mathcal{S}}\log p(y_i\mid\theta)`
   are deterministic objectives costing :math:`|\mathcal{S}|/N` of a pass. The mode of one lies about
   :math:`\sqrt{d N/|\mathcal{S}|}` posterior standard deviations from the full data's (d latents; at the full
   data's mode the subsample's score has :math:`N/|\mathcal{S}| - 1` times the posterior's precision as its
   covariance); each stage runs to the stopping rule below, cheaply, for the curvature it learns near its mode;
2. on full-data passes from there, keeping the curvature pairs the subsamples gave: per data point,
   :math:`\ell_{\mathcal{S}}`'s Hessian is the full data's up to :math:`O(|\mathcal{S}|^{-1/2})`, so the first
   full-data steps are already close to Newton steps.

**The start.** The search starts at the point it is given or at another (``also``: the control variate's search
is also given a draw from the prior), whichever has the highest log joint on one chunk's random points: where a
network's tanh units are saturated (``init_to_uniform``'s ±2 in every weight) the gradient is nearly flat and L-BFGS
crawls, for many times the full-data passes it takes from a draw of a fan-in-scaled prior.

**Stopping rule.** At an iterate with gradient :math:`g` of :math:`f` and the L-BFGS inverse Hessian :math:`H^{-1}` (per
point), :math:`\lambda^2 = N\,g^\top H^{-1} g` is twice the Newton decrement of :math:`\ell` in nats and the squared
length of the next quasi-Newton step in the posterior's metric, i.e. in posterior standard deviations (:math:`N H` is
the posterior precision at the mode). The search stops at the first iterate with :math:`\lambda <`
:data:`MODE_TOLERANCE` :math:`\sqrt d` and returns the full-data log joint and gradient of that iterate, already
computed: the control variate's, so no pass follows the search. The controlled noise grows with
:math:`\lVert\theta-\hat\theta\rVert^2` (:mod:`~pyro_scalable.infer.sgmcmc.control_variates`), whose mean over the
posterior, in its metric, is :math:`d` at the mode and :math:`d + \delta^2` at a centre :math:`\delta` standard
deviations from it: a centre within :math:`0.1\sqrt d` adds at most 1% to it. On a Gaussian posterior the quasi-Newton
step is the distance left up to its Hessian's error; L-BFGS converges superlinearly, and from the subsamples' curvature
a few full-data passes reach the rule on a logistic regression (at most four:
``tests/infer/sgmcmc/test_control_variates.py``). Before the first curvature pair :math:`\lambda` means nothing (no
Hessian is known), and with a few it measures the step in a metric learned along a few directions only: on the full data
the rule waits for :data:`_TRUSTED` pairs (d, where fewer; the subsamples' pairs count, and a subsample's stage, which
only hands its point and pairs on, trusts its first). Trusted too early, the rule can call a point the mode that is not
one: on a network, a centre that the chains then leave, where the controlled noise is nearly the plain noise. Waiting
for more pairs costs a pass or two where the early stop would have been right.

**The exact check.** The quasi-Newton metric is learnt along the path, and where the path crossed a stiff direction only
(a noise scale) it can overstate the curvature of the directions it has not explored: from a draw of a vague prior
(Normal(0, 1000) coefficients, a HalfNormal(1000) noise scale) the search can reach the plateau where the noise scale
has grown to the residuals' size, λ by the metric under the tolerance while the exact Newton step is many posterior sds
long (and the Hessian indefinite: a ridge, not a mode), and a control variate centred there makes warm-up's step
collapse. Up to :data:`EXACT_NEWTON` latents a claimed stop is therefore checked on the exact Hessian (one pass of d
Hessian-vector products per chunk): λ² = N gᵀH⁻¹g must be under the tolerance, or Newton steps (Levenberg–Marquardt
shifted where H is not positive definite, the shift taken in coordinates where H's diagonal is 1, with the same line
search) go on until it is. The same steps take over where L-BFGS's line search finds no way up or its iterations run
out, as on a regression with unscaled predictors, whose curvatures can be many orders of magnitude apart: there L-BFGS
stalls far from the mode, a shift of the identity would move the point little per step, and the shift in the coordinates
where H's diagonal is 1 reaches the mode in a few steps. From a start near the mode the check costs the one Hessian
pass.

The values are sums of float32 chunks whose rounding (about :math:`10^{-7}` of :math:`\lvert\ell\rvert`) can exceed
the decrease a step near the mode achieves; the line search's sufficient-decrease test allows for it, and its
curvature test, on gradients, does not need to. A log joint of :math:`+\infty` or NaN at a trial point (an overflow
past the mode, or a density without a finite mode such as a hierarchy whose scale runs to 0) ends the search with
NaN latents, which :func:`~pyro_scalable.infer.sgmcmc.control_variates.prepare` reports as no finite mode;
:math:`-\infty` (zero density)
only shortens the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from pyro_scalable.bridge.minibatches import CHUNK_SIZE, points_per_chunk
from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.infer.full_data import (
    ControlVariate,
    as_control_variate,
    full_data_gradient,
    full_data_hessian,
    full_data_hvps,
    full_data_sums,
    point_gradient_and_value,
)

__all__ = [
    "CHUNK_SIZE",
    "ControlVariate",
    "ModeSearch",
    "find_mode",
    "full_data_gradient",
    "full_data_hessian",
    "full_data_hvps",
    "point_gradient_and_value",
]

SUBSAMPLE_FACTOR = 8  # a subsample stage where the data hold this many times its points; each the next's 1/8
MODE_TOLERANCE = 0.1  # stop where the next step is under this times √d posterior standard deviations (d latents)
MODE_ITERATIONS = 200  # L-BFGS iterations per stage at most
_HISTORY = 20  # curvature pairs kept
_TRUSTED = 10  # curvature pairs (or d, where fewer) before the stopping rule trusts the step's length
_LINE_SEARCH = 40  # trial points per line search at most
_C1, _C2 = 1e-4, 0.9  # the weak Wolfe conditions' constants
EXACT_NEWTON = 64  # up to this many latents the stopping rule is checked, and the search finished, on the exact Hessian
_NEWTON_STEPS = 20  # exact Newton steps at most


class ModeSearch(NamedTuple):
    """How :func:`find_mode` went and what it found.

    ``full_passes`` and ``subsample_passes``: evaluations on the full data and on the subsamples (S, 8S, ... of N
    points: that fraction of a pass); ``hessian_passes``: passes of the exact Hessian (d ≤ :data:`EXACT_NEWTON`);
    ``grad_norm``: the full-data gradient's norm at the mode; ``converged``: the
    stopping rule was met; ``control``: the full-data log joint and gradient at the mode (``None`` where the search
    found no finite mode).
    """

    full_passes: int
    subsample_passes: int
    grad_norm: float
    seconds: float
    converged: bool = False
    control: ControlVariate | None = None
    hessian_passes: int = 0


class _Memory:
    """L-BFGS curvature pairs (s, y) and the two-loop product -H⁻¹g (Nocedal & Wright 2006, Alg. 7.4)."""

    def __init__(self):
        self.pairs: list[tuple[Tensor, Tensor, float]] = []

    def add(self, s: Tensor, y: Tensor) -> None:
        sy = float(s @ y)
        if sy > 1e-10 * float(s.norm() * y.norm()):  # positive curvature (weak Wolfe ensures it up to rounding)
            self.pairs = [*self.pairs[-(_HISTORY - 1) :], (s, y, 1.0 / sy)]

    def direction(self, g: Tensor) -> Tensor:
        q, alphas = -g, []
        for s, y, rho in reversed(self.pairs):
            alphas.append(rho * float(s @ q))
            q = q - alphas[-1] * y
        if self.pairs:
            s, y, _ = self.pairs[-1]
            q = q * (float(s @ y) / float(y @ y))
        for (s, y, rho), alpha in zip(self.pairs, reversed(alphas), strict=True):
            q = q + (alpha - rho * float(y @ q)) * s
        return q


def find_mode(
    full: ModelBridge,
    start: Latents,
    generator: torch.Generator,
    *,
    iterations: int = MODE_ITERATIONS,
    tolerance: float = MODE_TOLERANCE,
    chunk_size: int | None = None,
    reducer: Any = None,
    progress: bool = False,
    description: str = "Mode search",
    also: Sequence[Latents] = (),
) -> tuple[Latents, ModeSearch]:
    """The posterior mode in unconstrained space, from ``start``: L-BFGS on a subsample, then on full-data passes.

    ``generator`` draws the subsamples (module docstring). Returns the mode (NaN where the search
    found no finite mode) and a :class:`ModeSearch` holding the full-data log joint and gradient there. The search
    stops where the next step is under ``tolerance``·√d posterior sds (a control variate's centre needs no closer;
    a point estimate others start from, e.g. SWAG's, asks for a smaller one). ``progress`` shows a progress bar of
    the passes over the data (a subsample's pass counted as its share) and the next step's length in posterior sds,
    headed ``description``. ``also``: other points to start from; the search starts at whichever of ``start`` and
    these has the highest log joint on one chunk's random subsample (the whole data where it fits in one), the
    first on ties and where none is finite.
    """
    began = time.perf_counter()
    plate = next(iter(full.plates.values()), None)
    n = float(plate.size) if plate is not None else 1.0
    size = points_per_chunk(full, chunk_size)
    counts, compared_passes = [0, 0, 0], 0.0  # full-data, subsample and Hessian evaluations; the start's passes
    if also:
        start, compared = _best_start(full, [start, *also], generator, size, reducer)
        counts[compared is not None] += len(also) + 1
        compared_passes = (len(also) + 1) * (1.0 if compared is None else len(compared) / n)
    names = list(start)
    shapes, dtypes = [start[k].shape for k in names], [start[k].dtype for k in names]
    x = torch.cat([start[k].detach().reshape(-1).double() for k in names])
    slack = 8 * max(torch.finfo(t).eps for t in dtypes)  # the values' relative rounding (module docstring)

    def unflatten(x: Tensor) -> Latents:
        parts = x.split([math.prod(s) for s in shapes])
        return {k: p.reshape(s).to(t) for k, p, s, t in zip(names, parts, shapes, dtypes, strict=True)}

    def evaluate(x: Tensor, indices: Tensor | None) -> tuple[float, Tensor, Any]:
        counts[indices is not None] += 1
        bar.update(1.0 if indices is None else len(indices) / n)
        latents = unflatten(x)
        value, total = full_data_sums(full, latents, size, reducer, indices)
        g = -torch.cat([total[k].reshape(-1) for k in names]) / n
        return -float(value) / n, g, (as_control_variate(latents, value, total) if indices is None else None)

    def hessian(x: Tensor) -> Tensor:
        counts[2] += 1  # one pass over the data, of d Hessian-vector products per chunk
        bar.update(1.0)
        return -full_data_hessian(full, unflatten, x, size, reducer) / n

    stages: list[Tensor | None] = []  # subsamples of S, 8 S, ... points while the data hold 8 times as many
    points = size
    while plate is not None and plate.size >= SUBSAMPLE_FACTOR * points:
        stages.append(torch.randint(0, plate.size, (points,), generator=generator, device=full.device))
        points *= SUBSAMPLE_FACTOR
    stages.append(None)
    tolerance = tolerance * math.sqrt(len(x))
    memory, converged, control = _Memory(), False, None
    layout = "{desc}: {n:.1f} passes over the data [{elapsed}{postfix}]"
    bar = tqdm(desc=description, unit="pass", bar_format=layout, disable=not progress)
    bar.update(compared_passes)
    try:
        for indices in stages:
            f, g, control = evaluate(x, indices)
            if not (math.isfinite(f) and bool(torch.isfinite(g).all())):
                raise _NoFiniteMode
            converged = False
            for _ in range(iterations):
                d = memory.direction(g)
                decrement = -n * float(g @ d)  # λ², in posterior sds squared
                if memory.pairs:
                    step_sds = math.sqrt(max(decrement, 0.0))
                    bar.set_postfix_str(f"next step {step_sds:.3g} sd, stops under {tolerance:.3g}", refresh=False)
                trusted = len(memory.pairs) >= (min(_TRUSTED, len(x)) if indices is None else 1)  # the last stage
                if trusted and decrement < tolerance**2:
                    if indices is None and len(x) <= EXACT_NEWTON:  # confirmed, or finished, on the exact Hessian
                        x, f, g, control, converged = _newton(evaluate, hessian, x, f, g, control, n, tolerance, slack)
                    else:  # (a subsample's stage only hands its point and pairs on)
                        converged = True
                    break
                t = 1.0 if memory.pairs else min(1.0, 1.0 / float(g.abs().sum()))
                step = _line_search(lambda x_t, i=indices: evaluate(x_t, i), x, f, g, d, t, slack * abs(f))
                if step is None and indices is None and len(x) <= EXACT_NEWTON:
                    # L-BFGS's direction found no way up (a metric learnt far from the mode, across directions
                    # whose curvatures differ by orders of magnitude): exact Newton steps from here decide
                    x, f, g, control, converged = _newton(evaluate, hessian, x, f, g, control, n, tolerance, slack)
                    if converged:
                        break
                    step = None
                if step is None and indices is None:  # stalled on the full data short of the mode: a log joint
                    raise _NoFiniteMode  # that rounding leaves no way up (a funnel's neck), not a mode
                if step is None:
                    break
                x_new, f, g_new, control = step
                memory.add(x_new - x, g_new - g)
                x, g = x_new, g_new
            else:  # the iterations ran out short of the stopping rule: up to 64 latents exact Newton steps finish
                if indices is None and len(x) <= EXACT_NEWTON:
                    x, f, g, control, converged = _newton(evaluate, hessian, x, f, g, control, n, tolerance, slack)
    except _NoFiniteMode:
        x, control, converged = torch.full_like(x, math.nan), None, False
    finally:
        bar.close()
    norm = (
        math.nan
        if control is None
        else math.sqrt(sum(float(v.double().square().sum()) for v in control.gradient.values()))
    )
    search = ModeSearch(counts[0], counts[1], norm, time.perf_counter() - began, converged, control, counts[2])
    return unflatten(x), search


def _newton(evaluate: Callable, hessian: Callable, x, f, g, control, n: float, tolerance: float, slack: float):
    """Newton steps on the exact Hessian (shifted where not positive definite) until λ < ``tolerance``.

    Returns ``(x, f, g, control, converged)``. λ² = n gᵀH⁻¹g with the exact H: the stopping rule the quasi-Newton
    metric only estimates (module docstring: "Stopping rule").
    """
    for _ in range(_NEWTON_STEPS):
        h = hessian(x)
        # in Jacobi-scaled coordinates (H's diagonal made 1), so that the shift below is the same whatever the
        # latents' units (an unscaled regression's intercept and log-noise differ by 10^5 in curvature)
        scale = h.diagonal().abs().clamp_min(torch.finfo(h.dtype).tiny).rsqrt()
        scaled = scale[:, None] * h * scale[None, :]
        smallest = float(torch.linalg.eigvalsh(scaled)[0])
        if smallest > 0:
            step = -torch.linalg.solve(h, g)
            if -n * float(g @ step) < tolerance**2:
                return x, f, g, control, True
        else:  # a saddle or a ridge (a scale's plateau): a Levenberg-Marquardt shift makes the step descend
            shift = 2.0 * abs(smallest) + 1e-8
            eye = torch.eye(len(x), dtype=h.dtype, device=h.device)
            step = -scale * torch.linalg.solve(scaled + shift * eye, scale * g)
        found = _line_search(lambda x_t: evaluate(x_t, None), x, f, g, step, 1.0, slack * abs(f))
        if found is None:
            return x, f, g, control, False
        x, f, g, control = found
    return x, f, g, control, False


def _best_start(
    full: ModelBridge, candidates: list[Latents], generator: torch.Generator, size: int, reducer: Any
) -> tuple[Latents, Tensor | None]:
    """The candidate with the highest log joint on one chunk's random points (``None``: the whole data) and them.

    Where the log joints tie or none is finite, the first candidate.
    """
    plate = next(iter(full.plates.values()), None)
    indices = None
    if plate is not None and plate.size > size:
        indices = torch.randint(0, plate.size, (size,), generator=generator, device=full.device)
    best, best_value = candidates[0], -math.inf
    for candidate in candidates:
        value = float(full_data_sums(full, candidate, size, reducer, indices)[0])
        if math.isfinite(value) and value > best_value:
            best, best_value = candidate, value
    return best, indices


class _NoFiniteMode(Exception):
    """A trial point's log joint was NaN or +∞, or its gradient not finite."""


def _line_search(evaluate: Callable, x: Tensor, f: float, g: Tensor, d: Tensor, t: float, slack: float):
    """A step ``x + t d`` meeting the weak Wolfe conditions, as ``(x, f, g, control)``.

    ``None`` where none was found within :data:`_LINE_SEARCH` trials; :class:`_NoFiniteMode` at a log joint of +∞,
    or a gradient not finite at a point no worse than ``x`` (running downhill to where the gradient overflows: a mode
    on a support's edge); a trial point uphill whose gradient overflows (e.g. a scale near 0 at large N, in float32)
    or whose log joint is NaN (the model overflowed there: a long step from a poor start took a scale's log to 800)
    only shortens the step.
    """
    slope = float(g @ d)
    lo, hi = 0.0, math.inf
    for _ in range(_LINE_SEARCH):
        x_t = x + t * d
        f_t, g_t, control = evaluate(x_t)
        finite = bool(torch.isfinite(g_t).all())
        if f_t == -math.inf or (not finite and f_t <= f):  # downhill to where ∇ overflows
            raise _NoFiniteMode
        # too far: +∞ or NaN (a trial point where the model overflows, e.g. a scale's exp), or uphill where ∇ does
        if math.isnan(f_t) or f_t > f + _C1 * t * slope + slack or not finite:
            hi = t
        elif float(g_t @ d) < _C2 * slope:  # too short: the slope is still steep
            lo = t
        else:
            return x_t, f_t, g_t, control
        t = 0.5 * (lo + hi) if hi < math.inf else 2.0 * t
    return None
