"""The results layer (``vivit.results``) over every curvature source.

Each result is written once, over a source protocol; here it is checked over
every source (``SOURCES``: a new source is tested by adding one entry) on a
loader of two batches of unequal size, against the dense float64 reference of
the concatenated batch (``tests/fixtures/reference.py``), on several
architectures and both reductions.

Eigenpairs are checked against the dense GGN (eigenvalues, residuals). Every
other result is checked against its formula in ``docs/math.rst`` evaluated with
the reference's per-sample gradients and GGNs along the source's *own*
eigenvectors ``e_k`` and eigenvalues ``λ_k`` (signs and the basis of a repeated
eigenvalue are then those of the source):

* "Directional derivatives and curvature noise": ``γ_nk = e_kᵀ∇ℓ_n`` and
  ``γ̄_k = R_S Σ_{n∈S} γ_nk = e_kᵀ∇L_S`` hold for any ``e_k = V ẽ_k / √λ_k``;
  ``λ_nk = e_kᵀG_n e_k`` is computed as ``λ_k / R · ‖ẽ_k[n]‖²``, which equals it
  for an exact Gram eigenvector. For a residual ``r = G̃ẽ_k − λ_kẽ_k``, sample
  ``n``'s rows of ``G̃ẽ_k = Vᵀ V ẽ_k`` are ``√R S_nᵀ J_n V ẽ_k``, so
  ``e_kᵀG_n e_k = ‖λ_kẽ_k[n] + r[n]‖² / (R λ_k)`` differs from the computed value
  by at most ``(2‖r‖ + ‖r‖²/λ_k) / R``; "Precision and the numerical zero" bounds
  ``‖r‖ ≤ ρ·λ_max`` with ``ρ`` the residual the solver reports.
* "Damped Newton step in the eigenspace": ``Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k``
  (scaled by ``lr``), and "Trust region of a Newton step" for ``max_decrease``.
* The pseudo-inverse ``G_K⁺ w = Σ_k e_k e_kᵀ w / λ_k`` and ``G v = V Vᵀ v``
  ("Precision and the numerical zero", last paragraph).

Tolerances (float64, ε ≈ 2.2e-16, D ≤ 183, N·C ≤ 24): the Gram eigenvalues are
within ``N·C·ε·λ_max`` (dense) or ``tol·λ_max`` (iterative, ``tol = 1e-12``) of
the exact ones ("Precision and the numerical zero"); products with the leading
eigenvectors are compared at ``REL = EIGVEC_PRODUCT_REL`` = 1e-10 of the largest
entry ("Tolerances of the tests", "Iterative solvers": ``tol`` in place of
``N·C·ε``, the bound for ``(λ_max/gap)·√(λ_max/λ) ≤ 100``), while a wrong ``R``,
``√R`` or a missing sample is an O(1) error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy
import pytest
import torch
from torch import Tensor

import vivit.eigenpairs
from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    assert_differs,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    assert_within,
    flat_evecs,
    rounding_rel,
)
from tests.fixtures.problems import Setup, get_problem, prepare
from tests.fixtures.reference import (
    dense_ggn,
    dense_gradient,
    dense_mc_ggn,
    per_sample_ggns,
    per_sample_gradients,
    reduction_factor,
)
from tests.sources.test_data_loader import split
from vivit import LowRankGGN, StreamingGGN


@dataclass(frozen=True)
class Source:
    """A front door over one curvature source.

    Attributes:
        build: ``build(model, loss_func, loader, **options)``.
        route: What ``solver_report`` names its solver on products with ``V``.
    """

    build: type
    route: str

    def __str__(self) -> str:
        return self.build.__name__


SOURCES = [Source(LowRankGGN, "factor_krylov"), Source(StreamingGGN, "factor_krylov")]
PROBLEMS = [
    get_problem(name)
    for name in (
        "mlp_tanh-ce-mean",
        "cnn-mse-sum",
        "residual-ce-sum",
        "batchnorm1d-mse-mean",
        "conv1d-ce-mean",
    )
]
REL = EIGVEC_PRODUCT_REL
TOP_K = 3
SUB_GRAD = [3, 0, 2]  # unsorted: γ's rows follow it


class Reference(NamedTuple):
    setup: Setup
    batches: list[tuple[Tensor, Tensor]]
    ggn: Tensor  # [D, D] G
    gradient: Tensor  # [D] ∇L
    grads: Tensor  # [N, D] ∇ℓ_n
    ggns: Tensor  # [N, D, D] G_n
    loss: Tensor


@functools.cache
def reference(name: str) -> Reference:
    """The float64 problem, a loader of two batches, its dense quantities."""
    setup = prepare(get_problem(name), torch.float64)
    model, loss_func, X, y = setup
    with torch.no_grad():
        loss = loss_func(model(X), y)
    return Reference(
        setup,
        split(X, y, [2, X.shape[0] - 2]),
        dense_ggn(model, loss_func, X, y),
        dense_gradient(model, loss_func, X, y),
        per_sample_gradients(model, loss_func, X, y),
        per_sample_ggns(model, loss_func, X, y),
        loss,
    )


def build(source: Source, ref: Reference, **options):
    model, loss_func, _, _ = ref.setup
    return source.build(model, loss_func, ref.batches, **options)


def reference_and_source(problem, source: Source):
    """The problem's reference and the source over its loader."""
    ref = reference(problem.name)
    return ref, build(source, ref)


def flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.flatten() for t in tensors])


def own_directions(ggn, ref: Reference) -> tuple[Tensor, Tensor, Tensor]:
    """The source's ``λ_k``, its ``e_k`` as rows ``[K, D]``, and ``γ̄_k = e_kᵀ∇L_S``
    (the loss on ``SUB_GRAD`` alone) from the reference's per-sample gradients."""
    evals, evecs = ggn.eigh(TOP_K)
    E = flat_evecs(evecs)
    R_grad = reduction_factor(ref.setup.loss_func, len(SUB_GRAD))
    return evals, E, R_grad * ref.grads[SUB_GRAD].sum(0) @ E.T


parametrize_problems = pytest.mark.parametrize(
    "problem", PROBLEMS, ids=[p.name for p in PROBLEMS]
)
parametrize_sources = pytest.mark.parametrize("source", SOURCES, ids=str)


@parametrize_sources
@parametrize_problems
def test_eigh_loss_and_gradient(problem, source):
    ref, ggn = reference_and_source(problem, source)
    assert_rel(ggn.loss, ref.loss, REL)
    assert_rel(flat(ggn.gradient()), ref.gradient, REL)
    evals, evecs = ggn.eigh(TOP_K)
    assert evals.shape == (TOP_K,)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(ref.ggn), REL)
    report = ggn.solver_report()
    rows = ggn.num_rows if isinstance(ggn, StreamingGGN) else ggn.gram().shape[0]
    assert_eigenpairs(evals, evecs, ref.ggn, rows, report.tolerance)
    assert report.tolerance == report.requested_tolerance  # no rounding floor


@parametrize_sources
@parametrize_problems
def test_directional_derivatives(problem, source):
    ref, ggn = reference_and_source(problem, source)
    evals, E, gamma_bar = own_directions(ggn, ref)
    d = ggn.directional_derivatives(TOP_K, subsampling_grad=SUB_GRAD)
    assert torch.equal(d.evals, evals)
    assert_rel(d.gammas, ref.grads[SUB_GRAD] @ E.T, REL)
    assert_rel(d.gamma_bar, gamma_bar, REL)

    lambdas = torch.einsum("kd,nde,ke->nk", E, ref.ggns, E)
    R = reduction_factor(ref.setup.loss_func, ref.grads.shape[0])
    residual = ggn.solver_report().residual * evals.max()  # ‖r‖ ≤ ρ·λ_max
    bound = (2 * residual + residual**2 / evals) / R
    torch.testing.assert_close(
        d.lambdas, lambdas, rtol=0, atol=REL * lambdas.abs().max() + bound.max()
    )
    assert_rel(R * d.lambdas.sum(0), evals, REL)  # ‖ẽ_k‖ = 1


@parametrize_sources
@parametrize_problems
def test_newton(problem, source):
    ref, ggn = reference_and_source(problem, source)
    evals, E, gamma_bar = own_directions(ggn, ref)

    def expected_step(dampings, lr):
        return -lr * (gamma_bar / (evals + dampings)) @ E

    def predicted_decrease(dampings, lr):
        gain = lr / (evals + dampings)
        return (gamma_bar**2 * gain * (1 - 0.5 * evals * gain)).sum()

    newton = ggn.newton(TOP_K, damping=0.1, subsampling_grad=SUB_GRAD)
    assert torch.equal(newton.dampings, torch.full_like(evals, 0.1))
    assert_rel(newton.gamma_bar, gamma_bar, REL)
    assert_rel(flat(newton.step), expected_step(newton.dampings, 1.0), REL)

    lr = 0.5
    max_decrease = 0.1 * predicted_decrease(torch.zeros_like(evals), lr).item()
    newton = ggn.newton(
        TOP_K,
        damping=0.0,
        subsampling_grad=SUB_GRAD,
        lr=lr,
        max_decrease=max_decrease,
    )
    assert (newton.dampings > 0).all()  # the trust region binds
    # bisection to 2⁻⁶⁰ relative in μ; γ̄ within REL·max|γ̄| enters the positive
    # terms γ̄_k²·w_k squared: each moves by (2|γ̄_k| + REL·max|γ̄|)·REL·max|γ̄|·w_k,
    # plus the roundings of the K-term sum on either side ("Few operations")
    gain = lr / (evals + newton.dampings)
    weights = gain * (1 - 0.5 * evals * gain)
    shift = REL * gamma_bar.abs().max()
    bound = ((2 * gamma_bar.abs() + shift) * shift * weights).sum().item()
    bound += rounding_rel(4 * (TOP_K + 4)) * max_decrease
    error = abs(predicted_decrease(newton.dampings, lr).item() - max_decrease)
    assert_within(torch.tensor(error), torch.tensor(0.0), bound)
    assert_rel(flat(newton.step), expected_step(newton.dampings, lr), REL)


@parametrize_sources
@parametrize_problems
def test_operator(problem, source):
    ref, ggn = reference_and_source(problem, source)
    G = ref.ggn
    D = G.shape[0]
    v = torch.randn(
        D, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    op = ggn.operator()
    assert op.shape == (D, D)
    scale = G.norm(2) * v.norm()
    torch.testing.assert_close(op.matvec(v), G @ v, atol=REL * scale, rtol=0)
    linear = op.to_scipy()
    numpy.testing.assert_allclose(
        linear @ v.numpy(), (G @ v).numpy(), atol=REL * scale.item(), rtol=0
    )

    evals, evecs = ggn.eigh(TOP_K)
    E = flat_evecs(evecs)
    expected = E.T @ ((E @ v) / evals[:, None])  # Σ_k e_k e_kᵀ v / λ_k
    torch.testing.assert_close(
        op.pinv_matvec(v, top_k=TOP_K),
        expected,
        atol=REL * v.norm() / evals.min(),
        rtol=0,
    )


@parametrize_problems
def test_sources_agree(problem):
    """What needs no eigenvector is the same number from every source."""
    ref = reference(problem.name)
    ggns = [build(source, ref) for source in SOURCES]
    v = torch.randn(
        ref.ggn.shape[0],
        generator=torch.Generator().manual_seed(1),
        dtype=torch.float64,
    )
    first, *others = ggns
    for other in others:
        assert_rel(other.loss, first.loss, REL)
        assert_rel(flat(other.gradient()), flat(first.gradient()), REL)
        assert_rel(other.eigh(TOP_K)[0], first.eigh(TOP_K)[0], REL)
        assert_rel(other.operator().matvec(v), first.operator().matvec(v), REL)


class Recorded:
    """The tolerances and seeds the results layer hands the eigensolver."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[float | None, int]] = []
        solve = vivit.eigenpairs.leading_eigenpairs

        def recording(*args, **kwargs):
            self.calls.append((kwargs["tol"], kwargs["seed"]))
            return solve(*args, **kwargs)

        monkeypatch.setattr(vivit.eigenpairs, "leading_eigenpairs", recording)


@parametrize_sources
def test_per_call_tolerance_and_seed(monkeypatch, source):
    ref = reference("mlp_tanh-ce-mean")
    ggn = build(source, ref, solver="factor_krylov", solver_tol=1e-4, solver_seed=3)
    recorded = Recorded(monkeypatch)
    exact = torch.linalg.eigvalsh(ref.ggn)

    evals, _ = ggn.eigh(2)
    assert recorded.calls == [(1e-4, 3)]  # the constructor's
    report = ggn.solver_report()
    assert (report.solver, report.requested) == (source.route, source.route)
    assert report.tolerance == 1e-4 and report.residual <= 1e-4
    # within ‖r‖ ≤ tol·λ_max of an eigenvalue ("Precision and the numerical zero"),
    # the dense reference within EIGVAL_RTOL·λ_max
    assert_top_eigvals(evals, exact, 1e-4 + EIGVAL_RTOL[torch.float64])

    evals, _ = ggn.eigh(2, tol=1e-11, seed=7)
    assert recorded.calls[1:] == [(1e-11, 7)]
    assert ggn.solver_report().tolerance == 1e-11
    assert_top_eigvals(evals, exact, 1e-11 + EIGVAL_RTOL[torch.float64])

    ggn.eigh(2)
    ggn.eigh(2, tol=1e-4, seed=3)  # the constructor's, named: the same pairs
    ggn.eigh(2, tol=1e-11, seed=7)
    assert len(recorded.calls) == 2, "kept per tolerance and seed"
    ggn.eigh(2, seed=4)
    assert recorded.calls[2:] == [(1e-4, 4)]


@parametrize_sources
def test_solver_report_names_the_route(source):
    ggn = build(source, reference("cnn-mse-sum"))
    assert ggn.solver_report() is None
    ggn.eigh(2, solver="factor_krylov")
    report = ggn.solver_report()
    assert (report.solver, report.requested) == (source.route, source.route)
    assert report.converged and report.residual <= report.tolerance


@parametrize_sources
@parametrize_problems
def test_results_after_more_pairs_were_computed(problem, source):
    """Asking for more pairs replaces the kept ones: a later request for fewer
    uses the new pairs throughout, so that ``γ̄_k`` and the direction ``e_k`` of
    a Newton step have the same sign (a step built from one solve's ``γ̄`` and
    another's ``e_k`` goes uphill along every direction whose sign differs)."""
    ref, ggn = reference_and_source(problem, source)
    ggn.eigh(TOP_K - 1)
    ggn.eigh(TOP_K)
    evals, evecs = ggn.eigh(TOP_K - 1)
    E = flat_evecs(evecs)
    gamma_bar = ref.gradient @ E.T
    newton = ggn.newton(TOP_K - 1, damping=0.1)
    assert_rel(newton.gamma_bar, gamma_bar, REL)
    assert_rel(flat(newton.step), -(gamma_bar / (evals + 0.1)) @ E, REL)


@pytest.mark.parametrize("engine", ["backpack", "func"])
@parametrize_problems
def test_monte_carlo(problem, engine):
    """MC: every source draws block ``b`` from stream ``s + b`` ("Data sets and
    processes"), so its eigenpairs are those of the dense GGN of the same sampled
    roots; ``γ``, ``γ̄`` and the step follow their formulas along each source's
    own directions, and ``R Σ_n λ_nk = λ_k`` holds for the sampled GGN."""
    ref = reference(problem.name)
    model, loss_func, _, _ = ref.setup
    R = reduction_factor(loss_func, ref.grads.shape[0])
    sampled = dense_mc_ggn(
        model, loss_func, ref.batches, 2, 3, global_generator=engine == "backpack"
    )
    exact = torch.linalg.eigvalsh(sampled)
    # another draw, not the exact GGN: the sampled GGN is that of these roots
    assert_differs(sampled, ref.ggn, REL)
    for source in SOURCES:
        ggn = build(
            source,
            ref,
            mc_samples=2,
            generator=torch.Generator().manual_seed(3),
            engine=engine,
        )
        evals, E, gamma_bar = own_directions(ggn, ref)
        report = ggn.solver_report()
        rows = ggn.num_rows if isinstance(ggn, StreamingGGN) else ggn.gram().shape[0]
        assert_top_eigvals(evals, exact, EIGVAL_RTOL[torch.float64])
        assert_eigenpairs(evals, ggn.eigh(TOP_K)[1], sampled, rows, report.tolerance)
        newton = ggn.newton(TOP_K, damping=0.1, subsampling_grad=SUB_GRAD)
        d = newton.directional
        assert_rel(d.gammas, ref.grads[SUB_GRAD] @ E.T, REL)
        assert_rel(d.gamma_bar, gamma_bar, REL)
        assert_rel(R * d.lambdas.sum(0), evals, REL)
        assert_rel(flat(newton.step), -(gamma_bar / (evals + 0.1)) @ E, REL)


@parametrize_sources
def test_results_handed_out_are_the_callers_to_change(source):
    """Changing a returned tensor in place changes no later result (issue 19)."""
    ref, ggn = reference_and_source(PROBLEMS[0], source)
    evals, evecs = ggn.eigh(TOP_K)
    gradient = ggn.gradient()
    expected = (evals.clone(), [e.clone() for e in evecs], flat(gradient).clone())
    returned = [evals, *evecs, *gradient]
    if source.build is LowRankGGN:
        gram, all_evals = ggn.gram(), ggn.eigvalsh()
        expected_gram, expected_all = gram.clone(), all_evals.clone()
        returned += [gram, all_evals]
    for tensor in returned:
        tensor.mul_(-3.0).add_(1.0)
    evals_again, evecs_again = ggn.eigh(TOP_K)
    assert torch.equal(evals_again, expected[0])
    assert all(torch.equal(a, e) for a, e in zip(evecs_again, expected[1], strict=True))
    assert torch.equal(flat(ggn.gradient()), expected[2])
    if source.build is LowRankGGN:
        assert torch.equal(ggn.gram(), expected_gram)
        assert torch.equal(ggn.eigvalsh(), expected_all)
