"""Products with ``V`` and ``G̃ = Vᵀ V`` of a parameter group, from its factors.

Sums over the group's parameters (``factors``, one each): none forms the group's ``V``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from vivit.gram import ParamFactors


def group_gram(factors: Sequence[ParamFactors]) -> Tensor:
    """The Gram matrix ``G̃ = Σ_p V_pᵀ V_p`` of a group, ``[N·C, N·C]``."""
    gram = factors[0].gram()
    for f in factors[1:]:
        gram.add_(f.gram())
    return gram


def gram_matmul(factors: Sequence[ParamFactors], vectors: Tensor) -> Tensor:
    """``G̃ U = Σ_p V_pᵀ (V_p U)`` for columns ``U`` ``[N·C, K]``, without ``G̃``."""
    rows = vectors.T.contiguous()
    result = factors[0].vtmp(factors[0].vmp(rows))
    for f in factors[1:]:
        result.add_(f.vtmp(f.vmp(rows)))
    return result.T


def vt_matmul(factors: Sequence[ParamFactors], vectors: Sequence[Tensor]) -> Tensor:
    """``Vᵀ W``, ``[K, N·C]``, for one tensor ``[K, *p.shape]`` per parameter."""
    pairs = list(zip(factors, vectors, strict=True))
    result = pairs[0][0].vtmp(pairs[0][1])
    for f, w in pairs[1:]:
        result.add_(f.vtmp(w))
    return result


def v_matmul(factors: Sequence[ParamFactors], coefficients: Tensor) -> list[Tensor]:
    """``V u`` for rows ``[K, N·C]``: one tensor ``[K, *p.shape]`` per parameter."""
    return [f.vmp(coefficients) for f in factors]


def num_params(factors: Sequence[ParamFactors]) -> int:
    """Number of parameters ``D`` of the group (rows of ``V``)."""
    return sum(f.param_shape.numel() for f in factors)


class VProducts(Protocol):
    """Products with ``V`` and ``G̃`` of one group: from factors, or passes over data."""

    dtype: torch.dtype  # the type the products run in

    def v_matmul(self, coefficients: Tensor) -> list[Tensor]:
        """``V u`` for Gram-space rows ``[K, N·C]``: one ``[K, *p.shape]`` each."""

    def vt_matmul(self, vectors: Sequence[Tensor]) -> Tensor:
        """``Vᵀ W`` for parameter-space vectors ``[K, *p.shape]``: ``[K, N·C]``."""

    def gram_matmul(self, vectors: Tensor) -> Tensor:
        """``G̃ U`` for Gram-space columns ``[N·C, K]``: ``[N·C, K]``."""


class FactorProducts:
    """:class:`VProducts` of a group from its stored factors, one per parameter."""

    def __init__(self, factors: Sequence[ParamFactors]):
        self.factors = list(factors)
        self.dtype = self.factors[0].dtype

    def v_matmul(self, coefficients: Tensor) -> list[Tensor]:  # noqa: D102
        return v_matmul(self.factors, coefficients)

    def vt_matmul(self, vectors: Sequence[Tensor]) -> Tensor:  # noqa: D102
        return vt_matmul(self.factors, vectors)

    def gram_matmul(self, vectors: Tensor) -> Tensor:  # noqa: D102
        return gram_matmul(self.factors, vectors)
