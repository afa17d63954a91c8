r"""Conjugate-gradient refinement of every row on the full data, and an error estimate that sees every direction.

Every row :math:`z_k` of a solve (each draw and the mean) minimises a quadratic with Hessian :math:`H = M + A` and
solves :math:`Hz_k = A\theta^n_k`. Minibatch SGD moves along an eigenvector of :math:`P^{-1}H` with eigenvalue
:math:`\lambda` by a factor :math:`1 - \eta\lambda` per step, with :math:`\eta` bounded by a *minibatch's* largest
eigenvalue; when the features are correlated, the diagonal preconditioner :math:`P` leaves small eigenvalues, and the
draws can stay several posterior sds off after many epochs. Its gradient norm does not show it: a residual
:math:`g = Hz - A\theta^n` is small in a direction of small curvature even where the error :math:`e = H^{-1}g` is large.

**The error in posterior sds.** For any direction :math:`u`, the error of a row along :math:`u` in units of the
posterior sd along :math:`u` is at most the row's error in the energy norm,

.. math::

    \frac{|u^\top e|}{\sqrt{u^\top H^{-1} u}} \le \lVert e\rVert_H = \sqrt{e^\top H e} = \sqrt{g^\top H^{-1} g}

(Cauchy-Schwarz in the :math:`H` inner product), so :math:`\lVert e\rVert_H \le \varepsilon` says the row is within
:math:`\varepsilon` posterior sds in *every* direction, a coordinate or a prediction alike. Two estimates of it:

* an upper bound for free: :math:`H \succeq A` gives :math:`\lVert e\rVert_H^2 \le g^\top A^{-1} g`, tight where the
  prior dominates, loose (by up to the ratio of data to prior curvature) where the data do;
* the conjugate-gradient estimate (Hestenes & Stiefel 1952; Strakoš & Tichý 2002): preconditioned CG on
  :math:`Hz = b` from :math:`z_0` has :math:`\lVert e_j\rVert_H^2 - \lVert e_{j+1}\rVert_H^2 = \alpha_j\, r_j^\top
  P^{-1} r_j` exactly, so :math:`\sum_{j=i}^{i+\ell-1}\alpha_j r_j^\top P^{-1}r_j` is a lower bound on
  :math:`\lVert e_i\rVert_H^2` that is tight once the iterations converge faster than over :math:`\ell` steps; the
  energy error decreases monotonically, so iterate :math:`i + \ell` is at least as good.

**The refinement.** After the minibatch epochs, CG continues every row on full-data products (one batched JVP and
VJP per chunk, the cost of an epoch), preconditioned by the same :math:`P`, from the rows SGD reached. It stops when
the estimate for iterate :math:`i = n - \ell` is below the tolerance for every row, and returns iterate :math:`n`;
or when its budget of passes ends, when :func:`warn_unconverged` warns with the estimate. CG needs no step size and
no minibatch noise floor; it converges in :math:`O(\sqrt{\kappa(P^{-1}H)})` passes where SGD needs
:math:`O(\kappa)` steps' worth, and its iterates are exact full-data solves (no variance reduction needed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import user_stacklevel
from pyro_scalable.infer.autodiff import row_slices

__all__ = ["RefineResult", "conjugate_gradient", "row_diagnostics", "warn_unconverged"]


class RefineResult(NamedTuple):
    """The refined rows, the passes made and each row's estimated energy-norm error (posterior sds)."""

    rows: Tensor  # (R, d)
    passes: int
    error: Tensor  # (R,): sqrt of the CG estimate of ||e||_H^2 for the returned rows (an upper estimate: see above)
    converged: bool


def conjugate_gradient(
    product: Callable[[Tensor], Tensor],
    rhs: Tensor,
    start: Tensor,
    inverse_preconditioner: Tensor | None,
    *,
    max_passes: int,
    tolerance: float,
    delay: int = 5,
    on_pass: Callable[[int], None] | None = None,
    overwrite: bool = False,
) -> RefineResult:
    r"""Preconditioned CG on :math:`Hz_r = b_r` for every row ``r`` at once, stopped by the energy-error estimate.

    Args:
        product: ``v (R, d) -> H v`` for every row.
        rhs: the right-hand sides ``b`` ``(R, d)``.
        start: the rows to start from ``(R, d)``.
        inverse_preconditioner: :math:`P^{-1}` ``(d,)`` (``None``: no preconditioning).
        max_passes: the most products with :math:`H` (one full-data pass each).
        tolerance: stop once every row's estimated :math:`\lVert e\rVert_H` is below it.
        delay: :math:`\ell`, the iterations the estimate looks ahead.
        on_pass: called with the pass count after every product (a progress bar).
        overwrite: iterate in ``start`` itself (the rows returned) and keep the residual in ``rhs``: the solver's
            own memory is then the search directions and one product, ``2 R x d`` (else ``4 R x d``).

    Returns the rows reached, the passes made, each row's estimate for the rows returned — the sum of the
    last :math:`\ell` terms (the bound of iterate :math:`n - \ell`, which the returned iterate improves on) — and
    whether the tolerance was met.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.linearized.sampling.krylov import conjugate_gradient
        >>> h = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> b = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
        >>> out = conjugate_gradient(lambda v: v @ h, b, 0 * b, None, max_passes=20, tolerance=1e-8, delay=1)
        >>> out.converged, torch.allclose(out.rows[0], torch.linalg.solve(h, b[0]))
        (True, True)

    """
    x = start if overwrite else start.clone()
    r = (rhs if overwrite else rhs.clone()).sub_(product(x))
    weight = inverse_preconditioner
    p = r.clone() if weight is None else r * weight  # z = P^{-1} r, the first direction
    rz = _weighted_dot(r, r, weight)
    terms: list[Tensor] = []
    passes, converged = 1, False
    if on_pass is not None:
        on_pass(passes)
    tiny = torch.finfo(x.dtype).tiny
    while passes < max_passes:
        hp = product(p)
        passes += 1
        if on_pass is not None:
            on_pass(passes)
        curvature = _weighted_dot(p, hp)
        done = curvature <= tiny  # a row already solved (r = 0) keeps its iterate
        alpha = torch.where(done, torch.zeros_like(rz), rz / curvature.clamp_min(tiny)).unsqueeze(-1)
        x.addcmul_(alpha, p)
        r.addcmul_(alpha, hp, value=-1)
        del hp
        terms.append(alpha.squeeze(-1) * rz)
        new_rz = _weighted_dot(r, r, weight)
        beta = torch.where(done, torch.zeros_like(rz), new_rz / rz.clamp_min(tiny)).unsqueeze(-1)
        p.mul_(beta)  # p = z + beta p, with z = P^{-1} r never stored
        if weight is None:
            p.add_(r)
        else:
            p.addcmul_(r, weight)
        rz = new_rz
        if len(terms) >= delay and bool((torch.stack(terms[-delay:]).sum(0) <= tolerance**2).all()):
            converged = True
            break
    window = terms[-delay:] if terms else [torch.full_like(rz, float("inf"))]
    error = torch.stack(window).sum(0).clamp_min(0).sqrt()
    return RefineResult(x, passes, error, converged)


def _weighted_dot(a: Tensor, b: Tensor, weight: Tensor | None = None) -> Tensor:
    """``Σ_j a_rj w_j b_rj`` for every row ``r``, a few rows at a time (temporaries of a few MB, not ``R x d``)."""
    out = a.new_empty(a.shape[0])
    for part in row_slices(*a.shape):
        product = a[part] * b[part]
        out[part] = (product if weight is None else product.mul_(weight)).sum(-1)
    return out


def row_diagnostics(
    rows: Tensor, products: Tensor, targets: Tensor, precision: Tensor, inverse_preconditioner: Tensor | None
) -> dict[str, Tensor]:
    r"""Every row's objective, full-data gradient norm, relative gradient norm and (preconditioned) error in sds.

    ``products`` is :math:`M z` for every row ``z`` of ``rows``; the gradient is :math:`g = Mz + A(z - \theta^n)`.
    A row's error :math:`e = H^{-1}g` has :math:`e^\top He = g^\top H^{-1}g \approx g^\top P^{-1}g`, against
    :math:`\mathrm E[\zeta^\top H\zeta] = d` for a draw: ``error_in_sds`` is the RMS error in posterior sds, as
    large in the prior's directions as anywhere (only with a preconditioner). Computed a few rows at a time.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.linearized.sampling.krylov import row_diagnostics
        >>> rows = torch.tensor([[1.0, 0.0]])
        >>> stats = row_diagnostics(rows, 2 * rows, torch.zeros(1, 2), torch.ones(2), None)
        >>> stats["objective"], stats["grad_norm"]
        (tensor([1.5000]), tensor([3.]))

    """
    stats = torch.full((4, rows.shape[0]), float("nan"), dtype=rows.dtype, device=rows.device)
    for part in row_slices(*rows.shape):
        offset = rows[part] - targets[part]
        gradient = products[part] + precision * offset
        stats[0, part] = 0.5 * (rows[part] * products[part]).sum(-1) + 0.5 * (precision * offset**2).sum(-1)
        stats[1, part] = gradient.norm(dim=-1)
        stats[2, part] = (precision * targets[part]).norm(dim=-1)
        if inverse_preconditioner is not None:
            stats[3, part] = ((gradient.square() * inverse_preconditioner).sum(-1) / rows.shape[-1]).sqrt()
    out = {"objective": stats[0], "grad_norm": stats[1], "relative_grad_norm": stats[1] / stats[2]}
    if inverse_preconditioner is not None:
        out["error_in_sds"] = stats[3]
    return out


def warn_unconverged(
    stats: dict[str, Tensor],
    *,
    mean_error: float | None,
    tolerance: float,
    refine_passes: int,
    cause: bool = False,
) -> None:
    """Warn when the draws have not converged (full-data gradients of the last solve).

    After the conjugate-gradient refinement: when it ended before every row was within ``tolerance`` posterior sds in
    every direction (CG's energy-error estimate, :mod:`.krylov`). Without it, with the preconditioner: the median RMS
    error of a draw in posterior sds above 0.1, estimated as ``sqrt(gᵀ P⁻¹ g / d)`` (blind to the directions the
    correlations slow down: it can read small while the mean is several sds off). Without either: the median relative
    gradient norm above 0.1 (blind to the directions the prior dominates).

    ``cause``: the noise-scale warning fired; a σ near zero (an interpolating MAP) makes :math:`H` so
    ill-conditioned that no number of passes is the remedy, and the warning says so.
    """
    remedy = (
        "Raise refine_passes."
        if not cause
        else ("The noise scale warned about before this is the likely cause (H scales as 1/σ²): fix the MAP first.")
    )
    if "cg_error" in stats:
        worst, mean = float(stats["cg_error"].max()), mean_error
        if max(worst, mean) > tolerance:
            warnings.warn(
                f"the samples have not converged in refine_passes={refine_passes} conjugate-gradient passes: "
                f"a draw may be up to {worst:.2g} posterior sds off its exact value along some direction, the mean "
                f"{mean:.2g} (tolerance={tolerance:g}; sample_stats['cg_error']). {remedy}",
                stacklevel=user_stacklevel(),
            )
        return
    if "error_in_sds" in stats:
        worst = float(stats["error_in_sds"].median())
        if worst > 0.1:
            warnings.warn(
                f"the samples have not converged: a draw is off by about {worst:.2g} posterior sds (RMS over the "
                "coordinates, median over the draws; sample_stats['error_in_sds']). Raise refine_passes or "
                "num_epochs (or em_epochs), or use variance_reduction='all'.",
                stacklevel=user_stacklevel(),
            )
        return
    worst = float(stats["relative_grad_norm"].median())
    if worst > 0.1:
        warnings.warn(
            f"the samples have not converged: the median relative gradient norm (full data) is {worst:.2g}. Raise "
            "refine_passes or num_epochs (or em_epochs), or use variance_reduction='all'; see "
            "sample_stats['relative_grad_norm'].",
            stacklevel=user_stacklevel(),
        )
