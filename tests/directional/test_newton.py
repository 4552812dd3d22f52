"""Directionally damped Newton steps against the dense formula of ``docs/math.rst``.

    Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k,   γ̄_k = R_grad Σ_{n ∈ grad samples} e_kᵀ∇ℓ_n

with R_grad = 1/|S_grad| (mean) or 1 (sum); δ_k = ∞ means no step along e_k.
Each term γ̄_k e_k is invariant under e_k → −e_k, so the step can be compared
directly. The (e_k, λ_k) are vivit's eigenpairs, asserted to be eigenpairs of the
dense GGN; γ̄ comes from dense per-sample gradients.

Tolerance: float64, relative 1e-10 in norm (see ``test_directional.py`` for the
error budget; 1/(λ_k + δ_k) amplifies absolute errors no more than the step
itself is amplified).
"""

from __future__ import annotations

import math

import pytest
import torch
from backpack import backpack

from tests.fixtures.checks import (
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    assert_eigenpairs,
    assert_rel,
    assert_within,
    flat_evecs,
    orthonormality_bound,
)
from tests.fixtures.per_sample import Reference, reference
from tests.fixtures.problems import get_problem
from tests.fixtures.reference import (
    flatten_params,
    reduction_factor,
)
from vivit import DirectionalDampedNewtonComputation, LowRankGGN
from vivit.optim import ConstantDamping, NewtonStep

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing:UserWarning"
)

DTYPE = torch.float64
REL = EIGVEC_PRODUCT_REL
TOP_K = 3
SUB_GGN = [0, 2, 3]
SUB_GRAD = [1, 3, 2]

NAMES = [
    "mlp_tanh-mse-mean",
    "mlp_relu-ce-sum",
    "cnn-ce-mean",
    "conv1d-mse-sum",
    "batchnorm2d-mse-mean",
    "residual-ce-sum",
]


def eigenpairs(ref: Reference, ggn: LowRankGGN, top_k, samples):
    """vivit's eigenpairs, checked against the dense GGN of ``samples``."""
    evals, evecs = ggn.eigh(top_k=top_k)
    E = flat_evecs(evecs)  # [K, D]
    assert_eigenpairs(evals, evecs, ref.ggn(samples), ggn.gram().shape[0])
    return evals, E


def assert_step(step: list[torch.Tensor], params, expected: torch.Tensor) -> None:
    assert [s.shape for s in step] == [p.shape for p in params]
    actual = flatten_params(step)
    assert expected.norm() > 0
    assert (actual - expected).norm() <= REL * expected.norm(), (
        (actual - expected).norm() / expected.norm()
    ).item()


def k_dependent(evals, gram_evecs, gammas, lambdas):
    """δ_k = (k + 1) · λ_max / 10: different for every direction."""
    K = evals.numel()
    return evals.max() * torch.arange(1, K + 1, dtype=evals.dtype) / 10


def skip_some(evals, gram_evecs, gammas, lambdas):
    """No step along the 1st and 3rd direction, undamped along the others."""
    dampings = torch.zeros_like(evals)
    dampings[0::2] = math.inf
    return dampings


DAMPINGS = {
    "constant": 0.7,
    "constant_callable": ConstantDamping(0.7),
    "k_dependent": k_dependent,
    "skip_some": skip_some,
}


def evaluated(damping, evals):
    """The dampings a (constant or callable) damping gives for ``evals``."""
    if callable(damping):
        return damping(evals, None, None, None)
    return torch.full_like(evals, damping)


@pytest.mark.parametrize("damping", DAMPINGS.values(), ids=DAMPINGS.keys())
@pytest.mark.parametrize("name", NAMES)
def test_lowrank_newton(name, damping):
    ref = reference(name)
    model, loss_func, X, y = ref.setup
    params = list(model.parameters())
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=SUB_GGN)
    evals, E = eigenpairs(ref, ggn, TOP_K, SUB_GGN)
    dampings = evaluated(damping, evals)
    expected, gamma_bar = ref.newton_step(evals, E, dampings, SUB_GRAD)

    newton = ggn.newton(top_k=TOP_K, damping=damping, subsampling_grad=SUB_GRAD)
    assert isinstance(newton, NewtonStep)
    assert_step(newton.step, params, expected)

    # Fields: dampings as used, γ̄ (sign-aligned with the dense one), derivatives.
    torch.testing.assert_close(newton.dampings, dampings, rtol=0, atol=0)
    signs = torch.sign(newton.gamma_bar * gamma_bar)
    torch.testing.assert_close(
        signs * newton.gamma_bar, gamma_bar, rtol=0, atol=REL * gamma_bar.abs().max()
    )
    dd = ggn.directional_derivatives(top_k=TOP_K, subsampling_grad=SUB_GRAD)
    for field in ("evals", "gammas", "lambdas"):
        torch.testing.assert_close(
            getattr(newton.directional, field), getattr(dd, field), rtol=0, atol=0
        )
    # γ̄ is R_grad Σ_n γ_nk of the returned derivatives
    R_grad = reduction_factor(loss_func, len(SUB_GRAD))
    assert_rel(newton.gamma_bar, R_grad * dd.gammas.sum(0), REORDERED_REL)

    # newton_step is newton(...).step
    step = ggn.newton_step(top_k=TOP_K, damping=damping, subsampling_grad=SUB_GRAD)
    for s, t in zip(step, newton.step, strict=True):
        torch.testing.assert_close(s, t, rtol=0, atol=0)

    # No step along skipped directions: e_kᵀ Δθ = Σ_j c_j e_kᵀe_j = 0 for δ_k = ∞,
    # up to the eigenvectors' orthonormality (math-precision, "Eigenvectors").
    projections = E @ flatten_params(newton.step)
    skipped = dampings.isinf()
    nc, dim = ggn.gram().shape[0], E.shape[1]
    overlap = orthonormality_bound(evals, evals.max().item(), nc, dim)
    allowed = (overlap[skipped][:, ~skipped] * projections[~skipped].abs()).sum(1)
    assert (projections[skipped].abs() <= allowed).all()
    assert (projections[~skipped].abs() > 0).all()


@pytest.mark.parametrize("name", ["mlp_sigmoid-ce-mean", "sequence_linear-mse-sum"])
def test_lowrank_newton_all_directions_all_samples(name):
    """top_k=None, all samples for both gradient and curvature."""
    ref = reference(name)
    model, loss_func, X, y = ref.setup
    ggn = LowRankGGN(model, loss_func, (X, y))
    evals, E = eigenpairs(ref, ggn, None, None)
    assert evals.numel() > TOP_K
    expected, _ = ref.newton_step(evals, E, evals.max().item(), None)
    newton = ggn.newton(damping=evals.max().item())
    assert newton.dampings.shape == evals.shape
    assert_step(newton.step, list(model.parameters()), expected)


def test_damping_receives_derivatives():
    """A damping gets (evals [K], gram_evecs [N·C, K], γ [N_grad, K], λ [N_ggn, K])."""
    ref = reference("conv1d-mse-sum")
    model, loss_func, X, y = ref.setup
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=SUB_GGN)
    calls = []

    def spy(*args):
        calls.append(args)
        return torch.ones_like(args[0])

    ggn.newton(top_k=TOP_K, damping=spy, subsampling_grad=SUB_GRAD)
    ((evals, gram_evecs, gammas, lambdas),) = calls
    dd = ggn.directional_derivatives(top_k=TOP_K, subsampling_grad=SUB_GRAD)
    C = get_problem("conv1d-mse-sum").num_outputs
    assert gram_evecs.shape == (len(SUB_GGN) * C, TOP_K)
    nc = gram_evecs.shape[0]  # eigenvectors of the N·C Gram matrix itself
    assert_within(
        gram_evecs.T @ gram_evecs,
        torch.eye(TOP_K, dtype=DTYPE),
        orthonormality_bound(evals, evals.max().item(), nc, nc),
    )
    for actual, expected in [(evals, dd.evals), (gammas, dd.gammas)]:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(lambdas, dd.lambdas, rtol=0, atol=0)


@pytest.mark.parametrize(
    "damping",
    [ConstantDamping(0.7), k_dependent, skip_some],
    ids=["constant", "k_dependent", "skip_some"],
)
@pytest.mark.parametrize("name", NAMES)
def test_computation_newton(name, damping):
    """The BackPACK-hook API with a top-3 criterion."""
    ref = reference(name)
    model, loss_func, X, y = ref.setup
    params = list(model.parameters())
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=SUB_GGN)
    evals, E = eigenpairs(ref, ggn, TOP_K, SUB_GGN)
    expected, _ = ref.newton_step(evals, E, evaluated(damping, evals), SUB_GRAD)

    comp = DirectionalDampedNewtonComputation(
        subsampling_grad=SUB_GRAD, subsampling_ggn=SUB_GGN
    )
    group = {
        "params": params,
        "criterion": lambda ev: list(range(ev.numel() - TOP_K, ev.numel())),
        "damping": damping,
    }
    loss = loss_func(model(X), y)
    with backpack(
        *comp.get_extensions(), extension_hook=comp.get_extension_hook([group])
    ):
        loss.backward()
    assert_step(comp.get_result(group), params, expected)
