"""An engine's Pyro-facing class: the model, the bound hyperparameters, and the moves of one chain.

:class:`Kernel` implements :class:`~.program.KernelContract` from a kernel module's ``init`` and ``update``
(``build``: the module's ``build(**hyperparameters) -> Transform(init, update)``) and the keyword arguments its
``update`` takes from the class (``hyperparameters()``).
It validates and keeps what every engine has (the model, step size, temperature, gradient-noise mode, control
variate, init strategy); a subclass adds its own hyperparameters. :class:`MomentumKernel` is a kernel whose State
carries ``momenta``: a chain that warm-up moves starts again from rest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from pyro_scalable.bridge.model import FullDataModel, Latents
from pyro_scalable.bridge.traced import under_transform
from pyro_scalable.infer.gradients import GradientEstimate
from pyro_scalable.infer.schedules import ScalarOrSchedule, check_positive
from pyro_scalable.infer.sgmcmc.base import check_gradient_noise
from pyro_scalable.infer.sgmcmc.control_variates import check_control_variate
from pyro_scalable.infer.sgmcmc.kept import KeptDraws, Thinning

__all__ = ["Kernel", "MomentumKernel", "RunConstants"]


class Kernel:
    """The model, the bound hyperparameters, and the calls warm-up and sampling make on one chain.

    ``build`` is the kernel module's ``build(**hyperparameters) -> Transform(init, update)``
    (:func:`~.base.builder`); ``hyperparameters()`` the keyword arguments it binds from the class. Where warm-up
    chooses something, ``adapts`` is true and
    ``warmup_rule`` names the rule (:mod:`.tuning`); the hyperparameters it chose reach :meth:`update` as keyword
    arguments (per-chain tensors) in place of the bound ones. The gradient arrives estimated, with the moving
    average of its noise (:mod:`.adaptation`): a kernel only moves the chain.
    """

    gradient_noise = "ignore"
    control_variate = None  # see :mod:`.control_variates`
    step_size: Any = None
    warmup_rule: str | None = None  # a subclass that warm-up tunes names its rule in tuning.RULES

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule | None,
        temperature: ScalarOrSchedule,
        gradient_noise: str | None,
        control_variate: Any,
        init_strategy: Callable,
    ):
        if step_size is not None:
            check_positive("step_size", step_size)
        check_positive("temperature", temperature, allow_zero=True)
        self.model = FullDataModel(model)  # subsampling switched off: what Predictive and ArviZ should run
        self.step_size = step_size
        self.temperature = temperature
        self.gradient_noise = check_gradient_noise(gradient_noise, step_size)
        self.control_variate = check_control_variate(control_variate)
        self.init_strategy = init_strategy

    @property
    def adapts(self) -> bool:
        """Whether warm-up chooses something (the step size, where it is left to warm-up)."""
        return self.step_size is None

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of the module's ``update`` that this class binds."""
        raise NotImplementedError

    def init(self, latents: Latents) -> Any:
        """Start a chain at unconstrained ``latents``."""
        return type(self).build(**self.hyperparameters()).init(latents)

    def update(self, state: Any, gradient: GradientEstimate, generator=None, **tuned: Any) -> tuple[Any, Any]:
        """One update with this kernel's hyperparameters (``tuned``: those chosen in warm-up), given the gradient."""
        return type(self).build(**self.hyperparameters()).update(state, gradient, generator, **tuned)

    @staticmethod
    def latents(state: Any) -> Latents:
        """The chain's draw: its last point with a finite log density and gradient."""
        return state.checked_latents

    def with_gradient_noise(self, gradient_noise: str) -> Kernel:
        """A copy of this kernel whose update treats the gradient noise as ``gradient_noise`` says (a probe's)."""
        changed = copy.copy(self)
        changed.gradient_noise = check_gradient_noise(gradient_noise, self.step_size)
        return changed

    def kept_draws(self, thin: int) -> KeptDraws:
        """Which steps after warm-up become draws: every ``thin``-th (:class:`~.kept.Thinning`)."""
        return Thinning(thin)

    @staticmethod
    def relocate(state: Any, centre: Latents, jump: Tensor) -> Any:
        """The chain moved to ``centre`` where ``jump`` (warm-up's end of burn-in; :func:`.adaptation.settle`)."""
        return state._replace(latents={name: torch.where(jump, centre[name], x) for name, x in state.latents.items()})

    def setup(self, *args: Any, **kwargs: Any) -> None:
        """Refuse ``pyro.infer.MCMC``, which calls this first: these kernels need a minibatch driver."""
        name = type(self).__name__
        raise TypeError(
            f"{name} is a stochastic-gradient kernel, which pyro.infer.MCMC cannot run (no accept step, minibatches); "
            f"use pyro_scalable.infer.StochasticMCMC({name}(...), num_samples=..., num_warmup=...).run(*args)."
        )

    def __repr__(self) -> str:
        settings = {**self.hyperparameters(), "gradient_noise": self.gradient_noise}
        shown = (f"{k}={'{...}' if isinstance(v, dict) else repr(v)}" for k, v in settings.items())
        return f"{type(self).__name__}({', '.join(shown)})"


class MomentumKernel(Kernel):
    """A kernel whose State carries ``momenta``: a chain warm-up moves starts again from rest."""

    @staticmethod
    def check_friction(friction: float | None, step_size: Any, least_mass: float | None) -> float | None:
        """The friction to keep: 1.0 where the step size is given and the friction is not; validated.

        With ``least_mass``, an Euler momentum update's decay ``1 - step_size * friction / mass`` must stay
        positive (schedules start at their largest step).
        """
        if step_size is not None and friction is None:
            friction = 1.0
        if friction is None:
            return None
        check_positive("friction", friction)
        if step_size is not None and least_mass is not None:
            largest = float(step_size(torch.zeros(())) if callable(step_size) else step_size)
            if largest * friction / least_mass >= 1.0:
                raise ValueError(
                    f"step_size * friction / mass must be below 1 (got {largest * friction / least_mass:.3g}): "
                    "the momentum would change sign every step. Lower the step size or the friction."
                )
        return friction

    @staticmethod
    def relocate(state: Any, centre: Latents, jump: Tensor) -> Any:
        """The chain moved to ``centre`` where ``jump``, its momenta zeroed there."""
        moved = Kernel.relocate(state, centre, jump)
        rest = {name: torch.where(jump, p.new_zeros(()), p) for name, p in moved.momenta.items()}
        return moved._replace(momenta=rest)


class RunConstants:
    """A kernel's coefficients as a function of its hyperparameters, computed once while those stay the same objects.

    ``function(latents, *hyperparameters)``'s result (the decay, the injected noise's scale, ...) depends on the
    latents' shapes only, and on hyperparameters that are the same objects from step to step where they are constant
    (a shared 0-d :func:`~pyro_scalable.infer.schedules.constant`, warm-up's choice, the noise average between two
    measurements): recomputing them would dispatch a few operations per step, a noticeable share of a small model's
    step. The result is the one ``function`` computed, read, never written to. Tensors are compared by identity (and
    in-place version), the rest by equality; under ``torch.func`` transforms (vmap's tensors are new on every call)
    and compiling, ``function`` is called every time.
    """

    def __init__(self, function: Callable, size: int = 16):
        self.function, self.size = function, size
        self._kept: dict[tuple, tuple] = {}

    def __call__(self, latents: Latents, *hyperparameters: Any) -> Any:
        if under_transform(next(iter(latents.values()))) or torch.is_inference_mode_enabled():  # also compiling
            return self.function(latents, *hyperparameters)
        key, held = [(name, x.shape, x.dtype, x.device) for name, x in latents.items()], []
        for value in hyperparameters:
            for name, x in value.items() if isinstance(value, dict) else ((None, value),):
                if isinstance(x, Tensor):
                    key.append((name, id(x), x._version))
                    held.append(x)
                else:
                    key.append((name, x))
        key = tuple(key)
        try:
            kept = self._kept.get(key)
        except TypeError:  # an argument that cannot be hashed (a list, an array): computed every time
            return self.function(latents, *hyperparameters)
        if kept is not None and all(a is b for a, b in zip(kept[0], held, strict=True)):
            return kept[1]
        result = self.function(latents, *hyperparameters)
        if len(self._kept) >= self.size:  # a fresh memory (one assignment: safe where threads step chains)
            self._kept = {}
        self._kept[key] = (held, result)
        return result
