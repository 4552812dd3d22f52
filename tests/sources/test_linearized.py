"""Linearized products: a part's forward pass recorded once per solve
(``docs/math.rst``, "Linearized products").

Tolerances (:ref:`math-test-tolerances`): ``J v`` and ``Jᵀ w`` of the recording and
of forward mode are the same sums in another order (``REORDERED_REL`` of the
largest entry); eigenvalues within ``EIGVAL_RTOL·λ_max`` of the dense reference.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.data import DataLoader, TensorDataset

from tests.fixtures.checks import EIGVAL_RTOL, REORDERED_REL, assert_top_eigvals
from tests.fixtures.func_problems import (
    FUNC_PROBLEMS,
    PADDED_PROBLEMS,
    NoForwardMode,
)
from tests.fixtures.memory import available
from tests.fixtures.reference import dense_ggn
from vivit import LowRankGGN
from vivit.engines.func.implicit import PartFunction
from vivit.engines.func.linearized import LinearizedPart, check_linearization
from vivit.memory.plan import Plan

PROBLEMS = {p.name: p for p in FUNC_PROBLEMS + PADDED_PROBLEMS}
TOP_K = 3


def _assert_reordered(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within ``REORDERED_REL`` of the largest entry (another order of sums)."""
    bound = REORDERED_REL * expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= bound


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_recorded_products_equal_forward_and_reverse_mode(name):
    s = PROBLEMS[name].setup()
    params = [p for p in s.model.parameters() if p.requires_grad]
    function = PartFunction(s.model, params, s.inputs, None)
    linearized = LinearizedPart(function)
    generator = torch.Generator().manual_seed(0)
    tangents = [
        torch.randn(2, *p.shape, generator=generator, dtype=p.dtype) for p in params
    ]
    output, forward = function.jvp(tangents)
    recorded_output, recorded = linearized.jvp(tangents)
    _assert_reordered(recorded_output, output.detach())  # vmap may reorder too
    _assert_reordered(recorded, forward)
    cotangents = torch.randn(forward.shape, generator=generator, dtype=forward.dtype)
    for actual, expected in zip(
        linearized.vjp(cotangents), function.vjp(cotangents), strict=True
    ):
        _assert_reordered(actual, expected)
    # a recording serves many products: the second equals the first exactly
    assert torch.equal(linearized.jvp(tangents)[1], recorded)


class Counting(nn.Module):
    """A small MLP whose forward counts its runs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.body(x)


def _data(batches: int):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4 * batches, 5, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 3, (4 * batches,), generator=generator)
    return inputs, targets


@pytest.mark.parametrize("kept", [None, 1, 0], ids=["all", "one", "none"])
def test_a_solve_runs_the_forward_once_per_recorded_part(monkeypatch, kept):
    """Three batches; the plan keeps the recordings of all, one or none of them."""
    torch.manual_seed(0)
    model, loss_func = Counting().double(), nn.CrossEntropyLoss()
    inputs, targets = _data(3)
    if kept is not None:
        monkeypatch.setattr(Plan, "linearized_parts", lambda self, top_k: kept)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4)
    ggn = LowRankGGN(model, loss_func, loader, route="implicit")
    before = model.runs
    evals, _ = ggn.eigh(top_k=TOP_K)
    runs = model.runs - before
    blocks = ggn._source._data.passes - 1  # the construction's pass
    recorded = 3 if kept is None else kept
    assert blocks > 1  # recordings reused
    # a recorded part runs once; another its jvp and vjp forward in every pass
    assert runs == recorded + 2 * (3 - recorded) * blocks
    G = dense_ggn(model, loss_func, inputs, targets)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


class _Tanh(torch.autograd.Function):
    """``tanh`` with a forward-mode rule; subclasses give the backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def jvp(ctx, tangent):
        (output,) = ctx.saved_tensors
        return tangent * (1 - output**2)


class OnceDifferentiableTanh(_Tanh):
    """A backward that is not differentiable (torch drops its backward's path)."""

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (output,) = ctx.saved_tensors
        return grad * (1 - output**2)


class NoDoubleBackward(NoForwardMode):
    """``g ↦ g`` whose backward raises, as an aten backward without a derivative."""

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the derivative for 'NoDoubleBackward' is not implemented")


class UndifferentiatedTanh(_Tanh):
    """A backward through an operation that has no backward rule."""

    @staticmethod
    def backward(ctx, grad):
        (output,) = ctx.saved_tensors
        return NoDoubleBackward.apply(grad) * (1 - output**2)


class DetachedTanh(_Tanh):
    """A backward whose own backward drops the output's gradient (a wrong rule)."""

    @staticmethod
    def backward(ctx, grad):
        (output,) = ctx.saved_tensors
        return grad.detach() * (1 - output**2)


class LinearTanh(nn.Module):
    """Linear, an activation, Linear."""

    def __init__(self, activation=torch.tanh):
        super().__init__()
        self.first, self.second = nn.Linear(5, 4), nn.Linear(4, 3)
        self.activation = activation

    def forward(self, x):
        return self.second(self.activation(self.first(x)))


@pytest.mark.parametrize(
    ("tanh", "reason"),
    [
        (UndifferentiatedTanh, "has no backward rule"),
        (OnceDifferentiableTanh, "differs from forward mode's"),
        (DetachedTanh, "differs from forward mode's"),
    ],
)
def test_a_backward_without_its_own_rule_runs_forward_mode(caplog, tanh, reason):
    torch.manual_seed(0)
    model, loss_func = LinearTanh(tanh.apply).double(), nn.CrossEntropyLoss()
    inputs, targets = _data(1)
    params = list(model.parameters())
    assert reason in check_linearization(PartFunction(model, params, inputs, None))
    with caplog.at_level(logging.INFO, logger="vivit"):
        ggn = LowRankGGN(model, loss_func, (inputs, targets), route="implicit")
    assert reason in caplog.text
    evals, _ = ggn.eigh(top_k=TOP_K)
    model.activation = torch.tanh  # the same function for the reference
    G = dense_ggn(model, loss_func, inputs, targets)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


def test_a_model_that_records_checks_without_a_reason():
    torch.manual_seed(0)
    model = LinearTanh().double()
    inputs, _ = _data(1)
    params = list(model.parameters())
    assert check_linearization(PartFunction(model, params, inputs, None)) is None


def test_the_plan_keeps_the_recordings_that_fit(monkeypatch):
    """Beside the solve's basis, as many parts as their measured recordings fit;
    the estimate holds them."""
    model, loss_func = Counting().double(), nn.CrossEntropyLoss()
    inputs, targets = _data(3)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4)
    plan = LowRankGGN(model, loss_func, loader, route="implicit").plan
    assert plan.linearized_parts(TOP_K) == 3
    width = plan.pass_width(TOP_K)
    kept = plan.measured("implicit").kept(plan.sizes.part, width)
    assert kept > 0  # the recording: activations and the pullback's graph
    every = plan.implicit_estimate(TOP_K)
    alone = every.total - int(2 * kept)  # the first part's recording is a pass's
    for room, parts in [(0, 1), (1.5 * kept, 2), (2 * kept, 3)]:
        available(monkeypatch, int(alone + room))
        assert plan.linearized_parts(TOP_K) == parts
        estimate = plan.implicit_estimate(TOP_K)
        assert estimate.basis_columns == every.basis_columns  # the basis first
        recorded = every.passes - 2 * kept + (parts - 1) * kept
        assert abs(estimate.passes - recorded) <= 1  # whole bytes
