"""The compiled sampling loop (``model_tracing(compile=True, block_steps=K)``, :mod:`.compiled_blocks`).

The gold test: from the same seed, a run whose fixed-step stretches go as compiled blocks keeps the eager run's
draws, to float32 rounding (the graph fuses and reorders float operations: the differences seen are 1e-8 on draws of
size 1, the tolerance 1e-5). Tests with ``torch.compile`` replaced by the function itself run the blocks' code (the
noise and minibatches drawn before the block, the bookkeeping after it) without compiling, in a second; a real
compile takes 10-60 s per graph on a loaded 2-core CPU, so the fast tier compiles one graph (one chain).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._pytree import tree_map

from pyro_scalable import model_tracing
from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC
from pyro_scalable.infer.sgmcmc import compiled_blocks

from ...conftest import LinearRegression

PROBLEM = LinearRegression(num_data=400, dim=3, batch_size=40, dtype=torch.float32)
FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}  # float32 rounding, accumulated over the run's steps


@pytest.fixture
def made(monkeypatch):
    """The runs' :class:`~.compiled_blocks.CompiledBlocks`, to see whether blocks ran compiled or why not."""
    made = []
    original = compiled_blocks.CompiledBlocks.__init__

    def init(self, size):
        original(self, size)
        made.append(self)

    monkeypatch.setattr(compiled_blocks.CompiledBlocks, "__init__", init)
    return made


@pytest.fixture
def uncompiled(monkeypatch):
    """``torch.compile`` as the identity: the block's function runs as written, with its drawn noise."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)


def run(kernel, *, compile=False, block_steps=4, problem=PROBLEM, **options):
    settings = {"num_samples": 60, "num_warmup": 0, "seed": 5, "progress_bar": False, **options}
    mcmc = StochasticMCMC(kernel, **settings)
    with model_tracing(compile=compile, block_steps=block_steps):
        mcmc.run(problem.x, problem.y)
    return mcmc


def sghmc(**options):
    return SGHMC(PROBLEM.model, step_size=1e-3, friction=50.0, **options)


def assert_blocks_ran(made):
    assert [m.refused for m in made] == [None] * len(made)
    assert sum(m.compiled_blocks for m in made) > 0, "no block ran compiled"


def test_compiled_blocks_keep_the_eager_runs_draws(made):
    """The gold test, compiled: one chain, blocks of 4 steps; every kept draw and statistic the eager run's, and
    torch's own generator left as the eager run leaves it (the blocks draw from the run's generator only)."""
    torch.manual_seed(7)
    eager = run(sghmc())
    after_eager = torch.get_rng_state()
    torch.manual_seed(7)
    compiled = run(sghmc(), compile=True)
    assert_blocks_ran(made)
    torch.testing.assert_close(compiled.get_samples()["w"], eager.get_samples()["w"], **FLOAT32)
    for stat in ("lp", "grad_norm"):
        torch.testing.assert_close(compiled.results.stats[stat], eager.results.stats[stat], rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.get_rng_state(), after_eager)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_vectorised_blocks_keep_the_eager_runs_draws(device, made):
    """Four vectorised chains (their noise one (4, d) draw per step, as vmap draws it), warm-up then sampling: two
    graphs; on CUDA with CUDA graphs."""
    problem = LinearRegression(num_data=400, dim=3, batch_size=40, dtype=torch.float32, device=device)
    kernel = SGHMC(problem.model, step_size=1e-3, friction=50.0)
    options = {"num_chains": 4, "num_warmup": 40, "problem": problem}
    eager, compiled = run(kernel, **options), run(kernel, compile=True, block_steps=8, **options)
    assert_blocks_ran(made)
    torch.testing.assert_close(compiled.get_samples()["w"], eager.get_samples()["w"], **FLOAT32)


@pytest.mark.parametrize(
    ("num_chains", "shared"), [(1, False), (3, False), (3, True)], ids=["one-chain", "vectorised", "shared-minibatch"]
)
@pytest.mark.parametrize("kind", ["sghmc", "sgld-noise-corrected"])
def test_blocks_draw_the_eager_runs_noise_and_minibatches(kind, num_chains, shared, uncompiled, made):
    """Blocks run as written: fixed-step warm-up and sampling in blocks (thinned, the noise measured on every 4th
    step where it is corrected), the same draws as the eager run's, the warm-up's bookkeeping the same."""
    if kind == "sghmc":
        kernel = sghmc()
    else:
        kernel = SGLD(PROBLEM.model, step_size=1e-6, gradient_noise="correct")
    options = {"num_chains": num_chains, "num_warmup": 44, "thin": 3, "shared_minibatches": shared}
    eager, blocks = run(kernel, **options), run(kernel, compile=True, **options)
    assert_blocks_ran(made)
    assert blocks.get_samples()["w"].shape == eager.get_samples()["w"].shape == (60 * num_chains, 3)
    torch.testing.assert_close(blocks.get_samples()["w"], eager.get_samples()["w"], **FLOAT32)
    assert torch.equal(blocks.warmup_divergences, eager.warmup_divergences)


def test_a_block_that_fails_to_compile_runs_eagerly(monkeypatch, caplog, made):
    """A compiler failure: the reason logged and kept, the run eager from there, its draws the eager run's bitwise."""
    eager = run(sghmc())

    def refuse(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", refuse)
    with caplog.at_level(logging.WARNING, logger=compiled_blocks.__name__):
        fallen_back = run(sghmc(), compile=True)
    assert made[0].refused == "it failed to compile: RuntimeError: no compiler here"
    assert made[0].compiled_blocks == 0
    assert "runs eagerly" in caplog.text and "no compiler here" in caplog.text
    torch.testing.assert_close(fallen_back.get_samples()["w"], eager.get_samples()["w"], rtol=0, atol=0)


def test_a_block_that_disagrees_with_the_eager_steps_runs_eagerly(monkeypatch, made):
    """A compiled block whose results are off (here by 1e-2) is refused at its first block, the run eager."""
    eager = run(sghmc())

    def wrong(fn, **options):
        def block(*args):
            state, out = fn(*args)
            return tree_map(lambda x: x + 1e-2 if x.is_floating_point() else x, state), out

        return block

    monkeypatch.setattr(torch, "compile", wrong)
    fallen_back = run(sghmc(), compile=True)
    reason = made[0].refused
    assert reason.startswith("its draws differ from the eager steps' by ") and reason.endswith(" (relative)"), reason
    assert float(reason.split(" by ")[1].split()[0]) > compiled_blocks.CompiledBlocks.RTOL
    assert made[0].compiled_blocks == 0
    torch.testing.assert_close(fallen_back.get_samples()["w"], eager.get_samples()["w"], rtol=0, atol=0)


def test_a_block_that_draws_other_numbers_than_the_eager_steps_runs_eagerly(monkeypatch, uncompiled, made):
    """The first block's check reads the run's generator: a block that drew more (here one number) is refused."""
    eager = run(sghmc())
    draw = compiled_blocks._draw

    def one_more(size, state, noise):
        drawn = draw(size, state, noise)
        torch.randn((), generator=state.generator)
        return drawn

    monkeypatch.setattr(compiled_blocks, "_draw", one_more)
    fallen_back = run(sghmc(), compile=True)
    assert made[0].refused == "the eager steps drew other random numbers than the block drew for them"
    torch.testing.assert_close(fallen_back.get_samples()["w"], eager.get_samples()["w"], rtol=0, atol=0)


def test_runs_that_need_the_driver_between_steps_step_eagerly_saying_why(uncompiled, made):
    """on_divergence='stop' reads every step: no block runs, the reason is kept, the draws are the eager run's."""
    eager = run(sghmc(), on_divergence="stop")
    stepped = run(sghmc(), compile=True, on_divergence="stop")
    assert made[0].refused == "on_divergence='stop' ends the run after the step that diverges"
    assert made[0].compiled_blocks == 0
    torch.testing.assert_close(stepped.get_samples()["w"], eager.get_samples()["w"], rtol=0, atol=0)


@pytest.mark.parametrize("metric", ["unit", "dense"])
def test_an_adaptive_warmup_steps_eagerly_and_sampling_in_blocks(metric, uncompiled, made):
    """A warm-up that learns the step size moves it between steps: its steps are eager, sampling's in blocks (with
    warm-up's dense metric, in its variables: the draws mapped back as the eager run's are)."""
    kernel = SGHMC(PROBLEM.model, friction=50.0)  # warm-up chooses the step size
    options = {"num_warmup": 200, "metric": metric, "num_samples": 150}  # 17 of each phase eagerly, then blocks
    eager, blocks = run(kernel, **options), run(kernel, compile=True, **options)
    assert_blocks_ran(made)
    assert (blocks.metric_map is not None) == (metric == "dense")
    torch.testing.assert_close(blocks.get_samples()["w"], eager.get_samples()["w"], **FLOAT32)


@pytest.mark.parametrize("steps", [0, 1.5, True])
def test_block_steps_is_a_positive_count(steps):
    with pytest.raises((TypeError, ValueError), match="block_steps must be an int >= 1"):
        with model_tracing(compile=True, block_steps=steps):
            pass
