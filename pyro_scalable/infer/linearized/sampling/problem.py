r"""One run's quadratic for sample-then-optimise: data pass, regulariser centres, solves, diagnostics.

Around :math:`\theta_*` the linearised model has the posterior precision :math:`H = M + A`, :math:`M = \sum_i
J_i^\top\Lambda_i J_i`. Every sample row :math:`k` minimises the convex quadratic of :mod:`.core` with the
regulariser centre :math:`\theta^n_k` (:mod:`.centres`), so that its solution :math:`\zeta_k \sim \mathcal N(0,
H^{-1})`; the last row solves :math:`H\bar\delta = b - A(\theta_* - m)` with the centre :math:`A^{-1}b - (\theta_* -
m)`, the mean's step from :math:`\theta_*`. :class:`Problem` holds what these rows share (the prior, the data's
curvature by products, the preconditioner) and runs one solve of them: minibatch epochs, then conjugate gradients
(:mod:`.krylov`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pyro_scalable.arguments import check_tensor
from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.bridge.model import Batch
from pyro_scalable.infer.linearized.ggn import GGNDiagonal, ggn_pass
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.linearized.sampling import centres, core, krylov
from pyro_scalable.infer.linearized.sampling.em import linearized_sum_squares, mackay_noise_update
from pyro_scalable.infer.linearized.sampling.plan import OneProcess, SolveSettings, local_batch

__all__ = ["Finished", "Problem", "SolveDiverged"]


class SolveDiverged(RuntimeError):
    """The minibatch optimisation diverged; ``state`` is the solver's state before the step that did."""

    def __init__(self, message: str, state: core.SampleState):
        super().__init__(message)
        self.state = state


class Finished(NamedTuple):
    """A solve's full-data diagnostics (:meth:`Problem.finish`): what the EM step and the run's record read."""

    offset: Tensor  # the mean the draws are centred at minus the prior mean, θ̄ − m
    samples: Tensor  # (K, d): the zero-mean rows ζ_k
    products: Tensor  # (K + 1, d): M times every row
    stats: dict[str, Tensor]  # per draw: the diagnostics of krylov.row_diagnostics (and "cg_error" after CG)
    mean_error: float | None  # CG's estimate of the mean row's error in posterior sds (None without CG)
    mean_grad_norm: float  # the mean row's full-data gradient norm


class Problem:
    """One run's quadratic: the data pass, the regulariser centres, the solves and the full-data diagnostics.

    ``parallel`` (:class:`~.plan.OneProcess` or a distributed plan) says which sample rows and which share of each
    batch's points this rank holds; a one-process run holds them all.
    """

    def __init__(
        self,
        settings: SolveSettings,
        net: NetworkFunction,
        theta: Tensor,
        generator: torch.Generator,
        parallel: OneProcess | None = None,
        noise: Tensor | None = None,
        *,
        linear_gaussian: bool = False,
        noise_site: str | None = None,
    ):
        self.settings, self.net, self.theta = settings, net, theta
        self.linear_gaussian = linear_gaussian  # the model is its own linearisation, at any θ* (solve.check_map)
        self.noise_site = noise_site  # σ's latent site
        bridge = net.bridge
        self.num_samples = settings.num_samples
        self.parallel = parallel = OneProcess(settings.num_samples) if parallel is None else parallel
        precision, self.prior_mean = net.prior(theta)
        if settings.prior_precision is not None:
            check_tensor("prior_precision", settings.prior_precision, positive=True, shape=theta.shape)
            given = torch.as_tensor(settings.prior_precision, dtype=theta.dtype, device=theta.device)
            precision = torch.broadcast_to(given, theta.shape).clone()
        self._check_prior(precision)
        self.groups, self.group_names = net.layout.groups(settings.em_groups, theta.device)
        self.num_groups = len(self.group_names)
        counts = torch.bincount(self.groups, minlength=self.num_groups).to(theta.dtype)
        self.group_sizes = counts
        self.alpha = (
            torch.zeros(self.num_groups, dtype=theta.dtype, device=theta.device).index_add(0, self.groups, precision)
            / counts
        )
        # diag(M), exact: the g-prior's scales and the solver's diagonal preconditioner (core)
        need_diagonal = settings.g_prior or settings.preconditioner == "diagonal"
        self._data_diagonal = _ggn_diagonal(net, theta) if need_diagonal else None
        self.noise0 = noise  # a homoscedastic Normal's scale in the model at theta_* (the data pass's; update_noise)
        if settings.g_prior:
            diagonal = self._data_diagonal
            mean = torch.zeros_like(self.alpha).index_add(0, self.groups, diagonal) / counts
            self.scale = (diagonal / mean[self.groups]).clamp_min(1e-6)
        else:
            self.scale = precision / self.alpha[self.groups]
        self.anchored = 1 if settings.variance_reduction == "mean" else parallel.num_local + 1
        self.plate = next(iter(bridge.plates.values()), None)
        self.steps_per_epoch = 1 if self.plate is None else max(self.plate.size // self.plate.subsample_size, 1)
        self.data_scale = 1.0 if self.plate is None else self.plate.size / self.plate.subsample_size
        self.noise_state = generator.get_state()
        self.prior_noise_shape = (self.num_samples, theta.numel())
        torch.randn(self.prior_noise_shape, generator=generator, dtype=theta.dtype, device=theta.device)
        self.pass_state = generator.get_state()  # the perturbation pass's draws: replayed to rebuild its sum (targets)
        self._perturbation, self._gradient, self.quadratic = centres.data_pass(self, generator)
        self.last_solve = False  # set by the solve loop before its last solve (targets then drops the sum)
        self.trace: dict[str, list[Tensor]] = {}  # every epoch's minibatch objective and gradient norm per sample

    def _check_prior(self, precision: Tensor) -> None:
        bad = ~(torch.isfinite(precision) & (precision > 0))
        if bool(bad.any()):
            names = sorted({self.net.layout.site_of(int(i)) for i in bad.nonzero().flatten()[:100]})
            raise ModelError(
                f"the prior of site(s) {names} has no positive finite precision (a flat or improper prior); "
                "sample-then-optimise needs a proper Gaussian-like prior on every sampled site."
            )

    @property
    def precision(self) -> Tensor:
        return self.alpha[self.groups] * self.scale

    # the data terms at the current noise precision beta: M, b and B^{1/2} scale by beta / beta_0 (.em)
    def _noise_ratio(self) -> Tensor | float:
        return 1.0 if self.net.noise is None else (self.noise0 / self.net.noise) ** 2

    @property
    def data_diagonal(self) -> Tensor | None:
        return None if self._data_diagonal is None else self._data_diagonal * self._noise_ratio()

    @property
    def perturbation(self) -> Tensor:
        return self._perturbation if self.net.noise is None else self._perturbation * self._noise_ratio() ** 0.5

    @property
    def gradient(self) -> Tensor:
        return self._gradient * self._noise_ratio()

    def update_noise(self, gamma: Tensor, step: Tensor) -> Tensor:
        """MacKay's update of a homoscedastic Normal's scale from the linearised fit at the mean ``θ* + step``."""
        batches = [b for b in map(self.local, self.net.batches()) if b is not None]
        sums = self.parallel.sum_over_data(linearized_sum_squares(self.net, self.theta, step.detach(), batches))
        self.net.noise = mackay_noise_update(gamma.sum(), sums[0], sums[1]).to(self.theta.dtype)
        return self.net.noise

    def inverse_preconditioner(self) -> Tensor | None:
        """``P⁻¹ = 1 / (diag(M) + A)`` at the current prior (``None`` without preconditioning)."""
        if self.data_diagonal is None or self.settings.preconditioner is None:
            return None
        return 1.0 / (self.data_diagonal + self.precision)

    def _prior_noise(self, out: Tensor | None = None) -> Tensor:
        """The standard normal noise of this rank's rows of the K prior draws, the same at every call (into ``out``)."""
        generator = torch.Generator(device=self.theta.device)
        generator.set_state(self.noise_state)
        if out is not None and self.parallel.num_local == self.num_samples:  # drawn in place
            return torch.randn(self.prior_noise_shape, generator=generator, out=out)
        noise = torch.randn(
            self.prior_noise_shape, generator=generator, dtype=self.theta.dtype, device=self.theta.device
        )
        return noise[self.parallel.rows] if out is None else out.copy_(noise[self.parallel.rows])

    def targets(self, out: Tensor | None = None) -> Tensor:
        """Regulariser centres: θⁿ for every sample row, and the mean row's ``A⁻¹b − (θ* − m)`` (into ``out``).

        Every call gives the same numbers at the same prior. Once the perturbation sum is dropped (the last solve
        needs it for its centres only), a call rebuilds them with one more pass over the data from the same draws:
        :meth:`refine` keeps the right-hand side in the centres' buffer and rebuilds them after.
        """
        precision = self.precision
        theta = self.theta
        if out is None:
            out = torch.empty((self.parallel.num_local + 1, theta.numel()), dtype=theta.dtype, device=theta.device)
        if self._perturbation is None:
            centres.replay_pass(self, out)  # the sums in out's rows, the prior's draws apart: the same ops as below
            samples = self._prior_noise().div_(precision.sqrt())
            samples.addcdiv_(out[:-1].mul_(self._noise_ratio() ** 0.5), precision)
            out[:-1] = samples
            del samples
        else:
            samples = self._prior_noise(out=out[:-1]).div_(precision.sqrt())  # θ⁰, in place
            samples.addcdiv_(self.perturbation, precision)  # θⁿ (core.regularizer_targets, without a K x d temporary)
        if self.last_solve:  # no later solve needs the perturbation sum: K x d less from here on
            self._perturbation = None
        out[-1] = self.gradient / precision - (theta - self.prior_mean)
        return out

    # ------------------------------------------------------------------ passes over the data
    def local(self, batch: Batch) -> Batch | None:
        """The share of ``batch``'s points this rank holds (all of them on one process; ``None`` where none is left)."""
        return local_batch(batch, self.plate, self.parallel.share)

    def ggn_vp(self, vectors: Tensor, batch: Batch) -> Tensor:
        """``Σ_i J_iᵀ Λ_i J_i v`` over the minibatch, for every row of ``vectors``: one JVP and one VJP, batched."""
        local = self.local(batch)
        product = torch.zeros_like(vectors) if local is None else self.net.batch_ggn_vp(self.theta, vectors, local)
        return self.parallel.sum_over_data(product)

    def full_ggn_vp(self, vectors: Tensor) -> Tensor:
        """``M v`` on the full data (this rank's share), accumulated in place chunk by chunk."""
        out = torch.zeros_like(vectors)
        for chunk in self.net.batches():
            batch = self.local(chunk)
            if batch is not None:
                self.net.batch_ggn_vp(self.theta, vectors, batch, out=out)
        return self.parallel.sum_over_data(out)

    # ------------------------------------------------------------------ solving
    def _largest_eigenvalue(self, generator: torch.Generator, batches) -> float:
        """The largest eigenvalue of a minibatch's estimate of H, the largest over a few minibatches.

        With B < d a minibatch's estimate (N/B) Σ_B JᵀΛJ + A has a much larger top eigenvalue than H itself, and it
        is what a step must be stable for; power iterations that change minibatch at every product would converge
        to H's instead (too large a step, divergence).
        """
        vector = torch.randn(
            1, self.theta.numel(), generator=generator, dtype=self.theta.dtype, device=self.theta.device
        )
        precision, largest = self.precision, 0.0
        inverse = self.inverse_preconditioner()
        root = torch.ones_like(precision) if inverse is None else inverse.sqrt()  # P^{-1/2} H_B P^{-1/2}
        for _ in range(4):
            batch = next(batches)
            for _ in range(8):
                vector = vector / vector.norm()
                scaled = root * vector
                product = root * (self.data_scale * self.ggn_vp(scaled, batch).detach() + precision * scaled)
                estimate = float((vector * product).sum())
                vector = product
            largest = max(largest, estimate) if math.isfinite(estimate) else estimate
        if not math.isfinite(largest) or largest <= 0:
            raise ModelError(
                f"the curvature of the linearised model of '{self.net.site}' is not finite (estimate {largest}); "
                "check the inputs for non-finite values."
            )
        return largest

    def _batches(self, generator: torch.Generator, sampler: EpochSampler | None = None):
        bridge = self.net.bridge
        self.sampler = None
        if self.plate is None:
            while True:
                yield Batch({}, bridge.args, bridge.kwargs)
        self.sampler = sampler or EpochSampler({self.plate.name: self.plate}, 1, generator, bridge.device)
        for indices in self.sampler:
            yield Batch({k: v[0] for k, v in indices.items()}, bridge.args, bridge.kwargs)

    def solve(
        self,
        state: core.SampleState | None,
        epochs: int,
        generator: torch.Generator,
        bar,
        progress: dict[str, Any] | None = None,
        on_epoch=None,
    ) -> core.SampleState:
        """Run one solve of ``epochs`` epochs from ``state`` (``None``: the first solve).

        ``progress`` (from :mod:`.checkpoint`) resumes the solve where ``on_epoch(progress)`` last saw it: after
        every epoch it gets the step count ``t``, ``state``, ``step_size``, the first gradient norm and the
        minibatch sampler, everything the rest of the solve needs besides the generator.
        """
        settings = self.settings
        done, first = 0, None
        if progress is None:
            batches = self._batches(generator)
            step_size = settings.step_size
            if step_size is None:
                step_size = 0.5 / self._largest_eigenvalue(generator, batches)
        else:
            sampler = None
            if self.plate is not None:  # made before the generator is put back: making it draws a permutation
                sampler = EpochSampler({self.plate.name: self.plate}, 1, generator, self.net.bridge.device)
                sampler.load_state_dict(progress["sampler"])
            generator.set_state(progress["generator"])
            batches = self._batches(generator, sampler)
            done, first, step_size, state = progress["t"], progress["first"], progress["step_size"], progress["state"]
        targets = self.targets()
        if progress is None and state is None:
            # theta^0 (the mean row: theta_*) is close to the solution in every direction: the prior's where the
            # data say little, within O(A^{-1/2}) where the fast, data-dominated directions soon correct it; the
            # centre theta^n itself is O(sqrt(N)) away along those.
            start = torch.zeros_like(targets)
            self._prior_noise(out=start[:-1]).div_(self.precision.sqrt())
            state = core.init(targets, start)
            del start
        elif progress is None:
            state = state._replace(targets=targets)
        total = epochs * self.steps_per_epoch
        precision = self.precision
        inverse = self.inverse_preconditioner()
        trace = self.trace.setdefault("objective", []), self.trace.setdefault("grad_norm", [])
        for t in range(done, total):
            if t % self.steps_per_epoch == 0 and self.steps_per_epoch > 1:
                # re-anchor the control variate once per epoch: one full pass for the anchored rows
                anchor = state.samples[-self.anchored :].detach()  # with_anchor copies it below the samples
                state = core.with_anchor(state, anchor, self.full_ggn_vp(anchor))
                del anchor  # a view: it would keep the rows' first buffer (init's) alive

            def diverged(grad_norm: Tensor, t: int = t, before: core.SampleState = state) -> None:
                nonlocal first
                first = grad_norm.max() if t == 0 else first
                if not bool(torch.isfinite(grad_norm).all()) or bool(grad_norm.max() > 1e6 * first):
                    raise SolveDiverged(  # checked before the in-place update: `before` is the state as it was
                        f"the optimisation diverged at step {t} (the gradient norm grew from {float(first):.3g} to "
                        f"{float(grad_norm.max()):.3g}, or it is not finite) with step_size={step_size:.3g}; pass "
                        "a smaller step_size or max_grad_norm. The state before that step is kept in .state.",
                        before,
                    )

            end_of_epoch = (t + 1) % self.steps_per_epoch == 0
            state, info = core.step(
                state,
                next(batches),
                self.ggn_vp,
                prior_precision=precision,
                data_scale=self.data_scale,
                step_size=step_size * (1 - t / total),
                momentum=settings.momentum,
                max_grad_norm=settings.max_grad_norm,
                inverse_preconditioner=inverse,
                inplace=True,  # the state is this loop's own (a resumed one is loaded fresh)
                objective=end_of_epoch,
                check=diverged,
            )
            if end_of_epoch:
                trace[0].append(info.objective.detach().cpu())
                trace[1].append(info.grad_norm.detach().cpu())
            bar.update()
            if on_epoch is not None and (t + 1) % self.steps_per_epoch == 0:
                sampler = None if self.sampler is None else self.sampler.state_dict()
                on_epoch({"t": t + 1, "state": state, "step_size": step_size, "first": first, "sampler": sampler})
        return state

    def refine(
        self, state: core.SampleState, max_passes: int, tolerance: float, bar=None
    ) -> tuple[core.SampleState, krylov.RefineResult]:
        """Conjugate gradients on the full data from the rows ``state`` holds (:mod:`.krylov`).

        Returns the state with the refined rows, and CG's record (passes, each row's error estimate).
        """
        precision = self.precision

        def product(vectors: Tensor) -> Tensor:
            return self.full_ggn_vp(vectors).addcmul_(vectors, precision)  # (M + A) v with no K x d temporaries

        def on_pass(_: int) -> None:
            if bar is not None:
                bar.update(self.steps_per_epoch)

        # b = Aθⁿ in the centres' own buffer, where CG then keeps its residual; the centres are rebuilt after
        # (the same numbers; one more pass over the data in the last solve): CG holds 4 d per row, not 5
        buffer = state.targets
        result = krylov.conjugate_gradient(
            product,
            buffer.mul_(precision),
            state.samples.detach(),
            self.inverse_preconditioner(),
            max_passes=max_passes,
            tolerance=tolerance,
            on_pass=on_pass,
            overwrite=True,  # the rows and the right-hand side are this run's own
        )
        self.targets(out=buffer)
        if bar is not None and result.passes < max_passes:  # stopped early: the passes it did not need
            bar.total -= (max_passes - result.passes) * self.steps_per_epoch
            bar.refresh()
        return state._replace(samples=result.rows), result

    def mean(self, state: core.SampleState) -> Tensor:
        """The flat mean the draws are centred at: the mean row's step from ``θ*`` for a Normal, else ``θ*``."""
        return self.theta + state.samples[-1].detach() if self.quadratic else self.theta

    def finish(self, state: core.SampleState, refinement: krylov.RefineResult | None = None) -> Finished:
        """Full-data diagnostics of every row (with ``refinement``, CG's error estimates of the last solve)."""
        rows = state.samples.detach()
        ggn = self.full_ggn_vp(rows)
        stats = krylov.row_diagnostics(rows, ggn, state.targets, self.precision, self.inverse_preconditioner())
        per_draw = {name: value[:-1] for name, value in stats.items()}
        mean_error = None
        if refinement is not None:
            per_draw["cg_error"] = refinement.error[:-1]
            mean_error = float(refinement.error[-1])
        offset = self.mean(state) - self.prior_mean
        return Finished(offset, rows[:-1], ggn, per_draw, mean_error, float(stats["grad_norm"][-1]))


def _ggn_diagonal(net: NetworkFunction, theta: Tensor) -> Tensor:
    return ggn_pass(net, theta, GGNDiagonal(), gradient=False).curvature  # the diagonal alone
