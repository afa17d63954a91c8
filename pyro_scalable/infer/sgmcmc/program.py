"""The contracts: the chain stepper calls a :class:`Program`; a :class:`KernelContract` is what users pass.

Two classes implement :class:`Program`, each around a kernel: warm-up (:class:`~.adaptation.Adaptation`) and
sampling with the kernel's hyperparameters, or those warm-up chose (:class:`~.adaptation.Tuned`). Each step is handed
the :class:`~pyro_scalable.infer.gradients.GradientEstimator` of its density; a program keeps the estimator's state
with the chain's, has it estimate the gradient, and hands the estimate to the kernel's update: a kernel
(:class:`KernelContract`) only moves the chain.
The stepper (:mod:`.chains`) and the driver (:mod:`.mcmc`, :mod:`.phases`) call exactly these and probe for nothing;
``tests/infer/sgmcmc/test_conformance.py`` checks every registered kernel against them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pyro_scalable.bridge.model import Latents
from pyro_scalable.infer.gradients import GradientEstimate
from pyro_scalable.infer.gradients.estimator import GradientEstimator
from pyro_scalable.infer.sgmcmc.base import SAMPLING, Phase

__all__ = ["ChainState", "KernelContract", "Program"]


@runtime_checkable
class Program(Protocol):
    """What steps a chain: its state from a start, each step's phase, the gradient estimate, the update."""

    estimator: GradientEstimator  # the kind of estimator its steps take (its init starts a chain's estimator state)

    def init(self, latents: Latents) -> Any:
        """A chain's state at unconstrained ``latents``."""

    def phase(self, step_index: int) -> Phase:
        """What step ``step_index`` does besides the update (noise measured, power iterations, burn-in)."""

    def estimate(
        self, state: Any, batch: Any, estimator: GradientEstimator, phase: Phase = SAMPLING, direction=None
    ) -> GradientEstimate:
        """The gradient (and what the update needs with it) on ``batch``."""

    def chains_estimate(
        self, state: Any, batch: Any, estimator: GradientEstimator, phase: Phase = SAMPLING
    ) -> GradientEstimate:
        """:meth:`estimate` for every chain at once (the chains' stacked state), outside vmap: plain autograd."""

    def update(
        self, state: Any, gradient: GradientEstimate, estimator: GradientEstimator, generator=None, phase=SAMPLING
    ):
        """The new state (the estimate folded into the estimator's) and the step's Info, given the gradient."""

    def step(self, state: Any, batch: Any, estimator: GradientEstimator, generator=None, phase=SAMPLING):
        """:meth:`update` after :meth:`estimate`."""

    def latents(self, state: Any) -> Latents:
        """The chain's draw: its last point with a finite log density and gradient."""

    def finish(self, state: Any) -> Any:
        """The state sampling goes on with at the end of warm-up (the state itself where there is no warm-up)."""

    @property
    def sampler(self) -> Program:
        """The program that steps after warm-up (this one where there is no warm-up to unwrap)."""


@runtime_checkable
class ChainState(Protocol):
    """What every kernel's State has, and all of it that the driver and warm-up read."""

    latents: Latents  # the chain's position
    checked_latents: Latents  # the last point with a finite log density and gradient: the draw
    step_count: Any  # 0-d int64: the kernel's steps (its schedules' argument)


@runtime_checkable
class KernelContract(Protocol):
    """A kernel as ``StochasticMCMC`` takes it: a Pyro model, hyperparameters, and the moves of one chain.

    ``init(latents)`` starts a chain's State; ``update(state, gradient, generator, **tuned)`` moves it given a
    gradient estimated outside it (its ``noise_variance`` the moving average where the kernel uses the noise);
    ``latents(state)`` is the draw; ``relocate(state, centre, jump)`` moves a chain (warm-up's end of burn-in).
    ``adapts``: warm-up chooses its step size (``step_size`` is then ``None``) or metric by ``warmup_rule``
    (:data:`.tuning.RULES`);
    ``gradient_noise``: ``"correct"``, ``"estimate"`` or ``"ignore"``; ``control_variate``: the control-variate
    setting (:mod:`.control_variates`; ``None``: none); ``temperature``: a constant or a schedule;
    ``kept_draws(thin)``: which steps after warm-up become draws (:mod:`.kept`); ``hyperparameters()``: the
    keyword arguments ``update`` takes from the kernel (a probe of the ignored gradient noise reads them).

    A warm-up rule (:class:`~.tuning.Rule`) reads the attributes its ``kernel_reads`` names of the kernels it tunes
    (SGHMC's ``friction`` and ``mass``, pSGLD's ``preconditioner`` and ``metric``), and of their State the
    :class:`ChainState` fields and its ``state_reads``; nothing else outside a kernel reads a kernel or its State
    (``tests/infer/sgmcmc/test_contract.py`` checks both).
    """

    model: Any
    init_strategy: Any
    step_size: Any  # None where warm-up chooses it
    adapts: bool
    gradient_noise: str
    control_variate: Any
    temperature: Any
    warmup_rule: str | None  # the name of its rule in tuning.RULES (None: nothing to tune)

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of ``update`` the kernel binds."""

    def kept_draws(self, thin: int) -> Any:
        """The kept-draws policy (:class:`~.kept.KeptDraws`) at the driver's ``thin``."""

    def with_gradient_noise(self, gradient_noise: str) -> Any:
        """A copy whose update treats the gradient noise as ``gradient_noise`` says (the ignored-noise probe's)."""

    def init(self, latents: Latents) -> Any:
        """A chain's State at unconstrained ``latents``."""

    def update(self, state: Any, gradient: GradientEstimate, generator=None, **tuned: Any) -> tuple[Any, Any]:
        """The new State and the step's Info, given the gradient (``tuned``: hyperparameters warm-up chose)."""

    def latents(self, state: Any) -> Latents:
        """The chain's draw: its last point with a finite log density and gradient."""

    def relocate(self, state: Any, centre: Latents, jump: Any) -> Any:
        """The State moved to ``centre`` where ``jump`` (and at rest there, where it has momenta)."""
