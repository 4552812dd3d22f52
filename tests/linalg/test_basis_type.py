"""The Krylov basis in the products' type, its inner products in float64.

Bounds (``docs/math.rst``, "Implicit GGN-vector products", "The basis' type"):
stored float32 rows are within ``‖Q̃ Q̃ᵀ − I‖₂ ≤ 2u√m + u²m`` (``u = ε₃₂/2``) of
orthonormal, plus the float64 basis' own ``100·ε₆₄``
(:data:`~vivit.linalg.krylov_basis.SINGLE_SVQB_CONDITION`); Rayleigh-Ritz in the
stored rows' Gram matrix gives Ritz vectors orthonormal to float64 rounding
(``m·ε₆₄`` per Cholesky and eigh of a matrix near ``I``, a few of them: ``10·m·ε₆₄``).
The solver's contract is unchanged: pairs within ``1.5·tolerance·λ_max`` of the exact
operator's ("Rounding floor of the products").
"""

import pytest
import torch

from tests.fixtures.reference import psd_matrix
from vivit.linalg import krylov_basis
from vivit.linalg.iterative import block_krylov_eigh
from vivit.linalg.krylov_basis import KrylovBasis, orthonormalize

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
SIZE = 20_000


def slow_decay(size, dtype):
    """``U ↦ A U`` for diagonal ``A`` (eigenvalues ``(1 + i)^{-1/2}``) in ``dtype``."""
    evals = (1 + torch.arange(size, dtype=torch.float64)) ** -0.5
    return evals, lambda U: evals.to(dtype).unsqueeze(1) * U


def filled_basis(dtype, capacity=63, width=3):
    """A basis of ``capacity`` rows of the Krylov space of :func:`slow_decay`."""
    _, matmul = slow_decay(SIZE, dtype)
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(width, SIZE, generator=generator, dtype=torch.float64)
    block, _ = orthonormalize(None, start)
    basis = KrylovBasis(capacity, SIZE, dtype, torch.device("cpu"))
    while block is not None and block.shape[0] <= basis.room:
        basis.append(block, matmul(block.to(dtype).T).T)
        block, _ = basis.expansion()
    return basis


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stored_rows_are_orthonormal_within_the_bound(dtype):
    """A float32 basis of ``D = 20,000`` entries: within ``2u√m + u²m`` of
    orthonormal, which float32 inner products (rounding at ``ε₃₂√D``, 140 ``ε₃₂``
    here) would miss; float64 products keep a float64 basis, at ``100·ε₆₄``."""
    basis = filled_basis(dtype)
    rows = basis._basis_rows
    assert rows.dtype == dtype and basis.room == 0
    m, u = rows.shape[0], torch.finfo(dtype).eps / 2
    bound = 2 * u * m**0.5 + u**2 * m + 100 * EPS64
    gram = rows.double() @ rows.double().T
    assert torch.linalg.matrix_norm(gram - torch.eye(m).double(), ord=2) <= bound
    # the Gram matrix Rayleigh-Ritz uses is the stored rows', in float64
    torch.testing.assert_close(basis._gram[:m, :m], gram, rtol=0, atol=SIZE * EPS64)


def test_ritz_vectors_are_orthonormal_in_the_stored_rows():
    """Rows off orthonormal by ``10⁻⁶`` (far beyond float32 rounding): the Ritz
    vectors ``Q̃ᵀ s`` are orthonormal to float64 rounding, and their Ritz values
    are the eigenvalues of the invariant subspace the rows span."""
    size, m = 300, 12
    evals = torch.linspace(1, 0.1, size, dtype=torch.float64)
    A = psd_matrix(evals)
    eigenvectors = torch.linalg.eigh(A).eigenvectors[:, -m:]  # the leading m
    generator = torch.Generator().manual_seed(1)
    mixing, _ = torch.linalg.qr(torch.randn(m, m, generator=generator).double())
    scales = 1 + 1e-6 * torch.randn(m, 1, generator=generator).double()
    rows = scales * (eigenvectors @ mixing).T
    basis = KrylovBasis(m, size, torch.float64, torch.device("cpu"))
    basis.append(rows, rows @ A)
    theta, coefficients = basis.rayleigh_ritz(m)
    vectors = coefficients.T @ rows
    bound = 10 * m * EPS64
    identity = torch.eye(m, dtype=torch.float64)
    assert (vectors @ vectors.T - identity).abs().max() <= bound
    torch.testing.assert_close(theta, evals[:m].flip(0), rtol=0, atol=bound)


def test_a_float32_operator_within_the_tolerance():
    """Float32 products with restarts (``k = 5``, slow decay, depth 3): every pair
    within ``1.5·tolerance·λ_max`` of the exact float64 operator's, the
    eigenvectors orthonormal within their float32 rounding ``2u + u²`` (plus
    float64 rounding)."""
    size = 3000
    evals, matmul32 = slow_decay(size, torch.float32)
    found, vectors, report = block_krylov_eigh(
        matmul32, size, 5, dtype=torch.float32, depth=3
    )
    assert report.cycles > 1
    assert found.dtype == vectors.dtype == torch.float32
    bound = 1.5 * report.tolerance
    torch.testing.assert_close(found.double(), evals[:5].flip(0), rtol=0, atol=bound)
    vectors, found = vectors.double(), found.double()
    residual = (evals.unsqueeze(1) * vectors - vectors * found).norm(dim=0).max()
    assert residual <= bound * evals[0]
    identity = torch.eye(5, dtype=torch.float64)
    u = EPS32 / 2
    orthonormality = (vectors.T @ vectors - identity).abs().max()
    assert orthonormality <= 2 * u + u**2 + 100 * EPS64


def test_inner_products_accumulate_in_float64():
    """Float32 rows: their inner products accumulated in float64 are within
    ``D·ε₆₄`` of the exact ones (relative to the rows' norms); float32 accumulation
    rounds at about ``ε₃₂·√D``, four orders above."""
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(4, SIZE, generator=generator)
    other = torch.randn(2, SIZE, generator=generator)
    exact = rows.double() @ other.double().T
    result = krylov_basis.inner(rows, other, rows[:1])
    assert result.dtype == torch.float64
    expected = torch.cat([exact, rows.double() @ rows[:1].double().T], 1)
    scale = rows.double().norm(dim=1, keepdim=True) * torch.cat(
        [other, rows[:1]]
    ).double().norm(dim=1)
    assert ((result - expected).abs() / scale).max() <= SIZE * EPS64
