"""A Krylov basis cut by memory (``docs/math.rst``, "The Gram matrix and exact
eigenpairs", "A basis cut by memory"): the rule that sizes it and the solver that
runs with it.

Tolerances: the solver's contract, every pair within ``tol·λ_max`` of an
eigenvalue (``report.tolerance``; the matrices' own rounding ``n·ε·λ_max`` is far
below), as in ``test_solvers.py``.
"""

import pytest
import torch

from tests.fixtures.checks import assert_top_eigvals
from tests.fixtures.reference import psd_matrix
from vivit import InvalidArgumentError
from vivit.linalg.iterative import (
    MAX_RESTARTS,
    basis_capacity,
    block_krylov_eigh,
    minimum_capacity,
)
from vivit.linalg.top_k import fitting_basis_columns, iterative_workspace_bytes

SIZE = 600
SPECTRA = {
    "geometric": 0.9 ** torch.arange(SIZE, dtype=torch.float64),
    "harmonic": 1 / (1 + torch.arange(SIZE, dtype=torch.float64)),
    "square-root": (1 + torch.arange(SIZE, dtype=torch.float64)) ** -0.5,
}


@pytest.mark.parametrize("spectrum", list(SPECTRA))
@pytest.mark.parametrize("top_k", [1, 3])
def test_smallest_basis_converges_in_more_cycles(spectrum, top_k):
    """``k + 2·b`` columns: more cycles and products than the default basis, the
    same bound ``tol·λ_max``. The geometric spectrum at ``k = 1`` needs 67 cycles,
    more than ``MAX_RESTARTS + 1``: the cut basis may run as many blocks as the
    default (``cycle_budget``)."""
    evals = SPECTRA[spectrum]
    A = psd_matrix(evals)
    _, _, default = block_krylov_eigh(A.__matmul__, SIZE, top_k, dtype=torch.float64)
    least = minimum_capacity(top_k, top_k, SIZE)
    found, vectors, report = block_krylov_eigh(
        A.__matmul__, SIZE, top_k, dtype=torch.float64, max_columns=least
    )
    full = basis_capacity(top_k, SIZE)
    assert report.basis_columns == least and default.basis_columns == full
    assert report.basis_cut == f"basis cut to {least} of {full} columns by memory"
    assert default.basis_cut is None
    assert report.cycles > default.cycles and report.products > default.products
    assert report.tolerance == report.requested_tolerance  # no rounding floor
    assert_top_eigvals(found, evals.flip(0), report.tolerance)
    residual = (A @ vectors - vectors * found).norm(dim=0).max()
    assert residual <= report.tolerance * evals[0]
    if (spectrum, top_k) == ("geometric", 1):
        assert report.cycles > MAX_RESTARTS + 1


@pytest.mark.parametrize("top_k", [3, 5])
def test_a_cut_basis_is_not_judged_stagnant_by_the_default_basis_cycles(top_k):
    """A slowly decaying spectrum (``0.99^i``, ``n = 2000``) with ``k + 2·b``
    columns: a cycle adds one block, so three cycles without a new smallest
    residual are no stagnation; the window grows with the cycles
    (``cycle_budget``). With three cycles the solve stopped after 120 (``k = 3``)
    and 220 (``k = 5``) products; it meets ``tol·λ_max`` after about 2,000."""
    size = 2000
    evals = 0.99 ** torch.arange(size, dtype=torch.float64)
    least = minimum_capacity(top_k, top_k, size)
    found, vectors, report = block_krylov_eigh(
        lambda V: evals[:, None] * V,
        size,
        top_k,
        dtype=torch.float64,
        max_columns=least,
    )
    assert report.converged and report.basis_columns == least
    assert report.tolerance == report.requested_tolerance  # no rounding floor
    assert_top_eigvals(found, evals.flip(0), report.tolerance)
    residual = (evals[:, None] * vectors - vectors * found).norm(dim=0).max()
    assert residual <= report.tolerance * evals[0]


def test_a_limit_above_the_default_cuts_nothing():
    A = psd_matrix(SPECTRA["harmonic"])
    full = basis_capacity(3, SIZE)
    runs = [
        block_krylov_eigh(A.__matmul__, SIZE, 3, dtype=torch.float64, max_columns=m)
        for m in (None, full, 10 * full)
    ]
    for evals, vectors, report in runs[1:]:
        assert report == runs[0][2]
        assert torch.equal(evals, runs[0][0]) and torch.equal(vectors, runs[0][1])


def test_a_basis_below_the_smallest_is_refused():
    A = psd_matrix(SPECTRA["harmonic"])
    least = minimum_capacity(3, 3, SIZE)
    with pytest.raises(InvalidArgumentError, match=f"fewer than {least} columns"):
        block_krylov_eigh(
            A.__matmul__, SIZE, 3, dtype=torch.float64, max_columns=least - 1
        )


@pytest.mark.parametrize("params", [None, 0])
@pytest.mark.parametrize("top_k", [1, 10])
def test_fitting_columns_are_the_most_that_fit(params, top_k):
    """``m = min(default, the most columns whose workspace fits)``, at least
    ``k + 2·b``: a budget of exactly ``m`` columns' workspace gives ``m``, a byte
    less ``m − 1``."""
    size, dtype = 10**6, torch.float32
    width = top_k if params is not None else max(2 * top_k, top_k + 8)
    full, least = basis_capacity(width, size), minimum_capacity(top_k, width, size)

    def workspace(columns):
        return iterative_workspace_bytes(size, top_k, dtype, params, columns)

    assert workspace(None) == workspace(full)
    for budget, columns in [
        (10 * workspace(full), full),
        (workspace(full), full),
        (workspace(full) - 1, full - 1),
        (workspace(least + 7), least + 7),
        (workspace(least + 7) - 1, least + 6),
        (workspace(least), least),
        (workspace(least) - 1, least),  # the caller refuses what does not fit
        (0, least),
    ]:
        assert fitting_basis_columns(size, top_k, dtype, budget, params) == columns
