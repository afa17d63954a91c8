"""Pyro untouched outside our calls: the subsample override exists only while one of our contexts is open."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.subsample_messenger import SubsampleMessenger

from pyro_scalable.bridge import plates
from pyro_scalable.bridge.plates import FullDataModel, full_data, plate_indices

PYRO_ONLY = textwrap.dedent(
    """
    import sys
    import pyro, pyro.distributions as dist, torch
    from pyro.infer import SVI, Trace_ELBO, Predictive
    from pyro.infer.autoguide import AutoNormal
    if sys.argv[1] == "with":  # import the package and run one of its engines first
        from pyro_scalable.infer import SGLD, StochasticMCMC

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=10) as idx:
            return pyro.sample("obs", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])

    torch.manual_seed(0)
    x = torch.randn(50, 2)
    y = x @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(50)
    if sys.argv[1] == "with":
        StochasticMCMC(SGLD(model, step_size=1e-3), num_samples=5, num_warmup=0, progress_bar=False).run(x, y)
    pyro.set_rng_seed(1)
    pyro.clear_param_store()
    guide = AutoNormal(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(20)]
    prior = Predictive(model, num_samples=3)(x)["obs"]
    posterior = Predictive(model, guide=guide, num_samples=3)(x)["obs"]
    print(repr(losses), prior.tolist(), posterior.tolist())
    """
)


def test_pyro_runs_as_if_the_package_were_not_imported():
    """SVI and Predictive on a subsampled model, seeded: the same numbers with and without the package (and after
    one of its engines ran), in fresh processes."""
    runs = {
        mode: subprocess.run([sys.executable, "-c", PYRO_ONLY, mode], capture_output=True, text=True, timeout=300)
        for mode in ("without", "with")
    }
    for mode, run in runs.items():
        assert run.returncode == 0, (mode, run.stderr[-2000:])
    assert runs["with"].stdout == runs["without"].stdout
    assert runs["without"].stdout.count("[") > 3  # the script printed its numbers


def test_the_override_is_installed_only_inside_our_contexts():
    assert SubsampleMessenger.__dict__["_subsample"] is plates._PYRO_SUBSAMPLE
    with full_data():
        assert SubsampleMessenger.__dict__["_subsample"] is not plates._PYRO_SUBSAMPLE
        with plate_indices({"data": torch.arange(3)}):
            assert SubsampleMessenger.__dict__["_subsample"] is not plates._PYRO_SUBSAMPLE
        assert SubsampleMessenger.__dict__["_subsample"] is not plates._PYRO_SUBSAMPLE  # the outer one still holds
    assert SubsampleMessenger.__dict__["_subsample"] is plates._PYRO_SUBSAMPLE


def test_the_override_is_taken_out_when_the_model_raises():
    def model(y):
        with pyro.plate("data", len(y), subsample_size=5):
            raise RuntimeError("the user's bug")

    try:
        FullDataModel(model)(torch.zeros(20))
    except RuntimeError as error:
        assert "the user's bug" in str(error)
    assert SubsampleMessenger.__dict__["_subsample"] is plates._PYRO_SUBSAMPLE


def test_full_data_model_runs_every_point_and_pyro_alone_a_minibatch():
    def model(y):
        with pyro.plate("data", len(y), subsample_size=5) as idx:
            pyro.sample("obs", dist.Normal(0.0, 1.0), obs=y[idx])

    y = torch.zeros(20)
    assert pyro.poutine.trace(FullDataModel(model)).get_trace(y).nodes["obs"]["value"].shape == (20,)
    assert pyro.poutine.trace(model).get_trace(y).nodes["obs"]["value"].shape == (5,)
