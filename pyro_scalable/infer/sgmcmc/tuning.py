r"""Warm-up's choices, one rule per kind of kernel: the step size, friction, mass and metric from curvature and noise.

:class:`~.adaptation.Adaptation` measures the curvature :math:`\lambda` (in the sampler's metric) and the moving
average :math:`\bar V` of the gradient noise; a rule turns them into hyperparameters. With :math:`\rho = 1/2` the
largest share of the wanted noise the gradient noise may supply, and :math:`T` the temperature (0 in burn-in,
which switches the noise bounds off):

* ``"langevin"`` (SGLD): :math:`\epsilon = \min(0.1/\lambda,\ \rho\,2T/\max_j \bar V_j)`.
* ``"preconditioned"`` (pSGLD): the same in the metric :math:`G`, :math:`\max_j G_j\bar V_j`; with
  ``preconditioner="warmup"`` the calibrated warm-up steps also learn :math:`v` (restarted at the first one's
  :math:`\hat g^2`), and the first curvature measured in that metric restarts the curvature average.
* ``"momentum"`` (SGHMC): :math:`\epsilon \le 0.3/\sqrt\lambda` and a friction per coordinate
  (:func:`coordinate_frictions`; a given friction bounds :math:`\epsilon` instead, :func:`momentum_step_size`);
  ``mass="fisher"`` learns the diagonal Fisher mass (:func:`fisher_mass`).
* ``"thermostat"`` (SGNHT): SGHMC's rule at unit mass, and the thermostat held at the friction.
* ``"baoab"``: :math:`\epsilon \le 0.5/\sqrt\lambda` and a kick noise at most :math:`\rho` of O's
  (:func:`baoab_step_size`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pyro_scalable.infer.gradients import GradientEstimate
from pyro_scalable.infer.sgmcmc.base import CURVATURE_EVERY, NOISE_FRACTION, Latents
from pyro_scalable.infer.sgmcmc.mass import mass_like

__all__ = [
    "NOISE_FRACTION",
    "RULES",
    "baoab_step_size",
    "coordinate_frictions",
    "fisher_mass",
    "momentum_step_size",
    "noise_bound",
]

LANGEVIN_BOUND = 0.1  # ε λ_max for SGLD and pSGLD (a stationary-variance bias of at most 5%)
MOMENTUM_BOUND = 0.3  # ε √λ_max for SGHMC and SGNHT (about 2%)
BAOAB_BOUND = 0.5  # ε √λ_max for BAOAB (stability needs < 2; θ is exact on a Gaussian below that)
_LEAST_DECAY = 0.5  # a momentum sampler's per-step decay stays at or above this where warm-up chooses the friction
_DEFAULT_DECAY = 0.9  # the decay chosen where the gradient noise does not ask for more (SGD's momentum 0.9)
_LEAST_MASS = 1e-3  # a Fisher mass is floored at this share of its mean


def noise_bound(noise: Latents, metric: Latents | None, target: Tensor) -> Tensor:
    """The largest ε with ε · S_j · V_j ≤ ρ · ``target`` in every coordinate (inf where there is no noise)."""
    scaled = [(v * metric[name] if metric is not None else v).max() for name, v in noise.items()]
    largest = torch.stack(scaled).max()
    return torch.where(largest > 0, NOISE_FRACTION * target / largest, torch.full_like(largest, math.inf))


def momentum_step_size(
    curvature: Tensor, noise: Latents, friction: float | None, temperature: Tensor, masses: Latents | None, bound: float
) -> tuple[Tensor, Tensor]:
    """ε (and the friction α where not given) for a momentum sampler with injected noise 2αεT (SGHMC, SGNHT).

    ε ≤ ``bound``/√λ; the gradient noise must stay within ρ of 2αεT, i.e. α ≥ ε V̄ₘₐₓ / (2Tρ); with
    ``friction=None`` α is the larger of that and a per-step decay of 0.9, and ε small enough that α leaves a decay
    of at least 0.5 in every coordinate; a given friction instead bounds ε. ``masses=None`` is the unit mass.
    """
    step_size = bound / torch.sqrt(curvature)
    if masses is None:
        least_mass = mean_mass = torch.ones_like(step_size)
    else:
        least_mass = torch.stack([m.min() for m in masses.values()]).min()
        mean_mass = torch.cat([m.reshape(-1) for m in masses.values()]).mean()
    largest_noise = torch.stack([v.max() for v in noise.values()]).max()
    noise_rate = largest_noise / (2.0 * temperature * NOISE_FRACTION)  # α must be at least ε times this
    noise_rate = torch.where(temperature > 0, noise_rate, torch.zeros_like(noise_rate))
    if friction is None:
        step_size = torch.minimum(step_size, torch.sqrt((1.0 - _LEAST_DECAY) * least_mass / noise_rate))
        chosen = torch.maximum(step_size * noise_rate, (1.0 - _DEFAULT_DECAY) * mean_mass / step_size)
        chosen = torch.minimum(chosen, (1.0 - _LEAST_DECAY) * least_mass / step_size)
        return step_size, chosen
    given = torch.full_like(step_size, float(friction))
    step_size = torch.minimum(step_size, given / noise_rate)
    return torch.minimum(step_size, (1.0 - _LEAST_DECAY) * least_mass / given), given


def coordinate_frictions(
    curvature: Tensor, noise: Latents, temperature: Tensor, masses: Latents, bound: float
) -> tuple[Tensor, Latents]:
    """ε and a friction per coordinate for SGHMC with ``friction=None`` (any positive diagonal friction keeps the law).

    Each coordinate's friction is the least that keeps its gradient noise within ρ of the injected noise, at least
    a per-step decay of 0.9 and at most one of 0.5: α_j = min(max(ε V̄_j / (2Tρ), 0.1 m_j/ε), 0.5 m_j/ε), with
    ε ≤ ``bound``/√λ and small enough that every coordinate's noise fits under the cap, ε² ≤ 0.5 m_j 2Tρ / V̄_j.
    A scalar friction at the largest coordinate's need (:func:`momentum_step_size`) would damp every other
    direction as hard (in a non-centred hierarchy the group scale's gradient noise asks for several times the
    friction the other coordinates need).

    Example:
        >>> import torch
        >>> one = torch.tensor(1.0)  # curvature, temperature and unit masses
        >>> noise = {"tau": torch.tensor([24.0]), "z": torch.tensor([2.0, 0.5])}
        >>> step_size, frictions = coordinate_frictions(one, noise, one, {"tau": one, "z": one}, bound=0.3)
        >>> round(float(step_size), 4), frictions["tau"].round(decimals=2), frictions["z"].round(decimals=2)
        (0.1443, tensor([3.4600]), tensor([0.6900, 0.6900]))

    """
    step_size = bound / torch.sqrt(curvature)
    # α_j must be at least ε times rate_j (no bound in burn-in, T = 0)
    per_noise = torch.where(temperature > 0, 1.0 / (2.0 * NOISE_FRACTION * temperature), 0.0)
    rates = {name: noise[name] * per_noise for name in masses}
    # ε² ≤ 0.5 m_j / rate_j in the tightest coordinate (no bound where there is no noise)
    room = torch.stack([(rates[name] / m).max() for name, m in masses.items()]).max()
    bounded = torch.sqrt((1.0 - _LEAST_DECAY) / torch.where(room > 0, room, 1.0))
    step_size = torch.where(room > 0, torch.minimum(step_size, bounded), step_size)
    frictions = {}
    for name, m in masses.items():
        chosen = torch.maximum(step_size * rates[name], (1.0 - _DEFAULT_DECAY) * m / step_size)
        frictions[name] = torch.minimum(chosen, (1.0 - _LEAST_DECAY) * m / step_size)
    return step_size, frictions


def baoab_step_size(
    curvature: Tensor, noise: Latents, masses: Latents, friction: float | None, temperature: Tensor
) -> tuple[Tensor, Tensor]:
    """BAOAB's ε (and friction γ, where not given) from the curvature and the gradient noise.

    One friction for all coordinates, at the noisiest one's need: with a friction per coordinate (each O decay the
    largest its own noise allows) every noisy coordinate sits at its noise bound, and a several times larger share
    of coordinates goes uncorrected for a small gain in ESS.
    """
    step_size = BAOAB_BOUND / torch.sqrt(curvature)
    # r = max_j V_j / m_j: the kicks' noise in the momentum's own units
    r = torch.stack([(v / masses[name]).max() for name, v in noise.items()]).max()
    budget = NOISE_FRACTION * temperature  # the kicks' noise may be at most ρ (1 - c²) T m
    noisy = (r > 0) & (temperature > 0)
    safe_r = torch.where(noisy, r, torch.ones_like(r))
    if friction is None:
        # c² ε² r ≤ ρ (1 - c²) T needs, at c = _LEAST_DECAY, ε² r ≤ ρ T (1 - c²) / c²
        least = _LEAST_DECAY**2
        step_size = torch.where(
            noisy, torch.minimum(step_size, torch.sqrt(budget * (1 - least) / least / safe_r)), step_size
        )
        decay = torch.sqrt(budget / (budget + step_size**2 * safe_r))
        decay = torch.where(noisy, torch.clamp(decay, max=_DEFAULT_DECAY), torch.full_like(decay, _DEFAULT_DECAY))
        return step_size, -torch.log(decay) / step_size
    given = torch.full_like(step_size, float(friction))
    # ε r (1 + 2γε) ≤ 2ργT, sufficient since 1 - c² ≥ 2γε / (1 + 2γε); the positive root, rationalised
    root = 4.0 * given * budget / (safe_r + torch.sqrt(safe_r**2 + 16.0 * given**2 * safe_r * budget))
    return torch.where(noisy, torch.minimum(step_size, root), step_size), given


def fisher_mass(noise: Latents) -> Latents:
    """The diagonal Fisher up to a constant (the gradient-noise variance), normalised to mean 1 and floored."""
    flat = torch.cat([v.reshape(-1) for v in noise.values()])
    mean = flat.mean()
    scale = torch.where(mean > 0, mean, torch.ones_like(mean))
    return {name: torch.clamp(v / scale, min=_LEAST_MASS) for name, v in noise.items()}


class Rule:
    """How warm-up tunes one kind of kernel: what it chooses, in which metric it measures, and how it chooses.

    ``order``: the power of the curvature in the step's stability bound (ε ∝ λ^(-1/order)): 1 for Langevin
    samplers, 2 for momentum samplers. Warm-up halves a step after a divergence by multiplying the curvature the rule
    sees by 2^order.
    """

    order = 2
    chooses = ("step_size",)  # the kernel's hyperparameters this rule may choose (where the kernel leaves them)
    kernel_reads: tuple[str, ...] = ()  # the kernel's attributes it reads beyond program.KernelContract
    state_reads: tuple[str, ...] = ()  # the State's fields it reads beyond program.ChainState

    def start(self, kernel: Any, latents: Latents) -> dict[str, Any]:
        """The hyperparameters to choose, before warm-up has seen anything (NaN; the Fisher mass: 1)."""
        first = next(iter(latents.values()))
        nan = torch.full((), math.nan, dtype=first.dtype, device=first.device)
        tuned = {}
        if kernel.step_size is None:
            tuned["step_size"] = nan
        if "friction" in self.chooses and kernel.friction is None:
            tuned["friction"] = nan.clone()
        if "mass" in self.chooses and kernel.mass == "fisher":
            tuned["mass"] = {name: torch.ones_like(x) for name, x in latents.items()}
        return tuned

    def metric(self, kernel: Any, kernel_state: Any, tuned: dict[str, Any]) -> Latents | None:
        """S, the metric the curvature is measured in (``None``: the identity)."""
        return None

    def tune(self, kernel: Any, state: Any, gradient: GradientEstimate, temperature: Tensor, burn_in: bool):
        """The hyperparameters chosen so far, warm-up's state, and this step's extra arguments of the kernel's update.

        A rule reads the kernel's State and never edits it: what warm-up needs the update to do differently on this
        step (hold pSGLD's v learning, SGNHT's thermostat) goes to ``update`` as an argument.
        """
        raise NotImplementedError


class Langevin(Rule):
    """SGLD: ε = min(0.1/λ, ρ 2T / max V̄) (the noise bound only after burn-in)."""

    order = 1

    def tune(self, kernel, state, gradient, temperature, burn_in):
        tuned = dict(state.tuned)
        chosen = LANGEVIN_BOUND / state.curvature
        if not burn_in:
            chosen = torch.minimum(chosen, noise_bound(state.estimator.noise, None, 2.0 * temperature))
        tuned["step_size"] = chosen
        return tuned, state, {}


class Preconditioned(Rule):
    """pSGLD: learn v in the calibrated warm-up (``preconditioner="warmup"``), then SGLD's rule in the metric G."""

    order = 1
    kernel_reads = ("preconditioner", "metric")
    state_reads = ("square_count",)

    def metric(self, kernel, kernel_state, tuned):
        return kernel.metric(kernel_state)

    def tune(self, kernel, state, gradient, temperature, burn_in):
        tuned = dict(state.tuned)
        learning = kernel.preconditioner == "warmup" and not burn_in
        extra = {"updates": "learn"} if learning else {}  # the update folds this gradient into v, from its start
        updates_before = state.kernel.square_count  # v's updates when this step's estimate ran (its metric)
        if "step_size" not in tuned:
            return tuned, state, extra
        if learning and gradient.hessian_product:
            # the first product measured in the learnt metric (v had 1 to CURVATURE_EVERY updates when this step's
            # estimate ran: one measurement falls there) restarts the curvature average: the burn-in's, in the
            # identity metric, would hold the step size down
            measured = torch.sqrt(sum(v.square().sum() for v in gradient.hessian_product.values()))
            first = (updates_before >= 1) & (updates_before <= CURVATURE_EVERY)
            restart = first & torch.isfinite(measured) & ~gradient.diverging
            state = state._replace(curvature=torch.where(restart, measured, state.curvature))
        chosen = LANGEVIN_BOUND / state.curvature
        if not burn_in:
            # the metric this step moves in: "always" and warm-up's learning fold this gradient into v in the update
            folds = learning or kernel.preconditioner == "always"
            metric = kernel.metric(state.kernel, gradient if folds else None, restart=learning)
            chosen = torch.minimum(chosen, noise_bound(state.estimator.noise, metric, 2.0 * temperature))
        tuned["step_size"] = chosen
        return tuned, state, extra


class MassRule(Rule):
    """A rule for a kernel with a mass (SGHMC, BAOAB): the curvature measured in the metric 1/m."""

    kernel_reads = ("friction", "mass")

    def metric(self, kernel, kernel_state, tuned):
        return {name: 1.0 / m for name, m in self.masses(kernel, kernel_state, tuned).items()}

    @staticmethod
    def masses(kernel: Any, kernel_state: Any, tuned: dict[str, Any]) -> Latents:
        """The masses: chosen in warm-up (the Fisher mass), or the kernel's own."""
        return tuned["mass"] if "mass" in tuned else mass_like(kernel.mass, kernel_state.latents)


class Momentum(MassRule):
    """SGHMC: ε ≤ 0.3/√λ, a friction per coordinate where not given, and the Fisher mass where asked for."""

    chooses = ("step_size", "friction", "mass")

    def start(self, kernel, latents):
        tuned = super().start(kernel, latents)
        if "friction" in tuned:  # one per coordinate (:func:`coordinate_frictions`)
            tuned["friction"] = {name: torch.full_like(x, math.nan) for name, x in latents.items()}
        return tuned

    def tune(self, kernel, state, gradient, temperature, burn_in):
        tuned = dict(state.tuned)
        if "mass" in tuned:
            tuned["mass"] = fisher_mass(state.estimator.noise)
        if "step_size" in tuned:
            masses = self.masses(kernel, state.kernel, tuned)
            temperature = torch.zeros_like(temperature) if burn_in else temperature
            if "friction" in tuned:
                step_size, tuned["friction"] = coordinate_frictions(
                    state.curvature, state.estimator.noise, temperature, masses, MOMENTUM_BOUND
                )
            else:
                step_size, _ = momentum_step_size(
                    state.curvature, state.estimator.noise, kernel.friction, temperature, masses, MOMENTUM_BOUND
                )
            tuned["step_size"] = step_size
        return tuned, state, {}


class Thermostat(Rule):
    """SGNHT: SGHMC's rule at unit mass; warm-up holds the thermostat at the friction (see :mod:`.sgnht`)."""

    chooses = ("step_size", "friction")
    kernel_reads = ("friction",)

    def tune(self, kernel, state, gradient, temperature, burn_in):
        tuned = dict(state.tuned)
        temperature = torch.zeros_like(temperature) if burn_in else temperature
        step_size, friction = momentum_step_size(
            state.curvature, state.estimator.noise, kernel.friction, temperature, None, MOMENTUM_BOUND
        )
        tuned["step_size"] = step_size
        if "friction" in tuned:
            tuned["friction"] = friction
        return tuned, state, {"thermostat": friction}  # held at the friction for this step


class BAOABRule(MassRule):
    """BAOAB: ε ≤ 0.5/√λ and the friction where not given (:func:`baoab_step_size`)."""

    chooses = ("step_size", "friction")

    def tune(self, kernel, state, gradient, temperature, burn_in):
        tuned = dict(state.tuned)
        masses = self.masses(kernel, state.kernel, tuned)
        temperature = torch.zeros_like(temperature) if burn_in else temperature
        step_size, friction = baoab_step_size(
            state.curvature, state.estimator.noise, masses, kernel.friction, temperature
        )
        tuned["step_size"] = step_size
        if "friction" in tuned:
            tuned["friction"] = friction
        return tuned, state, {}


RULES = {
    "langevin": Langevin(),
    "preconditioned": Preconditioned(),
    "momentum": Momentum(),
    "thermostat": Thermostat(),
    "baoab": BAOABRule(),
}
