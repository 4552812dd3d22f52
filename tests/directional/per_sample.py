"""A registry problem's dense per-sample gradients and GGNs, computed once."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from tests.fixtures.problems import Setup, get_problem, prepare
from tests.fixtures.reference import (
    dense_gradient,
    per_sample_ggns,
    per_sample_gradients,
)


class Reference(NamedTuple):
    """The extended float64 problem and its dense per-sample quantities."""

    setup: Setup
    grads: torch.Tensor  # [N, D] per-sample gradients ∇ℓ_n
    ggns: torch.Tensor  # [N, D, D] per-sample GGNs G_n
    gradient: torch.Tensor | None  # [D] ∇L


@functools.cache
def reference(name: str) -> Reference:
    """The references of the registry problem ``name`` (float64, seed 0)."""
    setup = prepare(get_problem(name), torch.float64, seed=0)
    model, loss_func, X, y = setup
    return Reference(
        setup,
        per_sample_gradients(model, loss_func, X, y),
        per_sample_ggns(model, loss_func, X, y),
        dense_gradient(model, loss_func, X, y),
    )
