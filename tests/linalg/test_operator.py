"""The GGN operator (``G·v``, ``G⁺·v``, scipy) against the dense float64 GGN.

Tolerances (float64, ``docs/math.rst``, "Tolerances of the tests"): ``G v = V (Vᵀ
v)`` sums the dense product's terms in another order, ``REORDERED_REL`` of the
largest entry. The pseudo-inverse on the top ``K`` eigenspace, ``Σ_k e_k e_kᵀ v /
λ_k``, inherits the eigenvector errors: ``EIGVEC_PRODUCT_REL`` relative to
``‖v‖/λ_K`` for the leading pairs, ``DIRECTION_REL`` where every pair enters.
"""

import numpy
import pytest
import torch
from scipy.sparse.linalg import eigsh

from tests.fixtures.checks import (
    DIRECTION_REL,
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    EIGVEC_PRODUCT_REL32,
    REORDERED_REL,
    assert_rel,
    assert_within,
    factor_product_bound,
    flat_evecs,
    record,
)
from tests.fixtures.problems import PROBLEMS, prepare, problem_ids, select
from tests.fixtures.reference import dense_ggn
from vivit import LowRankGGN

#: Every architecture with both losses and both reductions (one loss per reduction).
COVER = [p for p in PROBLEMS if p.loss == ("ce" if p.reduction == "mean" else "mse")]
TOP_K = 2
#: ARPACK's relative tolerance on the Ritz values (an iterative solver: its tol).
EIGSH_TOL = 1e-12


def top_pinv(G, top_k):
    evals, evecs = torch.linalg.eigh(G)
    evals, evecs = evals[-top_k:], evecs[:, -top_k:]
    return (evecs / evals) @ evecs.T, evals


@pytest.mark.parametrize("problem", COVER, ids=problem_ids(COVER))
def test_against_dense_ggn(problem):
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y)
    D = G.shape[0]
    op = LowRankGGN(model, loss_func, (X, y)).operator()
    assert op.shape == (D, D) and op.dtype == torch.float64
    generator = torch.Generator().manual_seed(0)
    V = torch.randn(D, 3, generator=generator, dtype=torch.float64)
    scale = G.norm(2)

    # G·v: one vector, several columns, parameter-list formats
    assert_rel(op.matvec(V[:, 0]), G @ V[:, 0], REORDERED_REL)
    assert_rel(op.matvec(V), G @ V, REORDERED_REL)
    params = list(model.parameters())
    as_list = [
        t.reshape(p.shape)
        for t, p in zip(V[:, 0].split([p.numel() for p in params]), params, strict=True)
    ]
    result = op.matvec(as_list)
    assert [r.shape for r in result] == [p.shape for p in params]
    assert_rel(torch.cat([r.flatten() for r in result]), G @ V[:, 0], REORDERED_REL)
    batched = op.matvec([t.unsqueeze(0).expand(2, *t.shape) for t in as_list])
    assert [r.shape for r in batched] == [(2, *p.shape) for p in params]

    # G⁺·v on the leading eigenspace
    pinv, evals = top_pinv(G, TOP_K)
    expected = pinv @ V
    tolerance = EIGVEC_PRODUCT_REL * V.norm() / evals[0]
    assert_within(op.pinv_matvec(V, top_k=TOP_K), expected, tolerance)

    # scipy
    linear = op.to_scipy()
    assert linear.shape == (D, D) and linear.dtype == numpy.float64
    assert_rel(torch.from_numpy(linear @ V.numpy()), G @ V, REORDERED_REL)
    v0 = V[:, 0].numpy()
    assert_rel(torch.from_numpy(linear.matvec(v0)), G @ V[:, 0], REORDERED_REL)
    assert_rel(torch.from_numpy(linear.rmatvec(v0)), G @ V[:, 0], REORDERED_REL)
    # ARPACK's Ritz values within tol relative, the reference within EIGVAL_RTOL
    top = eigsh(linear, k=TOP_K, return_eigenvectors=False, tol=EIGSH_TOL)
    assert_within(
        torch.from_numpy(numpy.sort(top)),
        evals,
        EIGSH_TOL * evals + EIGVAL_RTOL[torch.float64] * scale,
    )
    pinv_linear = op.pinv_to_scipy(top_k=TOP_K)
    assert_within(torch.from_numpy(pinv_linear @ V.numpy()), expected, tolerance)


@pytest.mark.parametrize(
    "problem",
    select(architecture=["cnn", "residual"]),
    ids=problem_ids(select(architecture=["cnn", "residual"])),
)
@pytest.mark.parametrize(
    "options", [{"mc_samples": 2}, {"subsampling": [1, 3]}], ids=["mc", "subsampled"]
)
def test_mc_and_subsampling(problem, options):
    """Against the eigendecomposition (dense solver, tested against torch.func)."""
    model, loss_func, X, y = prepare(problem, torch.float64)
    generator = torch.Generator().manual_seed(1)
    ggn = LowRankGGN(model, loss_func, (X, y), generator=generator, **options)
    evals, evecs = ggn.eigh()
    E = flat_evecs(evecs).T  # [D, K]
    G = (E * evals) @ E.T
    if "subsampling" in options:
        G_ref = dense_ggn(model, loss_func, X, y, subsampling=options["subsampling"])
        # G from the eigenpairs: products with eigenvectors of every direction
        assert_within(G, G_ref, DIRECTION_REL * G_ref.norm(2))
    D = E.shape[0]
    V = torch.randn(
        D, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    op = ggn.operator()
    # the same eigenpairs on both sides: G·v sums the same terms in another order
    assert_rel(op.matvec(V), G @ V, REORDERED_REL)
    pinv = (E / evals) @ E.T  # every non-zero eigenpair: the pseudo-inverse
    assert_within(op.pinv_matvec(V), pinv @ V, DIRECTION_REL * V.norm() / evals.min())
    for solver in ("gram_krylov", "factor_krylov"):
        top = (E[:, -TOP_K:] / evals[-TOP_K:]) @ E[:, -TOP_K:].T
        assert_within(
            op.pinv_matvec(V, top_k=TOP_K, solver=solver),
            top @ V,
            EIGVEC_PRODUCT_REL * V.norm() / evals[-TOP_K],
        )


def test_float32_and_misuse():
    problem = select(architecture="mlp_relu", loss="ce", reduction="sum")[0]
    model, loss_func, X, y = prepare(problem, torch.float32)
    op = LowRankGGN(model, loss_func, (X, y)).operator()
    D = op.shape[0]
    assert op.matvec(torch.ones(D, dtype=torch.float64)).dtype == torch.float32
    assert op.to_scipy().dtype == numpy.float32
    with pytest.raises(ValueError, match=f"flat vector \\[{D}\\]"):
        op.matvec(torch.ones(D + 1))
    with pytest.raises(ValueError, match="one tensor per parameter"):
        op.matvec([torch.ones(3)])
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        op.pinv_matvec(torch.ones(D), top_k=0)


def test_float32_model_with_float64_gram():
    """A float32 model with ``gram_dtype=float64``: float32 vectors in and out.

    The products run in float64 from float32 factors, so they carry only the
    factors' rounding: ``G v`` within ``factor_product_bound(‖G‖·‖v‖)`` (``2c·ε₃₂``,
    ``docs/math.rst``, "Float32 factors") of the float64 dense GGN.
    """
    problem = COVER[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y)
    model32 = model.float()
    ggn = LowRankGGN(model32, loss_func, (X.float(), y), gram_dtype=torch.float64)
    op = ggn.operator()
    assert op.dtype == torch.float32
    v = torch.randn(G.shape[0], generator=torch.Generator().manual_seed(0))
    result = op.matvec(v)
    assert result.dtype == torch.float32
    scale = G.norm(2) * v.norm()
    assert_within(result.double(), G @ v.double(), factor_product_bound(scale.item()))
    pinv = op.pinv_matvec(v, top_k=TOP_K)
    assert pinv.dtype == torch.float32 and pinv.isfinite().all()


def test_pseudo_inverse_of_small_resolved_eigenvalues_in_float32():
    """A confident softmax: float32 eigenvalues near 1e-24 are resolved (accurate to
    about 1e-6), and ``λ⁻²`` underflows float32 there. The pseudo-inverse keeps
    float32's accuracy (the Gram-space scaling runs in float64)."""
    torch.manual_seed(0)
    X, y = torch.randn(4, 3), torch.zeros(4, dtype=torch.long)
    model = torch.nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.copy_(0.1 * torch.randn(3, 3))
        model.bias.copy_(torch.tensor([56.0, 0.0, 0.0]))
    v = torch.randn(sum(p.numel() for p in model.parameters()))
    loss_func = torch.nn.CrossEntropyLoss()
    single = LowRankGGN(model, loss_func, (X, y))
    assert single.eigh(top_k=2)[0].max() < 1e-22  # λ² below float32's range
    result = single.operator().pinv_matvec(v, top_k=2)
    double = LowRankGGN(model.double(), loss_func, (X.double(), y))
    reference = double.operator().pinv_matvec(v.double(), top_k=2)
    assert torch.isfinite(result).all()
    error = (result.double() - reference).norm() / reference.norm()
    record(error.item(), EIGVEC_PRODUCT_REL32)
    assert error < EIGVEC_PRODUCT_REL32, error


def test_scipy_operator_takes_complex_and_strided_arrays():
    """A real operator is linear over complex vectors (``G(a + ib) = Ga + iGb``, as
    scipy's operators are), and NumPy views with negative strides are valid input."""
    problem = select(architecture="mlp_relu", loss="ce", reduction="sum")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    op = LowRankGGN(model, loss_func, (X, y)).operator().to_scipy()
    rng = numpy.random.default_rng(0)
    a, b = rng.standard_normal(op.shape[0]), rng.standard_normal(op.shape[0])
    # the same products, in another memory layout: at most reordered sums
    as_tensor = torch.from_numpy
    assert_rel(
        as_tensor(op @ (a + 1j * b)), as_tensor(op @ a + 1j * (op @ b)), REORDERED_REL
    )
    assert_rel(as_tensor(op @ a[::-1]), as_tensor(op @ a[::-1].copy()), REORDERED_REL)
    block = numpy.stack([a, b], axis=1)[:, ::-1]
    assert_rel(as_tensor(op @ block), as_tensor(op @ block.copy()), REORDERED_REL)
