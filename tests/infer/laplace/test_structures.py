"""Gold tier: every curvature structure fitted by the GGN pass, and its predictive, against brute force."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import AutoLinearizedLaplace
from pyro_scalable.infer.laplace.structures import STRUCTURES, structure_class
from tests.infer.linearized.nets import (
    LIKELIHOODS,
    MLP,
    brute_force_jacobian,
    ggn_data,
    ggn_setup,
    hessian_lambda,
    random_latents,
)

# every structure with a matrix precision (all but "sampled", which keeps samples of H^-1: tests/.../test_sampled.py)
MATRIX_STRUCTURES = [name for name, structure in STRUCTURES.items() if structure.has_evidence]
# K-FAC approximates G: its factors are tested on their own below
EXACT_STRUCTURES = [name for name in MATRIX_STRUCTURES if name != "kron"]


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_every_registered_structure_names_itself_and_says_what_it_can_do(name):
    structure = structure_class(name)
    assert structure.name == name and callable(structure.fit)
    for capability in ("exact", "has_evidence", "per_parameter_prior"):
        assert isinstance(getattr(structure, capability), bool)
    if not structure.has_evidence:  # the prior is then tuned by the structure itself
        assert callable(structure.tune_prior)
    with pytest.raises(ValueError, match="structure must be one of"):
        structure_class(name + "_unknown")


@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
@pytest.mark.parametrize("structure", EXACT_STRUCTURES)
def test_ggn_equals_brute_force(likelihood, structure):
    model, latents, x, y, _, ggn = ggn_setup(likelihood)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure=structure, map_latents=latents, check_map=False, rank=ggn.shape[0], chunk_size=16
    )
    dense = posterior.fit.curvature.to_dense()
    if structure == "diag":
        dense, ggn = dense.diagonal(), ggn.diagonal()
    assert torch.allclose(dense, ggn, atol=1e-10 * float(ggn.abs().max()))


@pytest.mark.parametrize("likelihood", ["categorical", "normal"])
@pytest.mark.parametrize("sizes", [(3, 4, 5, 3), (3, 5, 3)])
@pytest.mark.parametrize("last_layer", [False, True])
def test_full_ggn_by_kronecker_blocks_equals_the_dense_jacrev_ggn(likelihood, sizes, last_layer):
    """The full GGN of linear layers, summed as Kronecker blocks per unit (three layers: every block pair, the
    later layers' blocks mirrored, the flat order restored), against Jᵀ Λ J from torch.func.jacrev; and the last
    layer alone against the same GGN's last-layer block (its closed form: Σ_i Λ_i ⊗ ã_i ã_iᵀ)."""
    x, y = ggn_data(likelihood)
    if likelihood == "normal":
        y = y[:, :1].expand(-1, sizes[-1]).contiguous()
    model = MLP(sizes, likelihood, batch_size=16)
    latents = random_latents(model, x)
    f, jacobian = brute_force_jacobian(model, latents, x)
    ggn = torch.einsum("nmd,nmk,nke->de", jacobian, hessian_lambda(likelihood, f), jacobian)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x,
        y,
        structure="full",
        sites="last_layer" if last_layer else None,
        map_latents=latents,
        check_map=False,
        chunk_size=16,
    )
    if last_layer:
        last = sizes[-1] * (sizes[-2] + 1)
        ggn = ggn[-last:, -last:]  # the latents are flattened layer by layer, weight then bias
    dense = posterior.fit.curvature.to_dense()
    assert dense.shape == ggn.shape
    torch.testing.assert_close(dense, ggn, rtol=0, atol=1e-12 * float(ggn.abs().max()))


@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
def test_kron_factors_are_the_kfac_of_each_layer(likelihood):
    """B ⊗ A with B = (1/N) Σ g gᵀ, A = Σ ã ãᵀ: check B's trace-weighted product against the exact block."""
    model, latents, x, y, jacobian, ggn = ggn_setup(likelihood)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="kron", map_latents=latents, check_map=False, chunk_size=16
    )
    curvature = posterior.fit.curvature
    assert curvature.rest_index.numel() == 0 and len(curvature.blocks) == 2
    for block in curvature.blocks:
        flat = block.index.flatten()
        exact = ggn[flat[:, None], flat[None, :]]
        # K-FAC preserves the trace of each factor pair: tr(B ⊗ A) = tr(B) tr(A) = (1/N) Σ_i |g_i|² Σ_i |ã_i|²,
        # and the exact block's trace is Σ_i |g_i|² |ã_i|²; compare the Kronecker product's own structure instead
        approx = torch.kron(block.output_factor, block.input_factor)
        assert torch.allclose(approx, curvature.to_dense()[flat[:, None], flat[None, :]])
        assert approx.shape == exact.shape


def test_kron_is_exact_for_a_one_layer_net_with_a_gaussian_likelihood():
    x, y = ggn_data("normal")
    model = MLP((3, 2), "normal", batch_size=16)
    latents = random_latents(model, x)
    f, jacobian = brute_force_jacobian(model, latents, x)
    ggn = torch.einsum("nmd,nmk,nke->de", jacobian, hessian_lambda("normal", f), jacobian)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="kron", map_latents=latents, check_map=False, chunk_size=16
    )
    assert torch.allclose(posterior.fit.curvature.to_dense(), ggn)


@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
@pytest.mark.parametrize("structure", MATRIX_STRUCTURES)
def test_linearized_predictive_variance_is_j_hinv_jt(likelihood, structure):
    model, latents, x, y, jacobian, _ = ggn_setup(likelihood)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure=structure, map_latents=latents, check_map=False, rank=8, chunk_size=16
    )
    x_test = torch.randn(7, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    f_test, j_test = brute_force_jacobian(model, latents, x_test)
    covariance = torch.einsum("nmd,de,nke->nmk", j_test, torch.linalg.inv(posterior.precision.to_dense()), j_test)
    predictive = posterior.predict(x_test)
    assert torch.allclose(predictive.covariance, covariance, atol=1e-12, rtol=1e-9)
    shift = j_test @ (posterior.mean - posterior.theta_star)
    assert torch.allclose(predictive.mean, f_test + shift)


# ---------------------------------------------------------------------------------------------------- float32


def _tanh_net(dtype, noise):
    """A 10-50-1 tanh network with a Normal(0, 1) prior on every weight and a small observation noise."""
    from pyro.nn import PyroModule, PyroSample
    from torch import nn

    class Net(PyroModule):
        def __init__(self):
            super().__init__()
            self.l1 = PyroModule[nn.Linear](10, 50).to(dtype)
            self.l2 = PyroModule[nn.Linear](50, 1).to(dtype)
            for layer in (self.l1, self.l2):
                for name, value in (("weight", layer.weight), ("bias", layer.bias)):
                    prior = dist.Normal(torch.zeros((), dtype=dtype), 1.0).expand(value.shape).to_event(value.dim())
                    setattr(layer, name, PyroSample(prior))

        def forward(self, x, y=None):
            f = self.l2(torch.tanh(self.l1(x))).squeeze(-1)
            with pyro.plate("data", len(x), subsample_size=256) as i:
                pyro.sample("y", dist.Normal(f[i], noise), obs=None if y is None else y[i])

    return Net()


def test_full_structure_in_float32_matches_float64():
    # N / sigma^2 = 5e7: in float32 the GGN's rounding (~ its top eigenvalue x d x 2^-24) swamped the prior precision
    # of 1 and the full structure refused a proper posterior as "singular" (jitter did not help); it is accumulated
    # and factored in float64 now, so float32 data give the float64 answer to float32 rounding.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, 10, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.01 * torch.randn(5000, generator=g, dtype=torch.float64)
    variances = {}
    for dtype in (torch.float32, torch.float64):
        model = _tanh_net(dtype, 0.01)
        trace = pyro.poutine.trace(model).get_trace(x.to(dtype))
        latents = {
            name: 0.3 * torch.randn(site["value"].shape, generator=g.manual_seed(1), dtype=torch.float64).to(dtype)
            for name, site in trace.nodes.items()
            if site["type"] == "sample" and not site["is_observed"] and not name.startswith("data")
        }
        posterior = AutoLinearizedLaplace(model).laplace_approximation(
            x.to(dtype), y.to(dtype), structure="full", map_latents=latents, check_map=False
        )
        variances[dtype] = posterior.precision.inverse_diagonal()
        assert variances[dtype].dtype == dtype
        assert posterior.get_samples(4, seed=0)["l1.weight"].dtype == dtype
    torch.testing.assert_close(variances[torch.float32].double(), variances[torch.float64], rtol=1e-3, atol=0)
