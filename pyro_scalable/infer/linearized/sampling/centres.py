r"""The pass over the data behind the regulariser centres, and its replay.

One pass (one VJP per chunk for every row) gives the perturbation sums :math:`\sum_i J_i^\top \Lambda_i^{1/2}\xi_{ki}`
of the :math:`K` sample rows, :math:`\xi_{ki} \sim \mathcal N(0, I)` drawn in the pass, and the data's gradient
:math:`b = \sum_i J_i^\top \nabla_f \log p(y_i \mid f_i)` (the mean row). The centres
:math:`\theta^n_k = \theta^0_k + A^{-1}\sum_i J_i^\top \Lambda_i^{1/2}\xi_{ki}` follow with the prior draws
:math:`\theta^0_k` (:meth:`.problem.Problem.targets`).

The pass can be made again from the generator state it started from, with the same numbers. The last solve needs the
sums for its centres only; the conjugate-gradient refinement (:mod:`.krylov`) keeps its right-hand side
:math:`A\theta^n` in the centres' own buffer, and the centres are then rebuilt by replaying the pass: one more pass
over the data (about half a refinement iteration) for one fewer :math:`d`-vector per row during the refinement.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer.autodiff import row_slices

__all__ = ["check_finite", "data_pass", "replay_pass"]


def data_pass(problem: Any, generator: torch.Generator, into: Tensor | None = None) -> tuple[Tensor, Tensor, bool]:
    """The perturbation sums of this rank's sample rows, the data's gradient ``b``, and whether it is a Normal's.

    The third is true for a homoscedastic Normal likelihood, whose linearised model is exactly quadratic in θ.
    ``into`` is ``(rows + 1, d)``: the sums in its first rows, ``b`` in its last; the sums are a view of it, ``b``
    a copy.
    """
    net, theta, parallel, plate = problem.net, problem.theta, problem.parallel, problem.plate
    shape = (parallel.num_local + 1, theta.numel())
    sums = theta.new_zeros(shape) if into is None else into.zero_()
    trailing, quadratic = (), False
    for chunk in net.batches():
        # xi is drawn for every row and every point of the chunk, whatever this rank keeps of it, so that the
        # ranks' draws together are one process's
        points = chunk.indices[plate.name].shape[-1] if plate is not None else None
        batch = problem.local(chunk)
        if batch is None:  # a last chunk with fewer points than ranks (every earlier chunk set `trailing`)
            torch.randn(
                (problem.num_samples, points, *trailing), generator=generator, dtype=theta.dtype, device=theta.device
            )
            continue
        out = net.outputs(theta, batch)
        quadratic = out.likelihood.name == "Normal" and not net.heteroscedastic
        f = out.f.detach()
        check_finite(f, net.site, "outputs at the linearisation point")
        root = out.likelihood.hessian_sqrt(f)
        leaf = f.clone().requires_grad_(True)
        (score,) = torch.autograd.grad(out.likelihood.log_prob(leaf, out.value), leaf)
        trailing = root.shape[2:]
        xi = torch.randn(
            (problem.num_samples, root.shape[0] if points is None else points) + trailing,
            generator=generator,
            dtype=f.dtype,
            device=f.device,
        )[parallel.rows, parallel.share]
        cotangents = torch.cat([torch.einsum("pmr,kpr->kpm", root, xi), score.unsqueeze(0)])
        net.vjp(theta, cotangents, batch, out=sums)  # added in place, a group of rows at a time
    total = parallel.sum_over_data(sums)
    if total is not sums:  # an all-reduce's copy
        sums = total if into is None else into.copy_(total)
    check_finite(sums, net.site, "Jacobian-vector products")
    return sums[:-1], sums[-1].clone(), quadratic  # apart: the sums alone may be dropped (Problem.targets)


def replay_pass(problem: Any, into: Tensor) -> None:
    """:func:`data_pass` again from the state its generator started at (``problem.pass_state``), into ``into``.

    At the first pass's noise scale (with ``em_noise`` the problem scales the sums to the current one).
    """
    generator = torch.Generator(device=problem.theta.device)
    generator.set_state(problem.pass_state)
    net = problem.net
    noise, net.noise = net.noise, None
    try:
        data_pass(problem, generator, into)
    finally:
        net.noise = noise


def check_finite(value: Tensor, site: str, what: str) -> None:
    """Raise a ``ModelError`` naming observed ``site`` when ``value`` has a NaN or an infinity.

    A few rows at a time: ``torch.isfinite`` of a ``(K, d)`` tensor makes a float temporary of its size (``abs``)
    and two boolean ones (measured: 1.5 d per row at the perturbation pass's peak).

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.linearized.sampling.centres import check_finite
        >>> check_finite(torch.ones(3, 4), "y", "outputs")  # finite: nothing happens
        >>> check_finite(torch.tensor([[1.0, float("nan")]]), "y", "outputs")
        Traceback (most recent call last):
        ...
        pyro_scalable.bridge.checks.ModelError: the outputs of observed site 'y' are not finite; ...

    """
    rows = value.reshape(-1, value.shape[-1]) if value.dim() else value.reshape(1, 1)
    if not all(bool(torch.isfinite(rows[part]).all()) for part in row_slices(*rows.shape)):
        raise ModelError(
            f"the {what} of observed site '{site}' are not finite; check the model's inputs (features) for NaN or "
            "inf values, and the linearisation point."
        )
