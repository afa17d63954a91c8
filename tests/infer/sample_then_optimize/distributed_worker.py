"""The runs tests/infer/sample_then_optimize/test_distributed.py compares: on 2 gloo ranks (torchrun) or one process.

``python -m torch.distributed.run --standalone --nproc_per_node=2 <this file> OUT`` writes
``OUT/<scenario>.rank<r>.pt`` (draws, sample_stats, EM history, trace, rows) for every scenario on every rank, and
``OUT/errors.rank<r>.pt`` (the messages of the runs that must fail).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.infer import SampleThenOptimize

# 43 points in chunks of 7: the last chunk has one point, so one rank's share of it is empty under "data"
NUM_DATA, MINIBATCH, CHUNK = 43, 10, 7


def regression(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=MINIBATCH) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])


def classification(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=MINIBATCH) as idx:
        pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])


def whole_batch(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)


def data(kind: str = "regression") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 3, generator=generator, dtype=torch.float64)
    f = x @ torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    if kind == "classification":
        return x, torch.bernoulli(torch.sigmoid(f), generator=generator)
    return x, f + 0.5 * torch.randn(NUM_DATA, generator=generator, dtype=torch.float64)


def scenarios() -> dict[str, tuple[str, object, dict]]:
    """Name -> (distributed mode, model, SampleThenOptimize options other than ``distributed``)."""
    common = dict(num_epochs=4, chunk_size=CHUNK, seed=5, progress_bar=False)
    at = {"w": torch.tensor([0.8, -0.4, 0.2], dtype=torch.float64)}  # a nonlinear model needs a linearisation point
    return {
        # 5 samples: rows 0-2 on rank 0, 3-4 on rank 1; EM needs the all-reduced effective dimension
        "samples_em": ("samples", regression, dict(num_samples=5, em_steps=2, em_groups="site", **common)),
        # one control-variate anchor per row: the anchors are gathered too
        "samples_all": ("samples", regression, dict(num_samples=3, em_steps=1, variance_reduction="all", **common)),
        "samples_logistic": ("samples", classification, dict(num_samples=4, linearize_at=at, **common)),
        # no subsampled plate: every step is a full-data step
        "samples_whole_batch": ("samples", whole_batch, dict(num_samples=2, **common)),
        "data_em": ("data", regression, dict(num_samples=3, em_steps=2, **common)),
        "data_logistic": ("data", classification, dict(num_samples=3, em_steps=1, linearize_at=at, **common)),
    }


def run(mode: str | None, model, options: dict, kind: str) -> SampleThenOptimize:
    engine = SampleThenOptimize(model, distributed=mode, **options)
    engine.run(*data(kind))
    return engine


def result(engine: SampleThenOptimize) -> dict:
    return {
        "draws": engine.get_unconstrained_samples(),
        "stats": engine.sample_stats,
        "em_history": {k: v for k, v in engine.em_history.items() if k != "groups"},
        "trace": {k: torch.stack(v) for k, v in engine.trace.items()},
        "targets": engine.state.targets,
        "mean": engine.mean_unconstrained,
        "num_samples": engine.num_samples,
    }


def errors() -> dict[str, str]:
    """The messages of the runs that a 2-rank group refuses."""
    x, y = data()
    bad = {
        "too_few_samples": (regression, dict(num_samples=1, distributed="samples")),
        "no_plate": (whole_batch, dict(num_samples=2, distributed="data")),
    }
    messages = {}
    for name, (model, options) in bad.items():
        try:
            SampleThenOptimize(model, num_epochs=1, seed=0, progress_bar=False, **options).run(x, y)
        except ValueError as error:
            messages[name] = str(error)
    return messages


def main(out: Path) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the short runs warn that they have not converged; not what is compared
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    for name, (mode, model, options) in scenarios().items():
        engine = run(mode, model, options, "classification" if model is classification else "regression")
        saved = result(engine)
        if rank == 0:
            saved["idata_posterior"] = tuple(engine.to_inference_data().posterior["w"].shape)
        torch.save(saved, out / f"{name}.rank{rank}.pt")
    torch.save(errors(), out / f"errors.rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
