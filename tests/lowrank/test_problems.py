"""LowRankGGN against the dense float64 torch.func GGN, on every registry problem."""

import pytest
import torch
from torch import nn

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    assert_within,
    flat_evecs,
    layer_groups,
)
from tests.fixtures.problems import PROBLEMS, prepare, problem_ids, select
from tests.fixtures.reference import dense_ggn, dense_gradient, eigh_reference
from vivit import LowRankGGN
from vivit.linalg.solvers import numerical_zero_tolerance


@pytest.fixture(params=PROBLEMS, ids=problem_ids(PROBLEMS))
def problem(request):
    return request.param


@pytest.mark.parametrize("subsampling", [None, [0, 2, 3]], ids=["full", "subsampled"])
def test_eigenpairs_float64(problem, subsampling):
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=subsampling)
    num_samples = problem.batch_size if subsampling is None else len(subsampling)
    rows = num_samples * problem.num_outputs
    assert ggn.gram().shape == (rows, rows)
    reference = torch.linalg.eigvalsh(G)
    evals = ggn.eigvalsh()
    assert evals.shape == (rows,) and (evals.diff() >= 0).all()
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float64])

    evals, evecs = ggn.eigh()
    assert [e.shape[1:] for e in evecs] == [p.shape for p in model.parameters()]
    assert (evals > numerical_zero_tolerance(ggn.eigvalsh())).all()
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float64])
    assert_eigenpairs(evals, evecs, G, rows)
    # numerically zero eigenvalues carry no direction: CE has rank ≤ N·(C−1)
    if problem.loss == "ce":
        assert evals.numel() <= num_samples * (problem.num_outputs - 1)


@pytest.mark.filterwarnings("ignore::vivit.FewerEigenpairsWarning")  # top_k > rank
def test_top_k(problem):
    model, loss_func, X, y = prepare(problem, torch.float64)
    ggn = LowRankGGN(model, loss_func, (X, y))
    all_evals, _ = ggn.eigh()
    evals, evecs = ggn.eigh(top_k=2)
    torch.testing.assert_close(evals, all_evals[-2:], rtol=0, atol=0)
    assert all(e.shape[0] == 2 for e in evecs)
    assert ggn.eigh(top_k=10_000)[0].numel() == all_evals.numel()


def test_per_layer_groups(problem):
    model, loss_func, X, y = prepare(problem, torch.float64)
    groups = layer_groups(model)
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=groups)
    for index, group in enumerate(groups):
        G = dense_ggn(model, loss_func, X, y, params=group)
        assert_top_eigvals(
            ggn.eigvalsh(index), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
        )
        evals, evecs = ggn.eigh(group=index)
        assert [e.shape[1:] for e in evecs] == [p.shape for p in group]
        assert_eigenpairs(evals, evecs, G, ggn.gram(index).shape[0])


def test_float32(problem):
    model, loss_func, X, y = prepare(problem, torch.float32)
    model64, loss64, X64, y64 = prepare(problem, torch.float64)
    reference = torch.linalg.eigvalsh(dense_ggn(model64, loss64, X64, y64))
    ggn = LowRankGGN(model, loss_func, (X, y))
    assert ggn.gram().dtype == torch.float32
    assert_top_eigvals(ggn.eigvalsh(), reference, EIGVAL_RTOL[torch.float32])
    evals, evecs = ggn.eigh(top_k=3)
    assert all(e.dtype == torch.float32 for e in evecs)
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float32])


def test_leaves_gradients_untouched():
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    LowRankGGN(model, loss_func, (X, y))
    assert (model[0].weight.grad == 1).all()
    assert all(p.grad is None for p in list(model.parameters())[1:])


def test_extends_plain_modules():
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64, extend=False)
    reference = torch.linalg.eigvalsh(dense_ggn(model, loss_func, X, y))
    assert_top_eigvals(
        LowRankGGN(model, loss_func, (X, y)).eigvalsh(), reference, 1e-10
    )


def test_results_do_not_track_gradients():
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64)
    X.requires_grad_(True)
    ggn = LowRankGGN(model, loss_func, (X, y))
    _, evecs = ggn.eigh(top_k=2)
    newton = ggn.newton(top_k=2)
    directional = newton.directional
    results = [ggn.gram(), *evecs, *newton.step, newton.gamma_bar]
    results += [directional.gammas, directional.lambdas]
    assert not any(t.requires_grad for t in results)


def test_eigenvectors_are_formed_once_and_are_the_callers(monkeypatch):
    """``eigh`` hands out the ``V ũ`` it formed, not a copy (ResNet-18's top 10:
    447 MB each); a second call forms new ones, whatever the caller did."""
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64)
    ggn = LowRankGGN(model, loss_func, (X, y))

    def refuse(tensors, params):
        raise AssertionError("the eigenvectors were copied")

    monkeypatch.setattr("vivit.results.in_param_dtypes", refuse)
    _, first = ggn.eigh(top_k=2)
    expected = [e.clone() for e in first]
    for e in first:
        e.zero_()
    _, second = ggn.eigh(top_k=2)
    for e, kept in zip(second, expected, strict=True):
        torch.testing.assert_close(e, kept, rtol=0, atol=0)


def test_float32_decomposition_falls_back_to_float64(monkeypatch):
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float32)
    ggn = LowRankGGN(model, loss_func, (X, y))
    # the retry's own call on the same float64 matrix, cast once: bit for bit
    expected = torch.linalg.eigh(ggn.gram().double())[0].float()
    eigh = torch.linalg.eigh

    def fails_in_float32(matrix):
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("failed to converge")
        return eigh(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", fails_in_float32)
    evals = ggn.eigvalsh()
    assert evals.dtype == torch.float32
    assert torch.equal(evals, expected), (evals - expected).abs().max()


def test_leading_eigenpairs_alone(monkeypatch):
    """``eigh(top_k)`` on a fresh object computes only the leading eigenpairs; a
    Newton step for fewer is served by them, and they are the leading pairs of the
    full decomposition computed later: each against the dense float64 reference.
    """
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64)
    G = dense_ggn(model, loss_func, X, y)
    gradient = dense_gradient(model, loss_func, X, y)
    reference, reference_evecs = eigh_reference(G)

    def no_full_decomposition(matrix):
        raise AssertionError("the full decomposition was computed")

    ggn = LowRankGGN(model, loss_func, (X, y))
    rows = ggn.gram().shape[0]
    monkeypatch.setattr(torch.linalg, "eigh", no_full_decomposition)
    evals, evecs = ggn.eigh(top_k=3)
    assert evals.shape == (3,)
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float64])
    tol = ggn.solver_report().tolerance
    assert_eigenpairs(evals, evecs, G, rows, tol)
    step = ggn.newton_step(top_k=2, damping=0.1)  # served by the kept pairs
    monkeypatch.undo()
    # Δθ = −Σ_k e_k e_kᵀ∇L / (λ_k + δ) over the reference's top 2 ("Damped Newton
    # step in the eigenspace"), sign-free; leading directions: EIGVEC_PRODUCT_REL
    E = reference_evecs[:, -2:]
    expected = -E @ ((E.T @ gradient) / (reference[-2:] + 0.1))
    flat_step = torch.cat([s.flatten() for s in step])
    assert_rel(flat_step, expected, EIGVEC_PRODUCT_REL)
    # the full decomposition (another LAPACK driver) has the same leading pairs
    all_evals, all_evecs = ggn.eigh()
    assert_top_eigvals(all_evals, reference, EIGVAL_RTOL[torch.float64])
    assert_eigenpairs(all_evals, all_evecs, G, rows)
    assert_rel(evals, all_evals[-3:], EIGVAL_RTOL[torch.float64])


@pytest.mark.parametrize("subsampling", [None, [0, 2, 3]], ids=["full", "subsampled"])
def test_gradient_and_batch_directional_gradient(problem, subsampling):
    """``gradient()`` is ∇L of the whole batch; ``gamma_bar`` is ``E ∇L``."""
    model, loss_func, X, y = prepare(problem, torch.float64)
    grad = dense_gradient(model, loss_func, X, y)
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=subsampling)
    flat = torch.cat([g.flatten() for g in ggn.gradient()])
    assert_rel(flat, grad, REORDERED_REL)  # the dense reference's sums
    _, evecs = ggn.eigh(top_k=3)
    E = flat_evecs(evecs)
    gamma_bar = ggn.directional_derivatives(top_k=3).gamma_bar
    assert_rel(gamma_bar, E @ grad, EIGVEC_PRODUCT_REL)  # leading eigenvectors


@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize(
    "problem",
    [
        *select(architecture="mlp_tanh", loss="ce", reduction="mean"),
        *select(architecture="cnn", loss="mse", reduction="sum"),
    ],
    ids=lambda p: p.name,
)
def test_solver_report_of_a_reused_full_decomposition(problem, engine):
    """``eigh(top_k)`` answered from the full decomposition reports ``"dense"``.

    After ``eigvalsh()`` a request with ``solver="auto"`` reuses the full
    decomposition; the report names it (not an earlier request's solver), with
    the residual of the returned pairs: a backward-stable dense eigensolver's,
    at most ``N·C·ε·λ_max`` (``docs/math.rst``, "Precision and the numerical
    zero").
    """
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y)
    ggn = LowRankGGN(model, loss_func, (X, y), engine=engine)
    ggn.eigh(top_k=2, solver="gram_krylov")
    assert ggn.solver_report().solver == "gram_krylov"
    ggn.eigvalsh()
    evals, evecs = ggn.eigh(top_k=3)
    assert_eigenpairs(evals, evecs, G, ggn.gram().shape[0])
    report = ggn.solver_report()
    assert (report.solver, report.requested) == ("dense", "auto")
    assert report.converged and report.tolerance is None and report.fallback is None
    rows = ggn.gram().shape[0]
    assert 0 <= report.residual <= rows * torch.finfo(torch.float64).eps


def test_auto_keeps_its_directions_after_a_full_decomposition():
    """Repeated top eigenvalues: later requests use the directions ``eigh`` gave.

    The GGN of a Linear layer under the squared error is ``Σ_n x_n x_nᵀ ⊗ I_C``
    (times ``2R``): every eigenvalue is repeated ``C`` times, so the leading
    direction is not unique. Once a full decomposition exists, ``"auto"`` must
    still answer ``top_k=1`` with the direction it returned before, and the
    Newton step must use it.
    """
    torch.manual_seed(0)
    model = nn.Linear(2, 2).double()
    X = torch.tensor([[1.2645, -0.6874], [0.1604, -0.6065]], dtype=torch.float64)
    y = torch.tensor([[-0.7831, 1.0622], [-0.2613, 1.0667]], dtype=torch.float64)
    ggn = LowRankGGN(model, nn.MSELoss(), (X, y))
    evals, evecs = ggn.eigh(top_k=1)
    ggn.eigvalsh()  # the full decomposition now exists
    again_evals, again = ggn.eigh(top_k=1)
    assert torch.equal(again_evals, evals)
    assert all(torch.equal(a, e) for a, e in zip(again, evecs, strict=True))
    E = flat_evecs(evecs)
    gradient = torch.cat([g.flatten() for g in ggn.gradient()])
    damping = 0.1
    expected = -((E @ gradient) / (evals + damping)) @ E
    step = torch.cat([s.flatten() for s in ggn.newton_step(1, damping=damping)])
    scale = ((E @ gradient).abs() / (evals + damping)).sum().item()
    assert_within(step, expected, EIGVEC_PRODUCT_REL * scale)
