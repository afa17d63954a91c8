"""Gold tier: every curvature structure fitted by the GGN pass, and its predictive, against brute force."""

from __future__ import annotations

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
