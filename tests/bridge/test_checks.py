"""Bad input gets a clear error naming the site or argument, and bad hyperparameters a one-liner."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable import ModelError
from pyro_scalable.bridge import ModelBridge
from pyro_scalable.bridge.checks import check_inputs, explain_mixed_tensors
from pyro_scalable.infer import SGHMC, SGLD, PolynomialDecay, StochasticMCMC

N, B = 100, 10


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 2, generator=g), torch.randn(N, generator=g)


def regression(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])


def regression_with_plate_size(size):
    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", size, subsample_size=B) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

    return model


# ---------------------------------------------------------------------------------------------------- the model


def test_a_well_formed_model_passes(data):
    bridge = ModelBridge(regression, data)
    assert set(bridge.sites) == {"w"}
    assert set(bridge.observed) == {"obs"}
    assert bridge.plates["data"].size == N and bridge.plates["data"].subsample_size == B


@pytest.mark.parametrize(
    "prior",
    [
        lambda: dist.Categorical(torch.ones(3)),
        lambda: dist.Bernoulli(0.5),
        lambda: dist.Poisson(2.0),
    ],
    ids=["Categorical", "Bernoulli", "Poisson"],
)
def test_discrete_latent_is_named(data, prior):
    def model(x, y):
        k = pyro.sample("k", prior())
        with pyro.plate("data", N, subsample_size=B) as idx:
            pyro.sample("obs", dist.Normal(k.to(y.dtype), 1.0), obs=y[idx])

    with pytest.raises(ModelError, match=r"latent site 'k' is discrete"):
        ModelBridge(model, data)


def test_latent_inside_subsample_size_plate_is_named(data):
    def model(x, y):
        with pyro.plate("data", N, subsample_size=B) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Normal(z, 1.0), obs=y[idx])

    with pytest.raises(ModelError, match=r"latent site 'z' is inside the subsampled plate 'data'"):
        ModelBridge(model, data)


def test_forgotten_observations_are_named_as_such(data):
    """run(x) without y leaves obs=None: the error says the data did not reach the site, not only 'move it'."""
    x, _ = data

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", N, subsample_size=B) as idx:
            pyro.sample("obs", dist.Normal(w * x[idx, 0], 1.0), obs=None if y is None else y[idx])

    with pytest.raises(ModelError, match=r"'obs' is inside the subsampled plate 'data'.*pass the data to run"):
        ModelBridge(model, (x,))


def test_latent_inside_subsample_idx_plate_is_named(data):
    x, y = data

    def model(x, y, idx=None):
        with pyro.plate("data", N, subsample=idx):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Normal(z, 1.0), obs=y)

    idx = torch.arange(B)
    with pytest.raises(ModelError, match=r"latent site 'z' is inside the subsampled plate 'data'"):
        ModelBridge(model, (x[idx], y[idx], idx))


def test_weights_sampled_inside_the_plate_that_break_the_model_are_explained(data):
    """A global weight drawn inside the plate gets a batch dim, and the model fails before the bridge's checks."""

    def model(x, y):
        with pyro.plate("data", N, subsample_size=B) as idx:
            w = pyro.sample("w", dist.Normal(torch.zeros(3, 2), 1.0).to_event(2))  # (B, 3, 2)
            pyro.sample("obs", dist.Normal(torch.nn.functional.linear(x[idx], w).sum(-1), 1.0), obs=y[idx])

    with pytest.raises(ModelError, match=r"after sampling latent site 'w' inside the subsampled plate 'data'.*outside"):
        ModelBridge(model, data)


def test_latent_inside_an_unsubsampled_plate_is_fine(data):
    def model(x, y):
        with pyro.plate("features", 2):
            w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", N, subsample_size=B) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

    assert set(ModelBridge(model, data).sites) == {"w"}


def test_model_without_observed_site(data):
    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", N, subsample_size=B) as idx:
            pyro.deterministic("f", x[idx] @ w)

    with pytest.raises(ModelError, match=r"no observed site"):
        ModelBridge(model, data)


def test_plate_smaller_than_the_data_names_argument_and_plate(data):
    with pytest.raises(ModelError, match=r"argument 'x' has 100 rows but plate 'data' has size 60") as info:
        ModelBridge(regression_with_plate_size(60), data)
    assert "pyro.plate('data', N" in str(info.value)


@pytest.mark.parametrize("seed", range(5))
def test_plate_larger_than_the_data_names_the_plate(data, seed):
    # The first trace draws its own minibatch, so whether the error comes from it or from the check of the last
    # indices depends on the seed: the message must name the plate either way.
    pyro.set_rng_seed(seed)
    with pytest.raises(
        ModelError, match=r"plate size must equal the number of data points: plates 'data' \(size 150\)"
    ):
        ModelBridge(regression_with_plate_size(150), data)


def test_plate_larger_than_the_data_is_caught_even_when_the_first_minibatch_fits(data):
    # N = 101 leaves only one index out of range; a random minibatch rarely contains it, the check of the last
    # indices always does.
    pyro.set_rng_seed(0)
    with pytest.raises(ModelError, match=r"plates 'data' \(size 101\)"):
        ModelBridge(regression_with_plate_size(101), data)


# ---------------------------------------------------------------------------------------------------- the inputs


def test_tensors_on_two_devices_are_named(data):
    # The meta device stands in for a second device on a CPU-only machine; check_inputs only compares devices.
    x, y = data
    with pytest.raises(ModelError, match=r"argument 'y' is on meta but argument 'x' is on cpu"):
        ModelBridge(regression, (x, y.to("meta")))
    with pytest.raises(ModelError, match=r"argument 'y' is on meta but argument 'x' is on cpu"):
        check_inputs(regression, (x,), {"y": y.to("meta")})


def test_tensors_on_two_devices_inside_a_container_are_named(data):
    x, y = data

    def model(data):
        regression(*data)

    with pytest.raises(ModelError, match=r"argument 'data'\[1\] is on meta but argument 'data'\[0\] is on cpu"):
        check_inputs(model, ((x, y.to("meta")),), {})


@pytest.mark.cuda
def test_tensors_on_cpu_and_cuda_are_named(data):
    x, y = data
    with pytest.raises(ModelError, match=r"argument 'y' is on cuda:0 but argument 'x' is on cpu"):
        ModelBridge(regression, (x, y.cuda()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_positional_argument_is_named(data, bad):
    x, y = data
    x = x.clone()
    x[3, 1] = bad
    with pytest.raises(ModelError, match=r"argument 'x' holds 1 non-finite value\(s\) \(NaN or Inf\)"):
        ModelBridge(regression, (x, y))


def test_finite_values_whose_sum_overflows_are_finite():
    # the check sums the data first (a NaN or Inf in it makes the sum non-finite); a finite sum that overflows
    # float32 falls back to the elementwise check, which accepts it
    x = torch.full((4, 2), 3e38)

    def model(x):
        pyro.sample("w", dist.Normal(0.0, 1.0))

    assert not bool(torch.isfinite(x.sum()))
    assert check_inputs(model, (x,), {}) == x.device
    x[2, 1] = float("nan")
    with pytest.raises(ModelError, match=r"argument 'x' holds 1 non-finite value"):
        check_inputs(model, (x,), {})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_keyword_argument_is_named(data, bad):
    x, y = data
    y = y.clone()
    y[[5, 7]] = bad
    with pytest.raises(ModelError, match=r"argument 'y' holds 2 non-finite value\(s\)"):
        ModelBridge(regression, (x,), {"y": y})


def test_non_finite_observed_value_from_a_closure_is_named(data):
    # Data the model closes over is not an argument: only the traced minibatch is checked, so make every
    # minibatch hold a NaN.
    x, y = data
    y = torch.full_like(y, float("nan"))

    def model(x):
        regression(x, y)

    with pytest.raises(ModelError, match=r"observed site 'obs' holds NaN or Inf"):
        ModelBridge(model, (x,))


def test_errors_surface_from_run(data):
    x, y = data
    x = x.clone()
    x[0, 0] = float("nan")
    mcmc = StochasticMCMC(SGLD(regression, step_size=1e-3), num_samples=2, progress_bar=False)
    with pytest.raises(ModelError, match=r"argument 'x' holds"):
        mcmc.run(x, y)


# ---------------------------------------------------------------------------------------------------- hyperparameters


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"step_size": -1e-3}, r"step_size must be finite and > 0, got -0.001"),
        ({"step_size": 0.0}, r"step_size must be finite and > 0"),
        ({"step_size": float("nan")}, r"step_size must be finite"),
        ({"step_size": float("inf")}, r"step_size must be finite"),
        ({"step_size": torch.tensor(-1.0)}, r"step_size must be finite and > 0"),
        ({"step_size": 1e-3, "temperature": -1.0}, r"temperature must be finite and >= 0"),
    ],
)
def test_sgld_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SGLD(regression, **kwargs)


def test_sgld_accepts_zero_temperature_and_schedules():
    kernel = SGLD(regression, step_size=PolynomialDecay(a=0.1), temperature=0.0)
    assert kernel.temperature == 0.0 and isinstance(kernel.step_size, PolynomialDecay)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"step_size": -1e-3}, r"step_size must be finite and > 0"),
        ({"step_size": 1e-3, "friction": -1.0}, r"friction must be finite and > 0, got -1.0"),
        ({"step_size": 1e-3, "friction": 0.0}, r"friction must be finite and > 0"),
        ({"step_size": 1e-3, "mass": 0.0}, r"mass must be finite and > 0"),
        ({"step_size": 1e-3, "mass": -2.0}, r"mass must be finite and > 0"),
        ({"step_size": 1e-3, "temperature": -0.1}, r"temperature must be finite and >= 0"),
        ({"step_size": 0.5, "friction": 2.0}, r"step_size \* friction / mass must be below 1"),
    ],
)
def test_sghmc_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SGHMC(regression, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"friction": {"w": torch.ones(2)}}, r"friction must be a number > 0 or a schedule, got dict"),
        ({"step_size": "fast"}, r"step_size must be a number > 0 or a schedule, got str"),
        ({"step_size": torch.tensor([0.1, 0.2])}, r"step_size must be a number > 0 or a schedule, got Tensor"),
    ],
)
def test_a_hyperparameter_that_is_not_a_number_is_named(kwargs, message):
    """A per-site friction is for the functional ``sghmc.update``; the kernel class names what it takes instead."""
    with pytest.raises(TypeError, match=message):
        SGHMC(regression, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_samples": 0}, r"num_samples must be an int >= 1, got 0"),
        ({"num_samples": -3}, r"num_samples must be an int >= 1"),
        ({"num_samples": 1.5}, r"num_samples must be an int >= 1, got 1.5"),
        ({"num_samples": True}, r"num_samples must be an int >= 1, got True"),
        ({"num_samples": 10, "num_warmup": -1}, r"num_warmup must be an int >= 0"),
        ({"num_samples": 10, "num_chains": 0}, r"num_chains must be an int >= 1"),
        ({"num_samples": 10, "thin": 0}, r"thin must be an int >= 1"),
        ({"num_samples": 10, "chain_method": "bogus"}, r"chain_method must be 'vectorized' or 'sequential'"),
        (
            {"num_samples": 10, "chain_method": "parallel"},
            r"chain_method='parallel' \(NumPyro's: one process per chain\) is not supported",
        ),
        ({"num_samples": 10, "on_divergence": "ignore"}, r"on_divergence must be 'continue' or 'stop'"),
    ],
)
def test_stochastic_mcmc_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StochasticMCMC(SGLD(regression, step_size=1e-3), **kwargs)


def test_stochastic_mcmc_needs_a_kernel():
    with pytest.raises(TypeError, match=r"kernel must be an engine such as SGLD"):
        StochasticMCMC(regression, num_samples=10)


def test_results_before_run():
    mcmc = StochasticMCMC(SGLD(regression, step_size=1e-3), num_samples=10, progress_bar=False)
    with pytest.raises(RuntimeError, match=r"call run\(...\) before"):
        mcmc.get_samples()


def test_a_float64_prior_on_float32_data_names_the_dtypes():
    x = torch.randn(N, 3)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", N, subsample_size=B) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

    with pytest.raises(ModelError, match=r"latent site 'w' is torch.float64 but argument 'x' is torch.float32"):
        ModelBridge(model, (x, x.sum(1)))


def test_a_prior_on_another_device_than_the_data_names_the_devices():
    """torch's message when a CPU prior meets CUDA data (read on an H100); a meta tensor stands in for the GPU here."""
    trace = pyro.poutine.Trace()
    value = torch.zeros(3, device="meta")
    trace.add_node("w", type="sample", fn=dist.Normal(0.0, 1.0), is_observed=False, value=value, cond_indep_stack=())
    error = RuntimeError(
        "Expected all tensors to be on the same device, but got mat is on cuda:0, different from other tensors on cpu"
    )
    with pytest.raises(ModelError, match=r"latent site 'w' is meta but argument 'x' is cpu.*set_default_device"):
        explain_mixed_tensors(trace, iter([("argument 'x'", torch.randn(N, 3))]), error)


def test_a_plain_outer_plate_around_a_subsampled_inner_one_is_accepted():
    """Rows indexed by a plain plate are not 'rows beyond the subsampled plate' (obs=y[:, j], y of 3 rows)."""
    y = torch.randn(3, N)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(3, 1), 1.0).to_event(2))
        with pyro.plate("rows", 3, dim=-2), pyro.plate("cols", N, subsample_size=B, dim=-1) as j:
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[:, j])

    bridge = ModelBridge(model, (y,))
    assert bridge.observed == {"obs": {-2: "rows", -1: "cols"}}
    assert list(bridge.plates) == ["cols"]
