"""Real signals at random moments: a checkpointed run in a child process gets SIGINT, SIGTERM or SIGKILL somewhere
in its run, and the run resumed here is bitwise the uninterrupted one (draws and sample statistics).

Each moment is drawn from a seeded generator. The child (``killable_run.py CHECKPOINT paced PAUSE``) sleeps ``PAUSE``
in every step, half before it and half after the chains have moved but before the driver has kept the draw, and
announces each step; once it has announced ``after`` steps the run has at least ``PAUSE`` seconds per step still to
go, and a signal sent within a random fraction of that lands mid-run: in a step, between a step and its bookkeeping,
in a checkpoint write, or (from the first checkpoint on) in the model tracing's recording, the 16th step, which takes
seconds where the others take milliseconds. SIGINT and SIGTERM end the child cleanly (exit 0: the checkpoint written,
the draws kept); SIGKILL ends it wherever it is, and the last whole checkpoint is what the resume reads.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pyro_scalable.infer.checkpoint import load

from . import killable_run
from .test_checkpoint import assert_same_run, child_env

pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
    # SGHMC's warm-up: torch scripts its jvp decompositions once per process and warns that torch.jit.script is
    # deprecated (a torch internal)
    pytest.mark.filterwarnings(r"ignore:.*torch\.jit\.script. is deprecated:DeprecationWarning"),
]

PAUSE = 0.01  # seconds in each of the child's steps (about a step's own time, but for the recording's)
STEPS = killable_run.NUM_WARMUP + killable_run.PACED_SAMPLES
FIRST_CHECKPOINT = 5  # killable_run's checkpoint_every
RECORDED = 17  # steps announced once the model tracing has recorded its graph (in the 16th)
SIGNALS = ["SIGINT", "SIGTERM", "SIGKILL"]


@pytest.fixture(scope="module")
def reference():
    run = killable_run.sampler(num_samples=killable_run.PACED_SAMPLES)
    run.run(*killable_run.data())
    return run


def signal_at_random_moments(folder: Path, names: list[str], seed: int, after: int) -> list[dict]:
    """One child per signal name, run side by side, each signalled at a moment drawn from ``seed``'s generator.

    The moment is a random fraction of the pauses still to come once the child has announced ``after`` steps and
    written its first checkpoint.
    Returns, per child, its signal, checkpoint, exit code, stderr, the steps it announced and the fraction drawn.
    """
    rng = random.Random(seed)
    children = []
    for index, name in enumerate(names):
        path, out, err = folder / f"{index}.pt", folder / f"{index}.out", folder / f"{index}.err"
        command = [sys.executable, str(Path(killable_run.__file__)), str(path), "paced", str(PAUSE)]
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=child_env())
        window = 0.9 * (STEPS - after) * PAUSE  # a lower bound on the rest of the run, less a margin
        children.append(dict(name=name, path=path, out=out, err=err, process=process, at=None))
        children[-1]["delay"] = rng.random() * window
    deadline = time.monotonic() + 120
    try:
        while any(child["process"].poll() is None and child["at"] != "sent" for child in children):
            assert time.monotonic() < deadline, "a child neither reached its moment nor ended in 120 s"
            now = time.monotonic()
            for child in children:
                if child["process"].poll() is not None or child["at"] == "sent":
                    continue
                announced = child["out"].read_text().split().count("step")
                if child["at"] is None and announced >= after and child["path"].exists():
                    child["at"] = now + child["delay"]
                elif child["at"] is not None and now >= child["at"]:
                    os.kill(child["process"].pid, getattr(signal, child["name"]))
                    child["at"] = "sent"
            time.sleep(0.002)
        for child in children:
            child["returncode"] = child["process"].wait(timeout=120)
    finally:
        for child in children:
            if child["process"].poll() is None:
                child["process"].kill()
                child["process"].wait()
    for child in children:
        child.update(stderr=child["err"].read_text(), steps=child["out"].read_text().split().count("step"))
    return children


def check_resumes_bitwise(child: dict, reference) -> None:
    """The child died of its signal mid-run, and the run resumed from its checkpoint is the uninterrupted one."""
    name, stderr = child["name"], child["stderr"]
    assert child["at"] == "sent", f"{name} was never sent (the child ended first: {child['returncode']}): {stderr}"
    if name == "SIGKILL":
        assert child["returncode"] == -signal.SIGKILL, stderr
    else:  # Ctrl-C, or a scheduler's stop: the driver writes the checkpoint and keeps the draws
        assert child["returncode"] == 0, stderr
        assert "interrupted: keeping the" in stderr
    assert FIRST_CHECKPOINT <= child["steps"] < STEPS, child  # mid-run: after the first checkpoint, before the end
    saved = load(child["path"])
    assert FIRST_CHECKPOINT <= saved["step"] < STEPS
    if name != "SIGKILL":  # written at the interrupt: the last step done (the one announced, or its bookkeeping cut)
        assert child["steps"] - 1 <= saved["step"] <= child["steps"], (saved["step"], child)
    expected = reference.get_unconstrained_samples(group_by_chain=True)["w"]
    assert torch.equal(saved["draws"]["w"], expected[:, : saved["kept"]])
    resumed = killable_run.sampler(child["path"], killable_run.PACED_SAMPLES)
    resumed.run(*killable_run.data())
    assert_same_run(resumed, reference)


def test_real_signals_at_random_moments_resume_bitwise(tmp_path, reference):
    for child in signal_at_random_moments(tmp_path, SIGNALS, seed=0, after=RECORDED):
        check_resumes_bitwise(child, reference)


@pytest.mark.slow
@pytest.mark.parametrize("after", [FIRST_CHECKPOINT, RECORDED])
@pytest.mark.parametrize("seed", range(1, 5))
def test_real_signals_at_many_random_moments_resume_bitwise(tmp_path, reference, seed, after):
    for child in signal_at_random_moments(tmp_path, SIGNALS, seed, after):
        check_resumes_bitwise(child, reference)
