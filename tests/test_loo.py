"""Streaming PSIS-LOO equals ``az.loo`` on the whole log_likelihood group: elpd, SE and p to rounding, the same k's.

Gold: ``az.loo(to_inference_data(run), pointwise=True)`` on the installed ArviZ major (scripts/test.sh runs these
against the other one too).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable import memory, to_inference_data
from pyro_scalable.infer import SGHMC, StochasticMCMC
from pyro_scalable.inference_data import ARVIZ_MAJOR, LOO_COPIES
from pyro_scalable.loo import streaming_loo
from pyro_scalable.memory import MemoryLimitError

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning)
    import arviz as az

pytestmark = pytest.mark.arviz

N = 150
PARETO = "Estimated shape parameter of Pareto distribution is greater than"


def model(x, y):
    """A Student-t regression: a few outlying points give large Pareto k's."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    scale = pyro.sample("scale", dist.HalfNormal(1.0))
    with pyro.plate("data", len(x), subsample_size=25) as idx:
        pyro.sample("obs", dist.StudentT(4.0, w * x[idx], scale), obs=y[idx])


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, generator=g, dtype=torch.float64)
    y = 0.7 * x + 0.5 * torch.randn(N, generator=g, dtype=torch.float64)
    y[:2] += 12.0  # outliers
    return x, y


@pytest.fixture(scope="module")
def run(data):
    sampler = StochasticMCMC(SGHMC(model, step_size=0.01), num_samples=60, num_warmup=40, num_chains=3, seed=2)
    sampler.progress_bar = False
    return sampler.run(*data)


def loo_parts(result) -> tuple[float, float, float, np.ndarray, np.ndarray, int, bool]:
    """elpd, se, p, the pointwise elpd and Pareto k, the number of points and the warning, on either major."""
    if ARVIZ_MAJOR >= 1:
        elpd, p, pointwise = result.elpd, result.p, result.elpd_i
    else:
        elpd, p, pointwise = result["elpd_loo"], result["p_loo"], result["loo_i"]
    values = (float(elpd), float(result.se), float(p), pointwise.values, result.pareto_k.values)
    return values + (int(result.n_data_points), bool(result.warning))


def whole(idata):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = az.loo(idata, pointwise=True)
    return result, {str(w.message) for w in seen if str(w.message).startswith(PARETO)}


def assert_same_loo(got, expected):
    got, expected = loo_parts(got), loo_parts(expected)
    np.testing.assert_allclose(got[:3], expected[:3], rtol=1e-12, atol=0)  # elpd, se, p: to rounding
    np.testing.assert_allclose(got[3], expected[3], rtol=1e-12, atol=0)
    np.testing.assert_array_equal(got[4], expected[4])  # the same Pareto k's
    assert got[5:] == expected[5:]


@pytest.mark.parametrize("chunk", [7, 150, None])
def test_streaming_loo_equals_az_loo(run, chunk):
    expected, pareto = whole(run.to_inference_data())
    assert pareto, "the outliers give k's above ArviZ's threshold: the warning is part of what is compared"
    with pytest.warns(UserWarning, match=PARETO) as seen:
        got = streaming_loo(run, data_chunk_size=chunk)
    assert len([w for w in seen if str(w.message).startswith(PARETO)]) == 1  # once, not once per chunk
    assert type(got) is type(expected)
    assert_same_loo(got, expected)
    assert loo_parts(got)[6] and got.pareto_k.dims == expected.pareto_k.dims == ("data",)


def test_thinned_draws_and_a_single_chain(run, data):
    expected, _ = whole(run.to_inference_data(thin=3))
    with pytest.warns(UserWarning, match=PARETO):
        assert_same_loo(streaming_loo(run, thin=3, data_chunk_size=40), expected)
    draws = {k: v[0] for k, v in run.get_samples(group_by_chain=True).items()}  # a dict of draws: one chain, reff 1
    expected, _ = whole(to_inference_data(draws, model, args=data))
    with pytest.warns(UserWarning, match=PARETO):
        assert_same_loo(streaming_loo(draws, model, args=data, data_chunk_size=33), expected)


def test_masked_points_are_left_out_as_the_group_leaves_them(data):
    x, y = data
    observed = torch.arange(N) % 3 != 0

    def masked(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(w * x, 1.0).mask(observed), obs=y)

    g = torch.Generator().manual_seed(0)
    draws = {"w": 0.7 + 0.05 * torch.randn(300, generator=g, dtype=torch.float64)}
    expected, _ = whole(to_inference_data(draws, masked, args=(x, y - 12.0 * (torch.arange(N) < 2))))
    got = streaming_loo(draws, masked, args=(x, y - 12.0 * (torch.arange(N) < 2)), data_chunk_size=16)
    assert loo_parts(got)[5] == int(observed.sum())
    assert_same_loo(got, expected)


def test_streaming_loo_works_where_the_whole_group_is_refused(run, monkeypatch):
    # 3 chains x 60 draws x 150 points x 8 bytes = 216 kB; a limit of 100 kB refuses it, one chunk of 10 points fits
    expected, _ = whole(run.to_inference_data())
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 200_000)
    monkeypatch.setattr(memory, "_cgroup_available", lambda: None)
    with pytest.raises(MemoryLimitError, match="pyro_scalable.loo.streaming_loo"):
        run.to_inference_data()
    fits = N // math.ceil((1 + LOO_COPIES) * 3 * 60 * N * 8 / 100_000)  # 16 points on ArviZ 0.x, 30 on 1.x
    with pytest.raises(MemoryLimitError, match=rf"(?s)one chunk of streaming_loo .* data_chunk_size={fits}\n"):
        streaming_loo(run, data_chunk_size=150)
    with pytest.warns(UserWarning, match=PARETO):
        assert_same_loo(streaming_loo(run, data_chunk_size=10), expected)
    with pytest.warns(UserWarning, match=PARETO):
        assert_same_loo(streaming_loo(run), expected)  # the default chunk follows the memory available


def test_several_observed_sites_need_var_name(data):
    x, y = data

    def two(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("a", dist.Normal(w * x, 1.0), obs=y)
            pyro.sample("b", dist.Normal(w, 1.0), obs=x)

    g = torch.Generator().manual_seed(3)
    draws = {"w": 0.7 + 0.05 * torch.randn(400, generator=g, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"the model has the observed sites \['a', 'b'\]: name one as var_name="):
        streaming_loo(draws, two, args=(x, y))
    expected = az.loo(to_inference_data(draws, two, args=(x, y)), pointwise=True, var_name="b")
    assert_same_loo(streaming_loo(draws, two, args=(x, y), var_name="b", data_chunk_size=50), expected)
