"""A small run for tests/infer/sgmcmc/test_checkpoint.py to kill: ``python killable_run.py CHECKPOINT PAUSE``.

``python killable_run.py CHECKPOINT PAUSE NTH MOMENT`` kills itself with SIGKILL during its ``NTH`` checkpoint write
(:func:`tests.infer.killing.arm`).

``PAUSE`` seconds of sleep before each step slow the run down enough for a test to kill it mid-way; the pause
does not change a single number, and lives outside the model (whose code is part of the checkpoint's fingerprint).

``python killable_run.py CHECKPOINT signalled KEPT`` waits for a real SIGINT or SIGTERM from its parent: it prints
``step N`` (flushed) after each step, and from step :data:`ANNOUNCED` on sleeps :data:`LONG_PAUSE` seconds before
each step, so the signal arrives mid-run however slowly the parent reacts. Interrupted, it saves the draws ``run()``
kept to ``KEPT`` and exits with 0; a run that ends without a signal exits with 3.

``python killable_run.py CHECKPOINT paced PAUSE`` runs :data:`PACED_SAMPLES` draws, sleeps ``PAUSE`` seconds in each
step (half before it, half after the chains have moved but before the driver's bookkeeping of it), prints ``step N``
after it, and takes SIGINT (and SIGTERM, which a checkpointed run handles as SIGINT) as Ctrl-C: interrupted, it exits
with 0; a run that ends without a signal exits with 3. The pauses make the run last at least
``(NUM_WARMUP + PACED_SAMPLES) * PAUSE`` seconds, so a signal sent within the pauses still to come lands mid-run.
"""

from __future__ import annotations

import signal
import sys
import time

import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.infer import SGHMC, StochasticMCMC
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from tests.infer import killing

NUM_WARMUP, NUM_SAMPLES = 10, 30
PACED_SAMPLES = 90  # the model tracing's recording (the 17th step) is then a small part of the run's time
ANNOUNCED, LONG_PAUSE = 20, 0.5  # past the model tracing's recording (16 calls of the step's signature)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 2, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0], dtype=torch.float64) + torch.randn(100, generator=g, dtype=torch.float64)
    return x, y


def model(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(y), subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])


def sampler(checkpoint=None, num_samples: int = NUM_SAMPLES) -> StochasticMCMC:
    return StochasticMCMC(
        SGHMC(model, step_size=1e-3, friction=10.0),
        num_samples=num_samples,
        num_warmup=NUM_WARMUP,
        num_chains=3,
        seed=3,
        progress_bar=False,
        checkpoint=checkpoint,
        checkpoint_every=5,
    )


def slow_down(pause: float) -> None:
    """Sleep ``pause`` seconds before each step."""
    step = ChainStepper.step

    def slow_step(self, batch, step_index, density):
        time.sleep(pause)
        return step(self, batch, step_index, density)

    ChainStepper.step = slow_step


def announce() -> None:
    """Print ``step N`` after each step; sleep :data:`LONG_PAUSE` before each step from step :data:`ANNOUNCED` on."""
    step = ChainStepper.step
    done = []

    def announcing_step(self, batch, step_index, density):
        if len(done) >= ANNOUNCED:
            time.sleep(LONG_PAUSE)
        info = step(self, batch, step_index, density)
        done.append(None)
        print(f"step {len(done)}", flush=True)
        return info

    ChainStepper.step = announcing_step


def signalled(checkpoint: str, kept: str) -> int:
    """The run until a signal: what ``run()`` kept saved to ``kept`` (0), or 3 where no signal came."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's handler, also where the parent ignores it
    announce()
    run = sampler(checkpoint)
    try:
        run.run(*data())
    except KeyboardInterrupt:
        torch.save(run.get_unconstrained_samples(group_by_chain=True), kept)
        return 0
    return 3


def paced(checkpoint: str, pause: float) -> int:
    """The run, ``pause`` seconds in each step and ``step N`` after it: 0 if a signal interrupted it, else 3."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    step = ChainStepper.step
    done = []

    def paced_step(self, batch, step_index, density):
        time.sleep(pause / 2)
        info = step(self, batch, step_index, density)
        # half the pause after the step: the chains have moved and drawn their noise, the driver has not yet kept the
        # draw nor noted the step, so a signal here tests what the checkpoint written at the interrupt holds
        time.sleep(pause / 2)
        done.append(None)
        print(f"step {len(done)}", flush=True)
        return info

    ChainStepper.step = paced_step
    try:
        sampler(checkpoint, PACED_SAMPLES).run(*data())
    except KeyboardInterrupt:
        return 0
    return 3


if __name__ == "__main__":
    if sys.argv[2] == "signalled":
        sys.exit(signalled(sys.argv[1], sys.argv[3]))
    if sys.argv[2] == "paced":
        sys.exit(paced(sys.argv[1], float(sys.argv[3])))
    slow_down(float(sys.argv[2]))
    if len(sys.argv) > 3:
        killing.arm(int(sys.argv[3]), sys.argv[4])
    sampler(sys.argv[1]).run(*data())
