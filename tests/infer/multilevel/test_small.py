"""The blocks' elementwise linear algebra against LAPACK: factors, solves, products and their gradients, under
vmap, for every block size it unrolls and one it hands to LAPACK; a block that is not positive definite is
reported and gives finite values and gradients."""

import pytest
import torch
from torch.func import grad, vmap

from pyro_scalable.infer.multilevel import small


def blocks(p, n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    root = torch.randn(n, p, p, generator=gen, dtype=torch.float64)
    return root @ root.transpose(-1, -2) + 0.5 * torch.eye(p, dtype=torch.float64)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_factors_solves_and_products_match_lapack(p):
    a = blocks(p)
    b = torch.randn(6, p, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    factor, ok = small.cholesky(a)
    assert ok.all()
    torch.testing.assert_close(factor, torch.linalg.cholesky(a))
    torch.testing.assert_close(
        small.solve_lower(factor, b), torch.linalg.solve_triangular(factor, b[..., None], upper=False)[..., 0]
    )
    torch.testing.assert_close(
        small.solve_lower_transposed(factor, b),
        torch.linalg.solve_triangular(factor.mT, b[..., None], upper=True)[..., 0],
    )
    torch.testing.assert_close(small.cholesky_solve(b, factor), torch.linalg.solve(a, b))
    torch.testing.assert_close(small.matvec(a, b), (a @ b[..., None])[..., 0])

    def ours(x):
        f, _ = small.cholesky(x)
        return (small.cholesky_solve(b, f) ** 2).sum() + f.diagonal(dim1=-2, dim2=-1).log().sum()

    def lapack(x):
        f = torch.linalg.cholesky(x)
        return (torch.cholesky_solve(b[..., None], f)[..., 0] ** 2).sum() + f.diagonal(dim1=-2, dim2=-1).log().sum()

    # the gradients of a symmetric input agree on its symmetric part (LAPACK's reads one triangle)
    sym = lambda g: 0.5 * (g + g.mT)  # noqa: E731
    torch.testing.assert_close(sym(grad(ours)(a)), sym(grad(lapack)(a)))
    torch.testing.assert_close(vmap(lambda x: small.cholesky(x)[0])(a[None].expand(3, -1, -1, -1))[2], factor)


def test_a_block_that_is_not_positive_definite_is_reported_with_finite_values_and_gradients():
    a = blocks(3)
    a[2] = -a[2]
    factor, ok = small.cholesky(a)
    assert ok.tolist() == [True, True, False, True, True, True]
    torch.testing.assert_close(factor[2], torch.eye(3, dtype=torch.float64))
    gradient = grad(lambda x: small.cholesky(x)[0].sum())(a)
    assert torch.isfinite(gradient).all() and gradient[2].abs().max() == 0
