"""The counter of a measured call: multiply-adds, and the stop at a budget."""

from __future__ import annotations

import pytest
import torch

from vivit.memory.costs import pass_cost
from vivit.memory.counter import WorkExceeded, measure

M, K, N = 8, 16, 4


A, B, ONES = torch.randn(M, K), torch.randn(K, N), torch.ones(N, 1)


def _products():
    """Two products, ``M·K·N + M·N`` multiply-adds, in two operations."""
    return (A @ B) @ ONES


def test_multiply_adds_are_counted_exactly():
    _, usage = measure(_products)
    assert (usage.work, usage.ops) == (M * K * N + M * N, 2)


def test_a_budget_stops_the_call_where_its_cost_passes_it():
    """Under the budget it runs to the end; above, it stops at the first
    operation whose cumulative cost passes it, and says that cost."""
    _, usage = measure(_products)
    whole = pass_cost(usage.work, usage.ops)
    _, again = measure(_products, budget=whole)
    assert again.work == usage.work
    first = pass_cost(M * K * N, 1)
    with pytest.raises(WorkExceeded) as stop:
        measure(_products, budget=first - 1)
    assert stop.value.cost == first  # the first product's


def test_a_stop_passes_through_a_backward_pass():
    """Operations of autograd's backward are counted and stopped as any other."""
    weight = torch.randn(K, N, requires_grad=True)
    x = torch.randn(M, K)
    with pytest.raises(WorkExceeded):
        measure(lambda: torch.autograd.grad((x @ weight).sum(), weight), budget=1.0)
