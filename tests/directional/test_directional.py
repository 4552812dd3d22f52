"""Directional derivatives γ_nk, λ_nk along GGN eigenvectors against dense references.

``docs/math.rst``: γ_nk = e_kᵀ∇ℓ_n, λ_nk = e_kᵀ G_n e_k with L = R Σ_n ℓ_n and
G_n = J_nᵀ H_n J_n; batch relations R Σ_n γ_nk = e_kᵀ∇L (all samples) and
R Σ_n λ_nk = λ_k (the GGN's samples).

Directions are vivit's own eigenvectors (``LowRankGGN.eigh``), whose correctness is
asserted here through the residual ‖G e − λ e‖ against the dense GGN. Eigenvectors
are defined up to sign, so every comparison is sign-invariant: λ_nk directly, γ
after flipping each direction's column to the sign of the reference column.

Tolerances: everything runs in float64 (ε ≈ 2.2e-16) on parameter vectors of
D ≤ 183 entries and Gram matrices of ≤ 24 rows. The errors of the Gram
eigendecomposition (≈ ε·λ_max / gap ≤ 1e-12 relative for the gaps of the
directions used) and of the products over D entries stay below ~1e-12 relative
to the largest reference entry, so a relative 1e-10 of that entry leaves two
orders of magnitude of margin, while any wrong scaling (R, √R, N, C, a missing
sample) is an O(1) relative error.
"""

from __future__ import annotations

import math

import pytest
import torch
from backpack import backpack

from tests.fixtures.checks import (
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    align_signs,
    assert_differs,
    assert_eigenpairs,
    assert_rel,
    assert_within,
    flat_evecs,
    rounding_rel,
)
from tests.fixtures.per_sample import Reference, reference
from tests.fixtures.problems import (
    ARCHITECTURES,
    Problem,
    get_problem,
    problem_ids,
)
from tests.fixtures.reference import (
    reduction_factor,
)
from vivit import (
    DirectionalDerivatives,
    DirectionalDerivativesComputation,
    InvalidSubsamplingError,
    LowRankGGN,
    VivitError,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing:UserWarning"
)

DTYPE = torch.float64
REL = EIGVEC_PRODUCT_REL
TOP_K = 3
SUB_GGN = [0, 2, 3]
SUB_GRAD = [3, 1, 2]  # different from SUB_GGN and unsorted: rows follow this order


def _representative() -> list[Problem]:
    """Every architecture twice: once per loss, the reductions alternating."""
    problems = []
    for i, arch in enumerate(ARCHITECTURES):
        first, second = ("mean", "sum") if i % 2 == 0 else ("sum", "mean")
        problems.append(get_problem(f"{arch.name}-mse-{first}"))
        problems.append(get_problem(f"{arch.name}-ce-{second}"))
    return problems


PROBLEMS = _representative()
assert {p.architecture for p in PROBLEMS} == {a.name for a in ARCHITECTURES}
assert {(p.loss, p.reduction) for p in PROBLEMS} == {
    (loss, red) for loss in ("mse", "ce") for red in ("mean", "sum")
}


def assert_residuals(
    G: torch.Tensor, evals: torch.Tensor, E: torch.Tensor, nc: int
) -> None:
    """The directions are orthonormal eigenvectors of ``G`` within the bounds of
    ``docs/math.rst`` (:ref:`math-precision`, "Eigenvectors"; ``nc`` Gram rows).
    """
    assert_eigenpairs(evals, [E], G, nc)


def directions(ref: Reference, subsampling, top_k=TOP_K, **kwargs):
    """LowRankGGN of the problem, its top eigenpairs, the eigenvectors as rows."""
    model, loss_func, X, y = ref.setup
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=subsampling, **kwargs)
    evals, evecs = ggn.eigh(top_k=top_k)
    return ggn, evals, flat_evecs(evecs)


# ----------------------------------------------------------------------------------
# LowRankGGN.directional_derivatives
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_lowrank_directional_derivatives(problem):
    ref = reference(problem.name)
    ggn, evals, E = directions(ref, SUB_GGN)
    assert evals.shape == (TOP_K,)
    assert_residuals(ref.ggn(SUB_GGN), evals, E, ggn.gram().shape[0])

    dd = ggn.directional_derivatives(top_k=TOP_K, subsampling_grad=SUB_GRAD)
    assert isinstance(dd, DirectionalDerivatives)
    torch.testing.assert_close(dd.evals, evals, rtol=0, atol=0)
    assert dd.gammas.shape == (len(SUB_GRAD), TOP_K)
    assert dd.lambdas.shape == (len(SUB_GGN), TOP_K)

    gammas = ref.gammas(E, SUB_GRAD)
    assert_rel(align_signs(dd.gammas, gammas), gammas)
    assert_rel(dd.lambdas, ref.lambdas(E, SUB_GGN))


@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_computation_directional_derivatives(problem):
    """The BackPACK-hook API, directions chosen by a top-3 criterion."""
    ref = reference(problem.name)
    ggn, evals, E = directions(ref, SUB_GGN)
    assert_residuals(ref.ggn(SUB_GGN), evals, E, ggn.gram().shape[0])

    model, loss_func, X, y = ref.setup
    seen = []

    def top_3(all_evals):
        seen.append(all_evals.clone())
        return list(range(all_evals.numel() - TOP_K, all_evals.numel()))

    comp = DirectionalDerivativesComputation(
        subsampling_grad=SUB_GRAD, subsampling_ggn=SUB_GGN
    )
    groups = [{"params": list(model.parameters()), "criterion": top_3}]
    loss = loss_func(model(X), y)
    with backpack(
        *comp.get_extensions(), extension_hook=comp.get_extension_hook(groups)
    ):
        loss.backward()
    gammas, lambdas = comp.get_result(groups[0])

    # The criterion saw all N_ggn·C Gram eigenvalues, ascending, whose top ones are
    # the directions' eigenvalues.
    (all_evals,) = seen
    assert all_evals.shape == (len(SUB_GGN) * problem.num_outputs,)
    assert (all_evals.diff() >= 0).all()
    assert_rel(all_evals[-TOP_K:], evals)

    assert gammas.shape == (len(SUB_GRAD), TOP_K)
    assert lambdas.shape == (len(SUB_GGN), TOP_K)
    gamma_ref = ref.gammas(E, SUB_GRAD)
    assert_rel(align_signs(gammas, gamma_ref), gamma_ref)
    assert_rel(lambdas, ref.lambdas(E, SUB_GGN))


def test_computation_two_groups():
    """Block-diagonal GGN: each group's directions from its own block."""
    ref = reference("mlp_tanh-ce-mean")
    model, loss_func, X, y = ref.setup
    params = list(model.parameters())
    blocks = [params[:2], params[2:]]  # first layer | the rest
    sizes = [sum(p.numel() for p in b) for b in blocks]
    groups = [
        {"params": blocks[0], "criterion": lambda ev: [ev.numel() - 1]},
        {"params": blocks[1], "criterion": lambda ev: [ev.numel() - 2, ev.numel() - 1]},
    ]
    comp = DirectionalDerivativesComputation()  # all samples for both
    loss = loss_func(model(X), y)
    with backpack(
        *comp.get_extensions(), extension_hook=comp.get_extension_hook(groups)
    ):
        loss.backward()

    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=blocks)
    G = ref.ggn()
    offsets = [0, sizes[0], sum(sizes)]
    for g, (group, top_k) in enumerate(zip(groups, [1, 2], strict=True)):
        sl = slice(offsets[g], offsets[g + 1])
        evals, evecs = ggn.eigh(top_k=top_k, group=g)
        E = flat_evecs(evecs)
        assert_residuals(G[sl, sl], evals, E, ggn.gram(g).shape[0])
        sub_ref = Reference(ref.setup, ref.grads[:, sl], ref.ggns[:, sl, sl], None)
        gammas, lambdas = comp.get_result(group)
        gamma_ref = sub_ref.gammas(E, None)
        assert_rel(align_signs(gammas, gamma_ref), gamma_ref)
        assert_rel(lambdas, sub_ref.lambdas(E, None))


# ----------------------------------------------------------------------------------
# Batch relations
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_batch_relations(problem):
    """R Σ_n λ_nk = λ_k (GGN samples) and R Σ_n γ_nk = e_kᵀ∇L (all samples)."""
    ref = reference(problem.name)
    ggn, evals, E = directions(ref, SUB_GGN)
    dd = ggn.directional_derivatives(top_k=TOP_K)  # every sample's gradient
    N = ref.setup.inputs.shape[0]
    assert dd.gammas.shape == (N, TOP_K)

    R_ggn = reduction_factor(ref.setup.loss_func, len(SUB_GGN))
    assert_rel(R_ggn * dd.lambdas.sum(0), evals)

    R = reduction_factor(ref.setup.loss_func, N)
    # One sign per direction, from the per-sample values; the sum follows it.
    gammas = align_signs(dd.gammas, ref.gammas(E, None))
    assert_rel(R * gammas.sum(0), E @ ref.gradient)


@pytest.mark.parametrize(
    "name", ["mlp_tanh-mse-sum", "conv1d-ce-mean", "residual-ce-sum"]
)
def test_all_directions_give_trace(name):
    """top_k=None spans range(G_S) ⊇ range(G_n), n ∈ S: Σ_k λ_nk = tr(G_n)."""
    ref = reference(name)
    ggn, evals, E = directions(ref, SUB_GGN, top_k=None)
    assert_residuals(ref.ggn(SUB_GGN), evals, E, ggn.gram().shape[0])
    dd = ggn.directional_derivatives()
    traces = torch.einsum("ndd->n", ref.ggns[SUB_GGN])
    assert_rel(dd.lambdas.sum(1), traces)


# ----------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------


def test_statistics():
    ref = reference("conv1d-ce-mean")  # N = 6
    ggn, _, _ = directions(ref, [0, 1, 3, 5])
    dd = ggn.directional_derivatives(top_k=TOP_K, subsampling_grad=[0, 2, 3, 4, 5])

    for samples, mean, var, snr in [
        (dd.gammas, dd.gamma_mean, dd.gamma_var, dd.gamma_snr),
        (dd.lambdas, dd.lambda_mean, dd.lambda_var, dd.lambda_snr),
    ]:
        n = samples.shape[0]
        expected_mean = samples.sum(0) / n
        expected_var = ((samples - expected_mean) ** 2).sum(0) / (n - 1)  # ddof=1
        # "Few operations": a sum of n terms and a division on either side,
        # within 2(n + 1)·ε·Σ|x|/n
        mean_error = rounding_rel(2 * (n + 1)) * samples.abs().sum(0) / n
        assert_within(mean, expected_mean, mean_error)
        # n squares of differences, their sum, a division, both sides: positive
        # terms, relative; a shift δ of the mean adds n·δ²/(n − 1) (Σ(x − m) = 0)
        var_error = rounding_rel(2 * (3 * n + 1)) * expected_var
        var_error = var_error + 2 * n * mean_error**2 / (n - 1)
        assert_within(var, expected_var, var_error)
        # snr = mean²/var: relative errors add, twice the mean's, plus 2 roundings
        snr_expected = expected_mean**2 / expected_var
        snr_rel = 2 * mean_error / expected_mean.abs() + var_error / expected_var
        assert_within(snr, snr_expected, (snr_rel + rounding_rel(4)) * snr_expected)
        assert mean.shape == var.shape == snr.shape == (TOP_K,)
    # λ_nk ≥ 0: the GGN is positive semi-definite
    assert (dd.lambdas >= 0).all()


def test_variance_of_one_sample_raises():
    ref = reference("mlp_tanh-mse-mean")
    ggn, _, _ = directions(ref, [2])  # one GGN sample
    dd = ggn.directional_derivatives(top_k=2, subsampling_grad=[4])  # one grad sample
    assert dd.gammas.shape == (1, 2) and dd.lambdas.shape == (1, 2)
    assert dd.gamma_mean.shape == dd.lambda_mean.shape == (2,)  # means exist
    for attribute, argument in [
        ("gamma_var", "subsampling_grad"),
        ("gamma_snr", "subsampling_grad"),
        ("lambda_var", "subsampling with"),
        ("lambda_snr", "subsampling with"),
    ]:
        with pytest.raises(InvalidSubsamplingError, match="at least two samples") as e:
            getattr(dd, attribute)
        assert isinstance(e.value, VivitError) and argument in str(e.value)


def test_snr_edge_cases():
    """Zero variance: snr = inf, or 0 if the mean is 0 as well."""
    evals = torch.tensor([1.0, 2.0, 3.0], dtype=DTYPE)
    gammas = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 3.0]], dtype=DTYPE)
    dd = DirectionalDerivatives(
        evals=evals, gammas=gammas, lambdas=gammas.abs(), gamma_bar=gammas.mean(0)
    )
    expected = torch.tensor([0.0, math.inf, 2.0**2 / 2.0], dtype=DTYPE)
    # small integers and halves: every operation is exact
    torch.testing.assert_close(dd.gamma_snr, expected, rtol=0, atol=0)
    torch.testing.assert_close(dd.lambda_snr, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------
# Monte-Carlo GGN
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mc_samples", [1, 3])
@pytest.mark.parametrize("name", ["mlp_sigmoid-ce-sum", "batchnorm1d-mse-mean"])
def test_mc_batch_relation_and_gammas(name, mc_samples):
    """With MC curvature R Σ_n λ_nk = λ_k stays exact and γ uses the MC directions."""
    ref = reference(name)
    gen = torch.Generator().manual_seed(7)
    ggn, evals, E = directions(ref, SUB_GGN, mc_samples=mc_samples, generator=gen)
    assert ggn.gram().shape == (len(SUB_GGN) * mc_samples,) * 2
    dd = ggn.directional_derivatives(top_k=TOP_K, subsampling_grad=SUB_GRAD)
    assert dd.lambdas.shape == (len(SUB_GGN), evals.numel())

    R_ggn = reduction_factor(ref.setup.loss_func, len(SUB_GGN))
    assert_rel(R_ggn * dd.lambdas.sum(0), evals)
    gammas = ref.gammas(E, SUB_GRAD)
    assert_rel(align_signs(dd.gammas, gammas), gammas)

    # The MC GGN is not the exact one: λ differ from e_kᵀ G_n e_k.
    # (apart by more than the bound they would be compared at if they were equal)
    assert_differs(dd.lambdas, ref.lambdas(E, SUB_GGN), EIGVEC_PRODUCT_REL)

    # Same for the BackPACK-hook API (its own MC draw).
    model, loss_func, X, y = ref.setup
    seen = []

    def top(all_evals):
        seen.append(all_evals)
        return list(range(all_evals.numel() - evals.numel(), all_evals.numel()))

    comp = DirectionalDerivativesComputation(
        subsampling_grad=SUB_GRAD, subsampling_ggn=SUB_GGN, mc_samples_ggn=mc_samples
    )
    groups = [{"params": list(model.parameters()), "criterion": top}]
    with backpack(
        *comp.get_extensions(), extension_hook=comp.get_extension_hook(groups)
    ):
        loss_func(model(X), y).backward()
    _, lambdas = comp.get_result(groups[0])
    (all_evals,) = seen
    assert all_evals.shape == (len(SUB_GGN) * mc_samples,)
    assert_rel(R_ggn * lambdas.sum(0), all_evals[-evals.numel() :])


@pytest.mark.parametrize(
    "name, mc_samples", [("mlp_tanh-ce-mean", 1), ("sequence_linear-mse-sum", 3)]
)
def test_mc_lambda_means_converge(name, mc_samples):
    """Σ_k λ_nk over all directions is tr(G_n^MC), an unbiased estimate of tr(G_n)."""
    ref = reference(name)
    model, loss_func, X, y = ref.setup
    gen = torch.Generator().manual_seed(0)
    runs = 200
    traces = torch.stack(
        [
            LowRankGGN(model, loss_func, (X, y), mc_samples=mc_samples, generator=gen)
            .directional_derivatives()
            .lambdas.sum(1)
            for _ in range(runs)
        ]
    )  # [runs, N]
    exact = torch.einsum("ndd->n", ref.ggns)

    mean = traces.mean(0)
    standard_error = traces.std(0) / math.sqrt(runs)
    assert (standard_error > 0).all()
    # 4 standard errors per sample (N ≤ 5 samples: a false alarm has p < 1e-3;
    # the seeded generator makes the outcome deterministic anyway).
    assert ((mean - exact).abs() <= 4 * standard_error).all(), (
        (mean - exact) / standard_error
    ).tolist()
    # The test discriminates: the band is narrower than a factor-2 scaling error...
    assert (4 * standard_error < 0.5 * exact).all()
    # ...and a single MC run is not the exact trace.
    assert_differs(traces[0], exact, REORDERED_REL)
