"""Tests of the dense references (``tests/reference.py``) and the problem registry."""

from __future__ import annotations

import pytest
import torch
from backpack import backpack
from backpack.extensions import SqrtGGNExact
from hypothesis import given, settings
from hypothesis import strategies as st
from problems import (
    ARCHITECTURES,
    PROBLEMS,
    Problem,
    default_dtype,
    get_problem,
    prepare,
    problem_ids,
    select,
)
from reference import (
    dense_ggn,
    dense_gradient,
    dense_hessian,
    eigh_reference,
    flatten_params,
    per_sample_ggns,
    per_sample_gradients,
    per_sample_losses,
    reduction_factor,
    unflatten,
)
from torch import Tensor, nn
from torch.fx import GraphModule

F64 = torch.float64


def _close(a: Tensor, b: Tensor, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Assert closeness, with ``atol`` relative to the larger magnitude."""
    scale = max(a.abs().max().item(), b.abs().max().item(), 1.0)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale)


# ----------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------


def test_flatten_unflatten_roundtrip():
    params = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 2, 2)]
    vec = flatten_params(params)
    assert vec.shape == (14,)
    assert torch.equal(vec[:6], params[0].flatten())
    for a, b in zip(unflatten(vec, params), params, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        unflatten(vec[:-1], params)


def test_reduction_factor():
    assert reduction_factor(nn.MSELoss(), 4) == 0.25
    assert reduction_factor(nn.CrossEntropyLoss(reduction="sum"), 4) == 1.0
    with pytest.raises(ValueError):
        reduction_factor(nn.MSELoss(reduction="none"), 4)


def test_eigh_reference():
    A = torch.randn(5, 3, dtype=F64)
    evals, evecs = eigh_reference(A @ A.T)
    assert evals.dtype == F64
    assert torch.all(evals[:-1] <= evals[1:])
    _close(evecs @ torch.diag(evals) @ evecs.T, A @ A.T)


# ----------------------------------------------------------------------------------
# Linear model: closed forms
# ----------------------------------------------------------------------------------


def _linear_jacobian(x: Tensor, C: int) -> Tensor:
    """J_n of z = W x + b w.r.t. (vec(W) row-major, b): [I_C ⊗ xᵀ, I_C], C × (CI+C)."""
    eye = torch.eye(C, dtype=x.dtype)
    return torch.cat([torch.kron(eye, x.unsqueeze(0)), eye], dim=1)


@settings(max_examples=15, deadline=None)
@given(
    N=st.integers(1, 6),
    I=st.integers(1, 4),
    C=st.integers(1, 4),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_linear_mse_closed_form(N: int, I: int, C: int, reduction: str, seed: int):
    """Linear + MSE: G = κ [[I_C ⊗ XᵀX, I_C ⊗ Xᵀ1], [I_C ⊗ 1ᵀX, N I_C]].

    L = ρ Σ_{n,c} (z_nc − y_nc)² with ρ = 1/(NC) ("mean") or 1 ("sum"), so the
    output Hessian is 2ρ·I and κ = 2ρ. The block layout follows the flattening
    (W row-major, then b): W[c, i] sits at c·I + i.
    """
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(N, I, generator=gen, dtype=F64)
    y = torch.randn(N, C, generator=gen, dtype=F64)
    model = nn.Linear(I, C).to(F64)
    loss_func = nn.MSELoss(reduction=reduction)

    kappa = 2.0 / (N * C) if reduction == "mean" else 2.0
    eye = torch.eye(C, dtype=F64)
    s = X.sum(0)
    expected = kappa * torch.cat(
        [
            torch.cat([torch.kron(eye, X.T @ X), torch.kron(eye, s[:, None])], dim=1),
            torch.cat([torch.kron(eye, s[None, :]), N * eye], dim=1),
        ]
    )
    G = dense_ggn(model, loss_func, X, y)
    _close(G, expected)
    # for a model linear in θ the GGN is the Hessian
    _close(dense_hessian(model, loss_func, X, y), expected)
    # per-sample GGNs: G_n = (2/C or 2) J_nᵀ J_n
    h = 2.0 / C if reduction == "mean" else 2.0
    Gn = per_sample_ggns(model, loss_func, X, y)
    for n in range(N):
        J = _linear_jacobian(X[n], C)
        _close(Gn[n], h * J.T @ J)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_ce_closed_form(reduction: str):
    """Linear + CE: G = R Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n, p_n = softmax(z_n)."""
    torch.manual_seed(0)
    N, I, C = 5, 3, 4
    X, y = torch.randn(N, I, dtype=F64), torch.randint(0, C, (N,))
    model = nn.Linear(I, C).to(F64)
    loss_func = nn.CrossEntropyLoss(reduction=reduction)

    p = model(X).softmax(-1).detach()
    R = 1.0 / N if reduction == "mean" else 1.0
    expected = R * sum(
        _linear_jacobian(X[n], C).T
        @ (torch.diag(p[n]) - torch.outer(p[n], p[n]))
        @ _linear_jacobian(X[n], C)
        for n in range(N)
    )
    _close(dense_ggn(model, loss_func, X, y), expected)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["mse", "ce", "bce"])
def test_linear_ggn_equals_hessian(loss: str, reduction: str):
    torch.manual_seed(1)
    N, I, C = 6, 3, 3
    X = torch.randn(N, I, dtype=F64)
    model = nn.Linear(I, C).to(F64)
    if loss == "mse":
        loss_func, y = nn.MSELoss(reduction=reduction), torch.randn(N, C, dtype=F64)
    elif loss == "ce":
        loss_func, y = (
            nn.CrossEntropyLoss(reduction=reduction),
            torch.randint(0, C, (N,)),
        )
    else:
        loss_func = nn.BCEWithLogitsLoss(reduction=reduction)
        y = torch.rand(N, C, dtype=F64)
    G = dense_ggn(model, loss_func, X, y)
    _close(G, dense_hessian(model, loss_func, X, y))
    R = reduction_factor(loss_func, N)
    _close(R * per_sample_ggns(model, loss_func, X, y).sum(0), G)


def test_param_subset_is_block():
    """The GGN w.r.t. some parameters is the corresponding block of the full GGN."""
    model, loss_func, X, y = get_problem("mlp_tanh-ce-mean").build(F64, seed=3)
    params = list(model.parameters())
    G = dense_ggn(model, loss_func, X, y)
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    chosen = [2, 5, 1]  # arbitrary order is respected
    idx = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in chosen])
    G_sub = dense_ggn(model, loss_func, X, y, params=[params[i] for i in chosen])
    _close(G_sub, G[idx][:, idx])
    g_sub = per_sample_gradients(model, loss_func, X, y, [params[i] for i in chosen])
    _close(g_sub, per_sample_gradients(model, loss_func, X, y)[:, idx])


def test_frozen_params_excluded():
    model, loss_func, X, y = get_problem("mlp_relu-mse-sum").build(F64)
    model[0].weight.requires_grad_(False)
    D = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert dense_ggn(model, loss_func, X, y).shape == (D, D)


def test_non_decomposable_loss_raises():
    model, _, X, y = get_problem("mlp_tanh-ce-mean").build(F64)
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    with pytest.raises(ValueError):
        per_sample_losses(model, weighted, X, y)


# ----------------------------------------------------------------------------------
# Every registry problem
# ----------------------------------------------------------------------------------

parametrize_problems = pytest.mark.parametrize(
    "problem", PROBLEMS, ids=problem_ids(PROBLEMS)
)


def test_registry():
    names = problem_ids()
    assert len(names) == len(set(names)) == 4 * len(ARCHITECTURES)
    assert {p.loss for p in PROBLEMS} == {"mse", "ce"}
    assert {p.reduction for p in PROBLEMS} == {"mean", "sum"}
    assert [p.name for p in select(architecture="residual")] == [
        "residual-mse-mean",
        "residual-mse-sum",
        "residual-ce-mean",
        "residual-ce-sum",
    ]
    assert all(p.needs_converter for p in select(architecture="residual"))


@parametrize_problems
def test_problem_builds(problem: Problem):
    rng_state = torch.get_rng_state()
    model, loss_func, X, y = problem.build(F64, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_state)  # global RNG untouched
    N, C = problem.batch_size, problem.num_outputs
    assert 4 <= N <= 8 and C >= 3 and N * C <= 60
    assert X.dtype == F64 and X.shape[0] == N
    out = model(X)
    assert out.shape == (N, C)
    if problem.loss == "mse":
        assert y.dtype == F64 and y.shape == (N, C)
    else:
        assert y.dtype == torch.long and y.shape == (N,)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert not any(m.training for m in bns)
    assert sum(p.numel() for p in model.parameters()) <= 5000

    # deterministic given the seed, different for another seed
    model2, _, X2, y2 = problem.build(F64, seed=0)
    assert torch.equal(X, X2) and torch.equal(y, y2)
    sd, sd2 = model.state_dict(), model2.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    _, _, X3, _ = problem.build(F64, seed=1)
    assert not torch.equal(X, X3)

    # float32 holds the same numbers
    model32, _, X32, y32 = problem.build(torch.float32, seed=0)
    assert X32.dtype == torch.float32 and torch.equal(X32.to(F64), X)
    p32 = flatten_params(list(model32.parameters()))
    assert p32.dtype == torch.float32
    assert torch.equal(p32.to(F64), flatten_params(list(model.parameters())))


@parametrize_problems
def test_prepare(problem: Problem):
    model, loss_func, X, y = prepare(problem, F64, seed=0)
    assert isinstance(model, GraphModule) == problem.needs_converter
    assert getattr(loss_func, "_backpack_extend", False)
    plain_model, plain_loss, _, _ = prepare(problem, F64, seed=0, extend=False)
    _close(model(X), plain_model(X))
    # hooks of the extended modules do not change the reference
    _close(dense_ggn(model, loss_func, X, y), dense_ggn(plain_model, plain_loss, X, y))


@parametrize_problems
def test_dense_ggn_symmetric_psd(problem: Problem):
    model, loss_func, X, y = prepare(problem, F64, seed=0)
    G = dense_ggn(model, loss_func, X, y)
    D = sum(p.numel() for p in model.parameters())
    assert G.shape == (D, D) and G.dtype == F64
    assert torch.isfinite(G).all()
    _close(G, G.T, rtol=0, atol=1e-14)
    evals, _ = eigh_reference(G)
    assert evals[-1] > 0
    assert evals[0] >= -1e-10 * evals[-1]
    h_rank = problem.num_outputs - (1 if problem.loss == "ce" else 0)
    rank = (evals > 1e-10 * evals[-1]).sum().item()
    assert rank <= problem.batch_size * h_rank


@parametrize_problems
def test_per_sample_ggns(problem: Problem):
    model, loss_func, X, y = prepare(problem, F64, seed=0)
    N = len(X)
    G = dense_ggn(model, loss_func, X, y)
    Gn = per_sample_ggns(model, loss_func, X, y)
    assert Gn.shape == (N, *G.shape)
    _close(reduction_factor(loss_func, N) * Gn.sum(0), G)
    for n in (0, N - 1):
        # G_n is the GGN of the loss applied to sample n alone
        _close(Gn[n], dense_ggn(model, loss_func, X, y, subsampling=[n]))


@parametrize_problems
def test_per_sample_gradients(problem: Problem):
    model, loss_func, X, y = prepare(problem, F64, seed=0)
    N = len(X)
    g = per_sample_gradients(model, loss_func, X, y)
    params = list(model.parameters())
    assert g.shape == (N, sum(p.numel() for p in params))

    # R Σ_n ∇ℓ_n = ∇L, from torch.autograd on the batch loss
    grad = torch.autograd.grad(loss_func(model(X), y), params)
    _close(reduction_factor(loss_func, N) * g.sum(0), flatten_params(grad))
    _close(dense_gradient(model, loss_func, X, y), flatten_params(grad))

    # ∇ℓ_n from torch.autograd on a batch holding sample n only
    for n in range(N):
        loss_n = loss_func(model(X[n : n + 1]), y[n : n + 1])
        _close(g[n], flatten_params(torch.autograd.grad(loss_n, params)))

    # ℓ_n with L = R Σ_n ℓ_n
    losses = per_sample_losses(model, loss_func, X, y)
    assert losses.shape == (N,)
    _close(reduction_factor(loss_func, N) * losses.sum(), loss_func(model(X), y))


@parametrize_problems
def test_subsampled_ggn(problem: Problem):
    model, loss_func, X, y = prepare(problem, F64, seed=0)
    idx = [3, 0, 1]
    G_sub = dense_ggn(model, loss_func, X, y, subsampling=idx)
    _close(G_sub, dense_ggn(model, loss_func, X[idx], y[idx]))
    # mean: average of the chosen samples' G_n; sum: their sum
    Gn = per_sample_ggns(model, loss_func, X, y)[idx]
    R_sub = reduction_factor(loss_func, len(idx))
    _close(G_sub, R_sub * Gn.sum(0))


@parametrize_problems
def test_float32_problem_same_reference(problem: Problem):
    """References run in float64, and float32 problems hold the same numbers."""
    G64 = dense_ggn(*prepare(problem, F64, seed=0))
    G32 = dense_ggn(*prepare(problem, torch.float32, seed=0))
    assert G32.dtype == F64
    _close(G32, G64, rtol=1e-12, atol=1e-14)


@parametrize_problems
def test_agrees_with_backpack(problem: Problem):
    """BackPACK's exact GGN square root V gives V Vᵀ = G (and the reference may be
    computed between BackPACK's forward and backward pass without disturbing it)."""
    model, loss_func, X, y = prepare(problem, F64, seed=0)
    loss = loss_func(model(X), y)
    G = dense_ggn(model, loss_func, X, y)
    with default_dtype(F64), backpack(SqrtGGNExact()):
        loss.backward()
    V = torch.cat(
        [p.sqrt_ggn_exact.flatten(start_dim=2) for p in model.parameters()], dim=2
    ).flatten(end_dim=1)
    _close(V.T @ V, G)
