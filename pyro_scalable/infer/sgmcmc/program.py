"""The contract the chain stepper calls: a :class:`Program` steps chains; a :class:`KernelContract` is one users pass.

Three classes implement :class:`Program`: a kernel (:class:`~.base.Kernel`), warm-up around one
(:class:`~.adaptation.Adaptation`), and a kernel with the hyperparameters warm-up chose (:class:`~.adaptation.Tuned`).
The stepper (:mod:`.chains`) and the driver (:mod:`.mcmc`, :mod:`.phases`) call exactly these and probe for nothing;
``tests/infer/sgmcmc/test_conformance.py`` checks every registered kernel against them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pyro_scalable.bridge.model import Latents
from pyro_scalable.infer.sgmcmc.base import SAMPLING, GradientEstimate, LogPosteriorFn, Phase

__all__ = ["KernelContract", "Program"]


@runtime_checkable
class Program(Protocol):
    """What steps a chain: its state from a start, each step's phase, the gradient estimate, the update."""

    def init(self, latents: Latents) -> Any:
        """A chain's state at unconstrained ``latents``."""

    def phase(self, step_index: int) -> Phase:
        """What step ``step_index`` does besides the update (noise measured, power iterations, burn-in)."""

    def estimate(
        self, state: Any, batch: Any, log_posterior_fn: LogPosteriorFn, phase: Phase = SAMPLING, direction=None
    ) -> GradientEstimate:
        """The gradient (and what the update needs with it) on ``batch``."""

    def plain_gradient_at(self, state: Any, phase: Phase = SAMPLING) -> Latents | None:
        """The latents where :meth:`estimate` is the plain minibatch gradient (all chains in one pass), else None."""

    def update(self, state: Any, gradient: GradientEstimate, generator=None, phase: Phase = SAMPLING):
        """The new state and the step's Info, given the gradient."""

    def step(self, state: Any, batch: Any, log_posterior_fn: LogPosteriorFn, generator=None, phase=SAMPLING):
        """:meth:`update` after :meth:`estimate`."""

    def latents(self, state: Any) -> Latents:
        """The chain's draw: its last point with a finite log density and gradient."""

    def finish(self, state: Any) -> Any:
        """The state sampling goes on with at the end of warm-up (the state itself where there is no warm-up)."""

    @property
    def sampler(self) -> Program:
        """The program that steps after warm-up (this one where there is no warm-up to unwrap)."""


@runtime_checkable
class KernelContract(Program, Protocol):
    """A kernel as ``StochasticMCMC`` takes it: a :class:`Program` bound to a Pyro model, with warm-up's settings.

    ``adapts``: warm-up chooses its step size (or metric) by ``warmup_rule`` (:data:`.tuning.RULES`);
    ``control_variate``: the control-variate setting (:mod:`.control_variates`; ``None``: none).
    """

    model: Any
    init_strategy: Any
    adapts: bool
    control_variate: Any
