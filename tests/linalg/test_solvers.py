"""Iterative and matrix-free top-k solvers against the dense float64 GGN.

Tolerances (``docs/math.rst``, "Tolerances of the tests", "Iterative solvers"): the
iterative solvers guarantee ``‖G̃ũ − λũ‖ ≤ tol·λ_max`` (default ``tol = 1e-12`` in
float64), so each eigenvalue is within ``tol·λ_max`` of the reference (compared at
``EIGVAL_RTOL``, which covers the reference's own ``D·ε·λ_max``). A parameter-space
eigenvector ``e = V ũ / √λ`` then has the residual ``‖G e − λ e‖ ≤ √(λ_max/λ) ·
tol · λ_max`` and ``|e_iᵀe_j − δ_ij| ≤ 2·tol·λ_max/√(λ_i λ_j)`` (plus the check's
own ``D·ε``): ``eigvec_residual_bound`` and ``orthonormality_bound`` with ``tol``.
Quantities from the eigenvectors: ``EIGVEC_PRODUCT_REL`` (leading directions) of the
largest entry.
"""

import dataclasses
import warnings

import pytest
import torch

import vivit.eigenpairs
import vivit.sources.stored
from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    assert_within,
    flat_evecs,
    orthonormality_bound,
)
from tests.fixtures.problems import PROBLEMS, prepare, problem_ids, select
from tests.fixtures.reference import dense_ggn, psd_matrix
from vivit import (
    InvalidArgumentError,
    LowRankGGN,
    RoundingFloorWarning,
    SolverNotConvergedError,
)
from vivit.linalg import iterative
from vivit.linalg.group_products import gram_matmul
from vivit.linalg.iterative import (
    SolverReport,
    basis_capacity,
    block_krylov_eigh,
    default_block_size,
    default_tolerance,
)
from vivit.linalg.krylov_basis import orthonormalize
from vivit.linalg.top_k import IMPLICIT_BLOCK, leading_eigenpairs

ITERATIVE = ["gram_krylov", "factor_krylov"]
TOP_K = 3
DTYPE = torch.float64
#: Problems for MC and subsampling (every layer type, both losses and reductions).
VARIANTS = select(architecture=["mlp_tanh", "cnn", "conv1d", "batchnorm2d", "residual"])


def assert_leading_pairs(evals, evecs, G, top_k, nc):
    """Eigenvalues and eigenvectors against the dense reference (see module doc).

    Residuals and orthonormality within ``eigvec_residual_bound`` and
    ``orthonormality_bound`` with the solver's default ``tol`` (``nc``: the Gram
    matrix's rows ``N·C``).
    """
    reference = torch.linalg.eigvalsh(G)
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float64])
    assert evals.numel() <= top_k
    assert_eigenpairs(evals, evecs, G, nc, tol=default_tolerance(torch.float64))


# Solvers on the registry ------------------------------------------------------


@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_top_k_against_reference(problem):
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y)
    for solver in ITERATIVE:
        ggn = LowRankGGN(model, loss_func, (X, y), solver=solver)
        evals, evecs = ggn.eigh(top_k=TOP_K)
        assert_leading_pairs(evals, evecs, G, TOP_K, ggn.gram().shape[0])
        report = ggn.solver_report()
        assert report.solver == report.requested == solver
        assert report.converged and report.residual <= report.tolerance
        assert report.tolerance == default_tolerance(torch.float64)


@pytest.mark.parametrize("problem", VARIANTS, ids=problem_ids(VARIANTS))
@pytest.mark.parametrize(
    "options",
    [{"mc_samples": 2}, {"subsampling": [0, 2, 3]}],
    ids=["mc", "subsampled"],
)
def test_mc_and_subsampling(problem, options):
    model, loss_func, X, y = prepare(problem, torch.float64)
    generator = torch.Generator().manual_seed(3)
    dense = LowRankGGN(model, loss_func, (X, y), generator=generator, **options)
    # the MC estimate's reference is the dense solver on the same samples (the dense
    # solver is tested against torch.func in tests/lowrank/test_problems.py); exact
    # subsampling is compared with the reference GGN of the subset itself
    G = (
        dense_ggn(model, loss_func, X, y, subsampling=options["subsampling"])
        if "subsampling" in options
        else None
    )
    for solver in ITERATIVE:
        generator = torch.Generator().manual_seed(3)
        ggn = LowRankGGN(
            model, loss_func, (X, y), generator=generator, solver=solver, **options
        )
        evals, evecs = ggn.eigh(top_k=TOP_K)
        if G is not None:
            assert_leading_pairs(evals, evecs, G, TOP_K, dense.gram().shape[0])
        reference, reference_evecs = dense.eigh(top_k=TOP_K, solver="dense")
        scale = dense.eigvalsh().abs().max()
        assert_within(evals, reference, EIGVAL_RTOL[torch.float64] * scale)
        overlap = flat_evecs(evecs) @ flat_evecs(reference_evecs).T
        # |e_iᵀe_j| − δ_ij: the two sets' eigenvector errors (Davis-Kahan), each
        # within EIGVEC_PRODUCT_REL for the leading directions
        assert_within(
            overlap.abs(),
            torch.eye(len(evals), dtype=overlap.dtype),
            2 * EIGVEC_PRODUCT_REL,
        )


@pytest.mark.parametrize(
    "problem",
    select(architecture=["mlp_relu", "cnn", "residual"]),
    ids=problem_ids(select(architecture=["mlp_relu", "cnn", "residual"])),
)
def test_directional_and_newton_match_dense(problem):
    """``λ_nk`` and the Newton step do not depend on eigenvector signs; ``γ`` does."""
    model, loss_func, X, y = prepare(problem, torch.float64)
    dense = LowRankGGN(model, loss_func, (X, y), solver="dense")
    expected = dense.directional_derivatives(top_k=TOP_K)
    step = dense.newton_step(top_k=TOP_K, damping=0.1)
    for solver in ITERATIVE:
        ggn = LowRankGGN(model, loss_func, (X, y))
        directional = ggn.directional_derivatives(top_k=TOP_K, solver=solver)
        scale = expected.evals.abs().max()
        assert_within(directional.evals, expected.evals, EIGVAL_RTOL[DTYPE] * scale)
        assert_rel(directional.lambdas, expected.lambdas, EIGVEC_PRODUCT_REL)
        assert_rel(directional.gammas.abs(), expected.gammas.abs(), EIGVEC_PRODUCT_REL)
        for ours, theirs in zip(
            ggn.newton_step(top_k=TOP_K, damping=0.1, solver=solver), step, strict=True
        ):
            assert_rel(ours, theirs, EIGVEC_PRODUCT_REL)


def test_per_layer_groups_matrix_free():
    problem = select(architecture="cnn", loss="ce", reduction="sum")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    groups = [list(m.parameters(recurse=False)) for m in model.modules()]
    groups = [g for g in groups if g]
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=groups)
    for index, group in enumerate(groups):
        G = dense_ggn(model, loss_func, X, y, params=group)
        evals, evecs = ggn.eigh(top_k=2, group=index, solver="factor_krylov")
        assert_leading_pairs(evals, evecs, G, 2, ggn.gram(index).shape[0])


def test_float32_within_tolerance():
    problem = select(architecture="mlp_sigmoid", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float32)
    model64, loss64, X64, y64 = prepare(problem, torch.float64)
    reference = torch.linalg.eigvalsh(dense_ggn(model64, loss64, X64, y64))
    for solver in ITERATIVE:
        ggn = LowRankGGN(model, loss_func, (X, y), solver=solver)
        evals, evecs = ggn.eigh(top_k=TOP_K)
        assert evals.dtype == torch.float32 and evecs[0].dtype == torch.float32
        assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float32])
        assert ggn.solver_report().tolerance == default_tolerance(torch.float32)


def test_matrix_free_never_forms_the_gram(monkeypatch):
    def refuse(factors):
        raise AssertionError("the matrix-free solver formed the Gram matrix")

    monkeypatch.setattr(vivit.sources.stored, "group_gram", refuse)
    problem = select(architecture="conv1d", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    ggn = LowRankGGN(model, loss_func, (X, y), solver="factor_krylov")
    ggn.eigh(top_k=TOP_K)
    ggn.newton_step(top_k=TOP_K)
    num_params = sum(p.numel() for p in model.parameters())
    ggn.operator().pinv_matvec(torch.ones(num_params, dtype=X.dtype), top_k=TOP_K)
    with pytest.raises(AssertionError, match="formed the Gram"):
        ggn.eigh()  # all eigenpairs need the Gram matrix


def test_restarts_on_the_factors():
    """Small blocks and depth 1 force several Krylov cycles through ``V``."""
    problem = select(architecture="sequence_linear", loss="mse", reduction="sum")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y)
    ggn = LowRankGGN(model, loss_func, (X, y))
    factors = ggn._group(0).ggn_factors
    size = factors[0].num_rows

    def matmul(vectors):
        return gram_matmul(factors, vectors)

    evals, _, report = block_krylov_eigh(
        matmul, size, 2, dtype=torch.float64, block_size=2, depth=2, max_restarts=500
    )
    assert report.cycles > 2 and report.products < 500 * 4
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


# The solver itself --------------------------------------------------------------


def test_block_krylov_stops_as_soon_as_converged():
    """Rayleigh-Ritz after every block: a fast-decaying spectrum stops early.

    Checking only at the end of a cycle would multiply the full basis
    (``products == capacity``).
    """
    evals = torch.logspace(0, -8, 300, dtype=torch.float64)
    A = psd_matrix(evals)
    found, vectors, report = block_krylov_eigh(
        A.__matmul__, 300, 5, dtype=torch.float64
    )
    # within tol·λ_max ("Iterative solvers"; A's own rounding is D·ε·λ_max)
    assert report.tolerance == report.requested_tolerance  # no rounding floor
    assert_top_eigvals(found, evals.flip(0), report.tolerance)
    assert report.cycles == 1
    assert 0 < report.products < basis_capacity(default_block_size(5, 300), 300)
    residual = (A @ vectors - vectors * found).norm(dim=0).max()
    assert residual <= report.tolerance * evals[0]


@pytest.mark.parametrize("top_k", [1, 3, 6])
def test_block_krylov_multiple_eigenvalue(top_k):
    """A leading eigenvalue of multiplicity 5: the ``k`` leading copies are found.

    With block size ``b = k`` the Krylov space holds ``k`` directions of the
    eigenspace, enough for ``k ≤ 5``; for ``k = 6`` the next eigenvalue follows.
    """
    evals = torch.cat(
        [
            torch.full((5,), 2.0, dtype=torch.float64),
            torch.linspace(1, 0.01, 95, dtype=torch.float64),
        ]
    )
    A = psd_matrix(evals)
    found, vectors, report = block_krylov_eigh(
        A.__matmul__, 100, top_k, dtype=torch.float64
    )
    tol = report.tolerance
    assert tol == report.requested_tolerance  # tol·λ_max: no rounding floor
    assert_top_eigvals(found, evals.flip(0), tol)
    assert_within(
        vectors.T @ vectors,
        torch.eye(top_k, dtype=torch.float64),
        orthonormality_bound(found, evals[0].item(), 100, 100, tol),
    )


#: Spectra with multiple leading eigenvalues and the pairs asked for: three copies
#: of 2 above 1 (``k = 3``), and an MSE-like GGN ``Σ x xᵀ ⊗ I₃`` whose every
#: eigenvalue has three copies (``k = 7``).
MULTIPLE = {
    "copies": (torch.tensor([2.0, 2.0, 2.0, 1.0] + [0.01] * 96), 3),
    "kronecker": (torch.tensor([2.0] * 3 + [1.0] * 3 + [0.5] * 3 + [0.0] * 91), 7),
}


@pytest.mark.parametrize(
    ("case", "width"), [("copies", 2), ("kronecker", 2), ("kronecker", 3)]
)
def test_a_narrow_block_finds_every_copy_of_a_multiple_eigenvalue(case, width):
    """A block of ``b`` holds ``b`` copies of an eigenvalue; a cluster of ``b``
    equal Ritz values with smaller ones below is caught, and the solve with
    ``b = k`` returns every copy (``docs/math.rst``, "Narrow blocks")."""
    evals, top_k = MULTIPLE[case]
    A = psd_matrix(evals.double())
    found, _, report = block_krylov_eigh(
        A.__matmul__, 100, top_k, dtype=torch.float64, block_size=width
    )
    assert report.block_size == top_k and "agree within the residual bound" in (
        report.widened
    )
    assert_top_eigvals(found, evals.double().sort().values, report.tolerance)


@pytest.mark.parametrize("case", list(MULTIPLE))
def test_a_narrow_block_alone_misses_copies(monkeypatch, case):
    """Without the check, a block of 2 converges to eigenpairs that are not the
    leading ones: smaller eigenvalues take the place of unseen copies."""
    monkeypatch.setattr(iterative, "cluster_doubt", lambda *args: None)
    evals, top_k = MULTIPLE[case]
    A = psd_matrix(evals.double())
    found, vectors, report = block_krylov_eigh(
        A.__matmul__, 100, top_k, dtype=torch.float64, block_size=2
    )
    residual = (A @ vectors - vectors * found).norm(dim=0).max()
    assert residual <= report.tolerance * found.max()  # eigenpairs, but
    expected = evals.double().sort(descending=True).values[:top_k]
    assert (found.flip(0) - expected).abs().max() >= 0.5  # not the leading


def test_a_converged_cluster_widens_at_once(monkeypatch):
    """Three copies of the leading eigenvalue converge long before the rest: a
    block of 2 stops once two of them have converged above smaller Ritz values
    and widens at once, not after its own solve (``docs/math.rst``, "Narrow
    blocks"); the pairs are the reference's within ``tol·λ_max``."""
    evals = torch.cat(
        [
            torch.full((3,), 2.0, dtype=torch.float64),
            torch.linspace(1, 0, 297, dtype=torch.float64),
        ]
    )
    A = psd_matrix(evals)
    found, _, report = block_krylov_eigh(
        A.__matmul__, 300, 6, dtype=torch.float64, block_size=2
    )
    assert report.block_size == 6 and "2 Ritz values from 2 to 2" in report.widened
    assert_top_eigvals(found, evals.flip(0), report.tolerance)
    _, _, wide = block_krylov_eigh(A.__matmul__, 300, 6, dtype=torch.float64)
    narrow = report.products - wide.products
    # only the final check: the narrow solve runs to its end before widening
    final = iterative.cluster_doubt
    monkeypatch.setattr(
        iterative,
        "cluster_doubt",
        lambda theta, bound, width, converged=None: (
            None if converged is not None else final(theta, bound, width)
        ),
    )
    _, _, late = block_krylov_eigh(
        A.__matmul__, 300, 6, dtype=torch.float64, block_size=2
    )
    assert late.widened is not None
    assert narrow < (late.products - wide.products) / 2


@pytest.mark.parametrize(
    ("converged", "doubt"),
    [(None, True), ([True] * 4, True), ([False, True, True, True], True),
     ([True, False, True, True], False), ([True, True, True, False], True)],
)  # fmt: skip
def test_cluster_doubt_counts_converged_clusters_only(converged, doubt):
    """During a solve, only a cluster whose pairs have all converged counts;
    those below it need not have converged."""
    theta = torch.tensor([1.0, 2.0, 2.0, 4.0], dtype=torch.float64)
    mask = None if converged is None else torch.tensor(converged)
    found = iterative.cluster_doubt(theta, 1e-8, 2, mask)
    assert (found is not None) == doubt


def test_a_narrow_block_needs_fewer_products_on_a_simple_spectrum():
    """Distinct eigenvalues: nothing to doubt, the narrow blocks' pairs are
    returned, after fewer products the narrower the block (``IMPLICIT_BLOCK``
    = 2 against 3 and ``b = k``; ``docs/math.rst``, "Narrow blocks")."""
    evals = torch.linspace(1, 0, 300, dtype=torch.float64) ** 3
    A = psd_matrix(evals)
    products = []
    for width in (IMPLICIT_BLOCK, 3, None):
        found, vectors, report = block_krylov_eigh(
            A.__matmul__, 300, 10, dtype=torch.float64, block_size=width
        )
        assert report.widened is None and report.block_size == (width or 10)
        assert_top_eigvals(found, evals.flip(0), report.tolerance)
        residual = (A @ vectors - vectors * found).norm(dim=0).max()
        assert residual <= report.tolerance * found.max()
        products.append(report.products)
    assert products == sorted(set(products))  # strictly fewer, narrower


def test_a_multiple_eigenvalue_at_the_bottom_needs_no_wider_block():
    """Copies of the smallest returned eigenvalue displace nothing: the top 4 of
    ``3, 2.5, 2, 2, 2, 2, …`` are found with ``b = 2`` and returned."""
    evals = torch.cat(
        [
            torch.tensor([3.0, 2.5], dtype=torch.float64),
            torch.full((4,), 2.0, dtype=torch.float64),
            torch.linspace(1, 0.01, 94, dtype=torch.float64),
        ]
    )
    A = psd_matrix(evals)
    found, _, report = block_krylov_eigh(
        A.__matmul__, 100, 4, dtype=torch.float64, block_size=2
    )
    assert report.widened is None
    assert_top_eigvals(found, evals.flip(0), report.tolerance)


def test_a_narrow_block_on_an_operator_of_lower_rank():
    """Rank 2 and ``k = 6``: a block of 2 spans at most 4 directions, so the solve
    runs again with ``b = 6`` (two eigenvalues and four zeros)."""
    evals = torch.cat([torch.tensor([2.0, 1.0]), torch.zeros(48)]).double()
    A = psd_matrix(evals)
    found, _, report = block_krylov_eigh(
        A.__matmul__, 50, 6, dtype=torch.float64, block_size=2
    )
    assert "ran out" in report.widened and found.numel() == 6
    assert_top_eigvals(found, evals.flip(0), report.tolerance)


@pytest.mark.parametrize(
    ("theta", "width", "doubt"),
    [
        ([1.0, 2.0, 3.0], 3, None),  # b = k: always certain
        ([1.0, 2.0, 3.0, 4.0], 2, None),  # distinct
        ([1.0, 2.0, 2.0, 4.0], 2, "2 Ritz values"),  # a pair above the bottom
        ([1.0, 2.0, 2.0, 4.0], 3, None),  # a pair under a block of 3
        ([2.0, 2.0, 3.0, 4.0], 2, None),  # at the bottom
        ([1.0, 2.0, 2.0 + 1e-9, 2.0 - 1e-9, 4.0], 3, "3 Ritz values"),
        ([1.0, 2.0], 1, "ran out"),  # fewer than k = 3 below
    ],
)
def test_narrow_block_doubt(theta, width, doubt):
    """Clusters within ``2·tol·θ_max`` (here ``2e-8·4``) of at least ``b`` values
    with smaller ones below, or fewer pairs than asked for; any narrow block's
    pairs accepted at a rounding floor."""
    theta = torch.tensor(sorted(theta), dtype=torch.float64)
    top_k = 3 if doubt == "ran out" else theta.numel()
    report = SolverReport("gram_krylov", "gram_krylov", 0.0, 1e-8, True, 1, 1)
    report = dataclasses.replace(report, requested_tolerance=1e-8)
    found = iterative.narrow_block_doubt(theta, report, width, top_k)
    assert found is None if doubt is None else doubt in found
    floor = dataclasses.replace(report, tolerance=2e-8)  # accepted at 2ρ > tol
    found = iterative.narrow_block_doubt(theta, floor, width, top_k)
    assert (found is None) == (width >= top_k)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_krylov_thick_restarts(monkeypatch, dtype):
    """A slowly decaying spectrum needs restarts. Each restarts from about half a
    basis of Ritz vectors and goes on from the last remainder (not from the Ritz
    vectors' images, which rounded float32 products make a wide block of noise), so
    it converges in float32 too, and in fewer products than restarting from ``b``
    Ritz vectors."""
    evals = torch.linspace(1, 0, 600, dtype=torch.float64) ** 2
    A = psd_matrix(evals).to(dtype)
    found, vectors, report = block_krylov_eigh(A.__matmul__, 600, 3, dtype=dtype)
    assert report.cycles > 1
    # float32 products of a float32 A round below 100·ε₃₂: tol·λ_max, no floor
    assert report.tolerance == report.requested_tolerance
    torch.testing.assert_close(
        found.double(), evals[:3].flip(0), atol=report.tolerance, rtol=0
    )
    residual = (A @ vectors - vectors * found).norm(dim=0).max()
    assert residual <= report.tolerance * found.max()
    monkeypatch.setattr(iterative, "restart_size", lambda top_k, width, capacity: width)
    _, _, thin = block_krylov_eigh(A.__matmul__, 600, 3, dtype=dtype)
    assert report.products < thin.products


def cancelling_products(A, scale):
    """``U ↦ A U`` in float32 as ``(A + L) U − L U`` with ``‖L‖ = 2·scale``.

    The float32 rounding of the two large products, ``~ε₃₂·scale·‖U‖``, does not
    cancel: the mechanism of a float32 GGN-vector product ``Jᵀ H J v``, whose loss
    Hessian annihilates large parts of ``J v`` (``docs/math.rst``, "Implicit
    GGN-vector products", "Rounding of the products").
    """
    size = A.shape[0]
    L = psd_matrix(torch.linspace(1, 2, size, dtype=torch.float64), seed=1)
    summed, subtracted = (A + scale * L).float(), (scale * L).float()
    return lambda U: summed @ U - subtracted @ U


#: Four copies of the top eigenvalue and a cluster of six within 1 % below it.
CLUSTERED = torch.cat(
    [
        torch.ones(4, dtype=torch.float64),
        torch.linspace(0.999, 0.99, 6, dtype=torch.float64),
        torch.linspace(0.5, 0, 290, dtype=torch.float64) ** 2,
    ]
)


@pytest.mark.parametrize("scale", [100.0, 1000.0])
@pytest.mark.parametrize("top_k", [5, 10])
def test_block_krylov_stops_at_the_products_rounding_floor(scale, top_k):
    """Products rounded above the default tolerance, on a degenerate and clustered
    top: the residual estimate (exact arithmetic) falls below ``tol``, the
    confirmed residual stays at the images' rounding, and without the rounding
    floor the solver stagnated (SolverNotConvergedError). With it the pairs are
    accepted at ``2ρ`` and said so; against the exact float64 ``A`` they are within
    ``1.5·tolerance·λ_max`` (``docs/math.rst``, "The Gram matrix and exact
    eigenpairs", "Rounding floor of the products")."""
    A = psd_matrix(CLUSTERED)
    with pytest.warns(RoundingFloorWarning, match="rounding of the operator"):
        found, vectors, report = block_krylov_eigh(
            cancelling_products(A, scale), 300, top_k, dtype=torch.float32
        )
    assert report.converged and report.rounding is not None
    assert report.requested_tolerance == default_tolerance(torch.float32)
    assert report.tolerance == 2 * report.rounding > report.requested_tolerance
    bound = 1.5 * report.tolerance
    assert_top_eigvals(found, CLUSTERED.flip(0), bound)
    vectors, found = vectors.double(), found.double()
    residual = (A @ vectors - vectors * found).norm(dim=0).max()
    assert residual <= bound * CLUSTERED[0]


def test_block_krylov_measures_no_floor_for_exact_products():
    """Float64 products of the same matrix: the confirmation measures their
    rounding, far below ``tol`` (within the ``D·ε·λ_max`` of ``EIGVAL_RTOL``), and
    the pairs are accepted at ``tol``, without a warning."""
    A = psd_matrix(CLUSTERED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RoundingFloorWarning)
        found, _, report = block_krylov_eigh(A.__matmul__, 300, 10, dtype=torch.float64)
    assert 0 < report.rounding <= EIGVAL_RTOL[torch.float64]
    assert report.tolerance == report.requested_tolerance == default_tolerance(DTYPE)
    assert_top_eigvals(found, CLUSTERED.flip(0), report.tolerance)


@pytest.mark.parametrize(
    ("matrix_seed", "scale", "top_k"), [(3, 100.0, 1), (0, 30.0, 3), (0, 10.0, 3)]
)
def test_block_krylov_residual_holds_against_the_exact_operator(
    matrix_seed, scale, top_k
):
    """Products rounded about ``tol``: the images combined from the basis can pass
    at ``tol`` while the pairs' residual against the exact ``A`` is 2–3 times
    that. The pairs are confirmed with fresh products and accepted at
    ``max(tol, 2ρ)`` with ``ρ`` from the same products, so against the exact
    float64 ``A`` they are within ``1.5·tolerance·θ_max`` (``docs/math.rst``,
    "The Gram matrix and exact eigenpairs", "Rounding floor of the products"),
    with a warning exactly where the floor is above ``tol``."""
    A = psd_matrix(CLUSTERED, seed=matrix_seed)
    products = cancelling_products(A, scale)
    for seed in range(6):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found, vectors, report = block_krylov_eigh(
                products, 300, top_k, dtype=torch.float32, seed=seed
            )
        floor = 2 * report.rounding
        assert report.tolerance == max(report.requested_tolerance, floor)
        assert report.converged and report.residual <= report.tolerance
        warned = [w for w in caught if issubclass(w.category, RoundingFloorWarning)]
        assert len(warned) == (floor > report.requested_tolerance)
        vectors, found = vectors.double(), found.double()
        residual = (A @ vectors - vectors * found).norm(dim=0).max()
        assert residual <= 1.5 * report.tolerance * found.max()


def test_block_krylov_without_a_floor_stops_at_the_first_rounding_above_tol():
    """Without ``rounding_floor`` (a caller with an exact fallback) the first
    confirmation that measures ``2ρ > tol`` ends the solve: no residual of such
    products confirms ``tol`` against the exact operator (``docs/math.rst``,
    "Rounding floor of the products")."""
    A = psd_matrix(CLUSTERED)
    calls = []
    products = cancelling_products(A, 1000.0)
    with pytest.raises(SolverNotConvergedError, match="no residual they give"):
        block_krylov_eigh(
            lambda U: calls.append(U.shape[1]) or products(U),
            300,
            5,
            dtype=torch.float32,
            rounding_floor=False,
        )
    assert sum(calls) <= basis_capacity(5, 300) + 5  # one cycle, one confirmation


def test_block_krylov_refuses_a_floor_above_the_largest_eigenvalue():
    """Products rounded beyond ``λ_max`` resolve nothing: an error, not pairs."""
    A = psd_matrix(CLUSTERED)
    with pytest.raises(SolverNotConvergedError, match="measured rounding"):
        block_krylov_eigh(cancelling_products(A, 1e7), 300, 5, dtype=torch.float32)


@pytest.mark.parametrize("spread", [1.0, 1e-6])
def test_orthonormalize_to_working_precision(monkeypatch, spread):
    """A block orthonormalized against a basis is orthonormal and orthogonal to it
    within ``100·ε`` (:data:`~vivit.linalg.krylov_basis.SINGLE_SVQB_CONDITION`), with
    one SVQB where its Gram matrix is well conditioned (``spread = 1``) and a third
    projection where it is not (``spread = 1e-6``: columns nearly dependent after
    projection, which a single SVQB would leave ``√κ·ε`` off)."""
    generator = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(2000, 40, generator=generator).double())
    inside = basis @ torch.randn(40, 6, generator=generator).double()
    outside = torch.randn(2000, 6, generator=generator).double()
    outside[:, 3:] = outside[:, :3] + spread * outside[:, 3:]
    projections = []
    monkeypatch.setattr(
        torch.linalg,
        "eigh",
        lambda gram, _eigh=torch.linalg.eigh: projections.append(1) or _eigh(gram),
    )
    block, _ = orthonormalize(basis.T, (1e3 * inside + outside).T)
    bound = 100 * torch.finfo(torch.float64).eps
    assert (basis.T @ block.T).abs().max() <= bound  # one vector per row
    identity = torch.eye(block.shape[0], dtype=torch.float64)
    assert (block @ block.T - identity).abs().max() <= bound
    assert len(projections) == (1 if spread == 1.0 else 2)


def test_auto_prefers_the_dense_solver_to_a_rounding_floor():
    """Under "auto" a Gram route whose products round above ``tol`` falls back to
    the exact dense solver instead of accepting pairs at the floor; asked for by
    name, the matrix-free solver accepts them and warns."""
    A = psd_matrix(CLUSTERED)
    arguments = {"size": 300, "dtype": torch.float32, "device": torch.device("cpu")}
    products = cancelling_products(A, 1000.0)
    with pytest.warns(RuntimeWarning, match="Falling back to the dense solver"):
        evals, _, report = leading_eigenpairs(
            products, 5, "factor_krylov", A.float, requested="auto", **arguments
        )
    assert report.solver == "dense" and report.rounding is None
    assert_top_eigvals(evals, CLUSTERED.flip(0), EIGVAL_RTOL[torch.float32])
    with pytest.warns(RoundingFloorWarning):
        _, _, report = leading_eigenpairs(
            products,
            5,
            "factor_krylov",
            A.float,
            requested="factor_krylov",
            **arguments,
        )
    assert report.solver == "factor_krylov" and report.rounding is not None


def test_block_krylov_deterministic_for_a_seed():
    A = psd_matrix(torch.linspace(1, 0, 120, dtype=torch.float64) ** 4)
    first = block_krylov_eigh(A.__matmul__, 120, 4, dtype=torch.float64, seed=7)
    second = block_krylov_eigh(A.__matmul__, 120, 4, dtype=torch.float64, seed=7)
    other = block_krylov_eigh(A.__matmul__, 120, 4, dtype=torch.float64, seed=8)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    # either seed within tol·λ_max of the eigenvalues
    assert_within(first[0], other[0], 2 * first[2].tolerance * first[0].max())


def test_block_krylov_rank_deficient():
    """An invariant Krylov space (rank 4 < block) ends the iteration exactly."""
    generator = torch.Generator().manual_seed(0)
    B = torch.randn(40, 4, generator=generator, dtype=torch.float64)
    A = B @ B.T
    found, _, report = block_krylov_eigh(A.__matmul__, 40, 6, dtype=torch.float64)
    # within tol·λ_max, the dense reference within EIGVAL_RTOL·λ_max
    reference = torch.linalg.eigvalsh(A)
    assert_top_eigvals(found, reference, report.tolerance + EIGVAL_RTOL[torch.float64])
    assert report.cycles == 1


def test_block_krylov_zero_matrix():
    found, vectors, report = block_krylov_eigh(
        lambda U: torch.zeros_like(U), 30, 3, dtype=torch.float64
    )
    assert (found == 0).all() and vectors.shape == (30, 3)
    assert report.converged


def test_block_krylov_refuses_a_bound_that_accepts_anything():
    """``tol ≥ 1`` would accept Ritz pairs that are not the leading eigenpairs."""
    A = psd_matrix(torch.linspace(1, 0, 50, dtype=torch.float64))
    for tol in [1.0, 5.0, float("inf"), float("nan"), 0.0, True, "1e-3"]:
        with pytest.raises(InvalidArgumentError, match="tol must be a number"):
            block_krylov_eigh(A.__matmul__, 50, 2, dtype=torch.float64, tol=tol)
    with pytest.raises(InvalidArgumentError, match="seed must be an integer"):
        block_krylov_eigh(A.__matmul__, 50, 2, dtype=torch.float64, seed=2**70)


def test_block_krylov_not_converged():
    A = psd_matrix(torch.linspace(1, 0.9, 200, dtype=torch.float64))
    with pytest.raises(SolverNotConvergedError, match="solver='dense'"):
        block_krylov_eigh(
            A.__matmul__,
            200,
            3,
            dtype=torch.float64,
            block_size=3,
            depth=1,
            max_restarts=2,
        )


def test_auto_falls_back_to_dense(monkeypatch):
    """Under "auto" a solve that does not converge warns and uses the dense one."""
    monkeypatch.setattr(
        vivit.eigenpairs, "choose_solver", lambda *a, **k: "gram_krylov"
    )
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    ggn = LowRankGGN(model, loss_func, (X, y), solver_tol=1e-300)
    with pytest.warns(RuntimeWarning, match="Falling back to the dense solver"):
        evals, _ = ggn.eigh(top_k=TOP_K)
    report = ggn.solver_report()
    assert report.solver == "dense" and report.requested == "auto"
    assert "did not reach" in report.fallback
    assert_top_eigvals(
        evals,
        torch.linalg.eigvalsh(dense_ggn(model, loss_func, X, y)),
        EIGVAL_RTOL[torch.float64],
    )
    # a named solver never falls back: it stops at the products' rounding floor
    # (twice ρ, with a warning), or raises where its residual stays above that
    explicit = LowRankGGN(model, loss_func, (X, y), solver_tol=1e-300)
    try:
        with pytest.warns(RoundingFloorWarning):
            explicit.eigh(top_k=TOP_K, solver="gram_krylov")
    except SolverNotConvergedError as error:
        assert "did not reach" in str(error)
    else:
        report = explicit.solver_report()
        assert report.solver == "gram_krylov" and report.fallback is None
        assert report.residual <= report.tolerance == 2 * report.rounding


def test_leading_eigenpairs_reports_dense_residual():
    """The dense solver reports the residual of the pairs it returns, at most
    ``N·C·ε·λ_max`` relative to ``λ_max`` (``docs/math.rst``, "Precision and the
    numerical zero", "Without the Gram matrix": LAPACK is backward stable)."""
    size = 50
    spectrum = torch.logspace(0, -3, size, dtype=torch.float64)
    A = psd_matrix(spectrum)
    evals, evecs, report = leading_eigenpairs(
        [],
        3,
        "dense",
        lambda: A,
        size=size,
        requested="dense",
        dtype=torch.float64,
        device=torch.device("cpu"),
    )
    assert report.tolerance is None and evals.numel() == 3
    assert_top_eigvals(evals, spectrum.flip(0), EIGVAL_RTOL[torch.float64])
    bound = size * torch.finfo(torch.float64).eps
    assert 0 <= report.residual <= bound
    # the report is the returned pairs' residual: the same products and norms of
    # the same numbers, bit for bit
    residual = (A @ evecs - evecs * evals).norm(dim=0).max() / evals.max()
    assert report.residual == residual.item()


# Misuse -----------------------------------------------------------------------


def test_bad_solver_arguments():
    problem = PROBLEMS[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    with pytest.raises(ValueError, match="solver must be one of"):
        LowRankGGN(model, loss_func, (X, y), solver="lanczos")
    with pytest.raises(ValueError, match="solver_tol"):
        LowRankGGN(model, loss_func, (X, y), solver_tol=0)
    for seed in [1.5, None, 2**64, -(2**63) - 1]:  # refused at once, not in eigh
        with pytest.raises(ValueError, match="solver_seed"):
            LowRankGGN(model, loss_func, (X, y), solver_seed=seed)
    ggn = LowRankGGN(model, loss_func, (X, y))
    with pytest.raises(ValueError, match="pass top_k"):
        ggn.eigh(solver="factor_krylov")
    for solver in ["cg", ["dense"]]:  # a list, unhashable, is refused by name too
        with pytest.raises(ValueError, match="solver must be one of"):
            ggn.newton_step(top_k=2, solver=solver)
    assert ggn.solver_report() is None
    with pytest.raises(IndexError):
        ggn.solver_report(group=3)
