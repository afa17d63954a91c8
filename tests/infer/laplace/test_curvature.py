"""Exact tier: every curvature structure's algebra against dense linear algebra (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from pyro_scalable.infer.laplace.curvature import CurvatureError
from pyro_scalable.infer.laplace.structures import (
    STRUCTURES,
    DiagCurvature,
    FullCurvature,
    KronBlock,
    KronCurvature,
    LowRankCurvature,
)

D = torch.float64
# every structure with a matrix precision ("sampled" keeps samples of H^-1 instead: test_sampled.py)
MATRIX_STRUCTURES = [name for name, structure in STRUCTURES.items() if structure.has_evidence]


def _spd(n, g, rank=None):
    a = torch.randn(n, rank or n, generator=g, dtype=D)
    return a @ a.T


def _structures(g):
    d = 11
    full = FullCurvature(_spd(d, g))
    diag = DiagCurvature(torch.rand(d, generator=g, dtype=D))
    q = torch.linalg.qr(torch.randn(d, 3, generator=g, dtype=D)).Q
    low = LowRankCurvature(q, torch.tensor([5.0, 2.0, 0.5], dtype=D))
    # one layer with 2 outputs and 3 inputs (+ bias): indices 0..7 scattered, the rest diagonal
    index = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]])
    block = KronBlock(index, _spd(2, g), _spd(4, g))
    kron = KronCurvature([block], torch.tensor([8, 9, 10]), torch.rand(3, generator=g, dtype=D), d)
    structures = {"full": full, "diag": diag, "low_rank": low, "kron": kron}
    assert set(structures) == set(MATRIX_STRUCTURES)
    return structures


def _dense_kron(kron):
    dense = torch.zeros(kron.num_params, kron.num_params, dtype=D)
    for block in kron.blocks:
        flat = block.index.flatten()
        dense[flat[:, None], flat[None, :]] = torch.kron(block.output_factor, block.input_factor)
    dense[kron.rest_index, kron.rest_index] = kron.rest_diagonal
    return dense


@pytest.mark.parametrize("name", MATRIX_STRUCTURES)
@pytest.mark.parametrize("prior", ["scalar", "per_input"])
def test_precision_matches_dense(name, prior):
    g = torch.Generator().manual_seed(1)
    curvature = _structures(g)[name]
    if name == "kron":
        assert torch.allclose(curvature.to_dense(), _dense_kron(curvature))
    d = curvature.num_params
    if prior == "scalar":
        prior_precision = torch.full((d,), 0.7, dtype=D)
    else:  # equal across a layer's outputs, different per input column (weight vs bias), as K-FAC requires
        prior_precision = torch.tensor([0.5, 0.5, 0.9, 0.9, 1.3, 1.3, 2.0, 2.0, 0.4, 0.6, 0.8], dtype=D)
    scale = 1.7
    precision = curvature.precision(prior_precision, scale)
    dense = scale * curvature.to_dense() + torch.diag(prior_precision)
    assert torch.allclose(precision.to_dense(), dense)
    v = torch.randn(4, d, generator=g, dtype=D)
    assert torch.allclose(precision.matvec(v), v @ dense)
    assert torch.allclose(precision.solve(v), torch.linalg.solve(dense, v.T).T)
    assert math.isclose(float(precision.logdet()), float(torch.logdet(dense)), rel_tol=1e-10)
    assert torch.allclose(precision.inverse_diagonal(), torch.linalg.inv(dense).diagonal())


@pytest.mark.parametrize("name", MATRIX_STRUCTURES)
def test_samples_have_the_inverse_covariance(name):
    """Sampling is a deterministic map of the noise: its covariance is exactly H^{-1} (checked via the map)."""
    g = torch.Generator().manual_seed(2)
    curvature = _structures(g)[name]
    d = curvature.num_params
    precision = curvature.precision(torch.full((d,), 0.7, dtype=D), 1.3)
    # draws are linear in the standard-normal noise: recover the linear map from d + 1 seeded draws
    draws = precision.sample(20000, torch.Generator().manual_seed(3))
    covariance = torch.cov(draws.T)
    target = torch.linalg.inv(precision.to_dense())
    # Monte-Carlo error of a covariance entry: sqrt((S_ii S_jj + S_ij^2) / n)
    se = ((target.diagonal()[:, None] * target.diagonal()[None, :] + target**2) / draws.shape[0]).sqrt()
    assert ((covariance - target).abs() / se).max() < 5.0


@pytest.mark.parametrize("prior", ["scalar", "per_input"])
def test_gradients_flow_to_the_prior_and_scale(prior):
    g = torch.Generator().manual_seed(4)
    start = torch.zeros(11, dtype=D)
    if prior == "per_input":
        start = torch.cat([torch.tensor([0.1, 0.1, -0.3, -0.3, 0.5, 0.5, 0.2, 0.2], dtype=D), torch.zeros(3, dtype=D)])
    for curvature in _structures(g).values():
        d = curvature.num_params
        log_prior = start.clone().requires_grad_(True)
        log_scale = torch.zeros((), dtype=D, requires_grad=True)
        precision = curvature.precision(log_prior.exp(), log_scale.exp())
        v = torch.ones(d, dtype=D)
        (precision.logdet() + (v * precision.solve(v)).sum()).backward()
        dense_prior = start.clone().requires_grad_(True)
        dense_scale = torch.zeros((), dtype=D, requires_grad=True)
        dense = dense_scale.exp() * curvature.to_dense() + torch.diag(dense_prior.exp())
        (torch.logdet(dense) + v @ torch.linalg.solve(dense, v)).backward()
        if isinstance(curvature, KronCurvature):
            # K-FAC ties a layer's prior across outputs (and, when it is one value, across the layer): the
            # derivative along the tied directions is what must agree
            columns = curvature.blocks[0].index.T
            tied = columns.flatten() if prior == "scalar" else columns
            assert torch.allclose(log_prior.grad[tied].sum(-1), dense_prior.grad[tied].sum(-1))
            rest = curvature.rest_index
            assert torch.allclose(log_prior.grad[rest], dense_prior.grad[rest])
        else:
            assert torch.allclose(log_prior.grad, dense_prior.grad)
        assert torch.allclose(log_scale.grad, dense_scale.grad)


def test_singular_precision_is_a_clear_error():
    d = 4
    with pytest.raises(CurvatureError, match="singular"):
        DiagCurvature(torch.tensor([1.0, 0.0, 2.0, 3.0], dtype=D)).precision(torch.zeros(d, dtype=D))
    with pytest.raises(CurvatureError, match="singular"):
        FullCurvature(torch.ones(d, d, dtype=D)).precision(torch.zeros(d, dtype=D))
    with pytest.raises(CurvatureError, match="same for all of the layer's outputs"):
        block = KronBlock(torch.tensor([[0, 1], [2, 3]]), torch.eye(2, dtype=D), torch.eye(2, dtype=D))
        KronCurvature([block], torch.tensor([], dtype=torch.long), torch.zeros(0, dtype=D), 4).precision(
            torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=D)
        )
