"""Every supported loss option end to end: LowRankGGN against the dense GGN.

The reference is the dense float64 GGN of ``loss_func`` exactly as the module
computes it (``tests/fixtures/reference.py``: torch.func Hessian of the module's
output), on the GGN samples alone. Checked per option, both reductions, with and without
subsampling: the eigenvalues, the gradient, the batch relations
``γ̄_k = e_kᵀ ∇L_{S_grad}`` (the loss on the gradient samples alone) and
``R_S Σ_n λ_nk = λ_k``, and the ViViT-compatible hook API.

Tolerances as in ``tests/fixtures/checks.py`` (float64: 1e-10·λ_max for eigenvalues);
directional quantities 1e-9 relative to the largest entry: float64 products over
D ≤ 80 parameters, while a wrong normalization (a counted ignored sample, an
ignored weight) is an O(1e-1) relative error.
"""

from __future__ import annotations

import pytest
import torch
from backpack import backpack, extend
from torch import nn

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    flat_evecs,
)
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn, dense_gradient
from vivit import EigvalshComputation, LowRankGGN

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing:UserWarning"
)

N, C, T = 5, 4, 3
W = [0.5, 2.0, 1.0, 0.25]


def _seq():  # [N, 3, T] -> [N, C, T]: class axis 1, positions last
    return nn.Sequential(nn.Conv1d(3, 5, 1), nn.Tanh(), nn.Conv1d(5, C, 1))


def _labels(shape, gen, ignore=None):
    y = torch.randint(0, C, shape, generator=gen)
    if ignore is not None:
        y[1] = ignore  # one sample fully ignored
        y.reshape(len(y), -1)[3, 0] = ignore  # one partly ignored
    return y


def _setup(name: str, reduction: str, dtype=torch.float64):
    """(model, loss_func, X, y) for a named loss option."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    seq = "seq" in name
    model = (_seq() if seq else mlp(3, 5, C)).to(dtype)
    X = torch.randn((N, 3, T) if seq else (N, 3), generator=gen).to(dtype)
    label_shape = (N, T) if seq else (N,)
    out_shape = (N, C, T) if seq else (N, C)
    weight = torch.tensor(W, dtype=dtype)
    kwargs = {"reduction": reduction}
    if name.startswith("ce"):
        if "weight" in name:
            kwargs["weight"] = weight
        if "smooth" in name:
            kwargs["label_smoothing"] = 0.2
        if "custom" in name:
            kwargs["ignore_index"] = 1
        loss_func = nn.CrossEntropyLoss(**kwargs)
        if "soft" in name:
            y = 2 * torch.rand(out_shape, generator=gen).to(dtype)
        else:
            ignore = 1 if "custom" in name else (-100 if "ignore" in name else None)
            y = _labels(label_shape, gen, ignore)
    elif name.startswith("mse"):
        loss_func = nn.MSELoss(**kwargs)
        y = torch.randn(out_shape, generator=gen).to(dtype)
    else:
        if "weight" in name:
            shape = (C, 1) if seq else (C,)  # broadcast over positions
            weight = torch.tensor([1.0, 0.5, 2.0, 1.5], dtype=dtype)
            pos_weight = torch.tensor([3.0, 0.2, 1.0, 2.0], dtype=dtype)
            kwargs["weight"] = weight.reshape(shape)
            kwargs["pos_weight"] = pos_weight.reshape(shape)
        loss_func = nn.BCEWithLogitsLoss(**kwargs)
        y = torch.rand(out_shape, generator=gen).to(dtype)
    return extend(model), extend(loss_func), X, y


OPTIONS = [
    "ce-ignore",
    "ce-ignore-custom",
    "ce-seq-ignore",
    "ce-weight",
    "ce-weight-smooth-ignore",
    "ce-seq-weight-smooth-ignore",
    "ce-soft",
    "ce-seq-soft-weight-smooth",
    "bce",
    "bce-weight",
    "bce-seq-weight",
    "mse-seq",
]


@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("subsampling", [None, [4, 1, 3]], ids=["full", "sub"])
def test_eigenpairs_gradient_and_batch_relations(
    option, reduction, subsampling, engine
):
    model, loss_func, X, y = _setup(option, reduction)
    G = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    reference = torch.linalg.eigvalsh(G)
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=subsampling, engine=engine)
    assert_top_eigvals(ggn.eigvalsh(), reference, EIGVAL_RTOL[torch.float64])
    evals, evecs = ggn.eigh(top_k=3)
    report = ggn.solver_report()
    tol = None if report is None else report.tolerance
    assert_eigenpairs(evals, evecs, G, ggn.gram().shape[0], tol)

    gradient = torch.cat([g.flatten() for g in ggn.gradient()])
    expected = dense_gradient(model, loss_func, X, y)
    assert_rel(gradient, expected, REORDERED_REL)  # the dense reference's sums

    # γ̄ is the directional gradient of the loss on the gradient samples alone
    grad_samples = [2, 3, 0]
    directional = ggn.directional_derivatives(top_k=3, subsampling_grad=grad_samples)
    E = flat_evecs(evecs)
    idx = torch.tensor(grad_samples)
    grad_sub = dense_gradient(model, loss_func, X[idx], y[idx])
    assert_rel(directional.gamma_bar, E @ grad_sub, EIGVEC_PRODUCT_REL)

    # R_S Σ_n λ_nk = λ_k with R_S of the GGN samples
    R = ggn._group(0).batch.ggn_reduction_factor
    assert_rel(R * directional.lambdas.sum(0), evals, EIGVEC_PRODUCT_REL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignored_targets_issue_example(reduction):
    """Issue 11: ignored samples must not count (top eigenvalues were too large)."""
    model, loss_func, X, y = _setup("ce-ignore", reduction)
    with_ignored = LowRankGGN(model, loss_func, (X, y)).eigvalsh()
    counted = torch.tensor([n for n in range(N) if (y[n] != -100).any()])
    alone = LowRankGGN(model, loss_func, (X[counted], y[counted])).eigvalsh()
    # the ignored sample has no curvature: same non-zero spectrum as without it
    # two Gram matrices of the same non-zero spectrum: eigenvalues (Weyl)
    assert_top_eigvals(with_ignored[-3:], alone, 2 * EIGVAL_RTOL[torch.float64])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float32(reduction):
    model, loss_func, X, y = _setup("ce-seq-weight-smooth-ignore", reduction)
    reference = torch.linalg.eigvalsh(dense_ggn(model, loss_func, X, y))
    model32, loss32, X32, y32 = _setup(
        "ce-seq-weight-smooth-ignore", reduction, torch.float32
    )
    evals = LowRankGGN(model32, loss32, (X32, y32)).eigvalsh()
    assert evals.dtype == torch.float32
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float32])


@pytest.mark.parametrize("option", ["ce-seq-weight-smooth-ignore", "bce-weight"])
def test_hook_api(option):
    model, loss_func, X, y = _setup(option, "mean")
    subsampling = [3, 1]
    reference = torch.linalg.eigvalsh(
        dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    )
    computation = EigvalshComputation(subsampling=subsampling)
    groups = [{"params": list(model.parameters())}]
    with backpack(
        computation.get_extension(),
        extension_hook=computation.get_extension_hook(groups),
    ):
        loss_func(model(X), y).backward()
    assert_top_eigvals(
        computation.get_result(groups[0]), reference, EIGVAL_RTOL[torch.float64]
    )
