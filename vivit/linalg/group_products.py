"""Products with ``V`` and ``G̃ = Vᵀ V`` of a group, summed over its parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from vivit.gram import ParamFactors
from vivit.gram.factors import summed


def group_gram(factors: Sequence[ParamFactors]) -> Tensor:
    """The Gram matrix ``G̃ = Σ_p V_pᵀ V_p`` of a group, ``[N·C, N·C]``."""
    return summed(f.gram() for f in factors)


def gram_matmul(factors: Sequence[ParamFactors], vectors: Tensor) -> Tensor:
    """``G̃ U = Σ_p V_pᵀ (V_p U)`` for columns ``U`` ``[N·C, K]``, without ``G̃``."""
    rows = vectors.T.contiguous()
    return summed(f.vtmp(f.vmp(rows)) for f in factors).T


def vt_matmul(factors: Sequence[ParamFactors], vectors: Sequence[Tensor]) -> Tensor:
    """``Vᵀ W``, ``[K, N·C]``, for one tensor ``[K, *p.shape]`` per parameter."""
    return summed(f.vtmp(w) for f, w in zip(factors, vectors, strict=True))


def v_matmul(factors: Sequence[ParamFactors], coefficients: Tensor) -> list[Tensor]:
    """``V u`` for rows ``[K, N·C]``: one tensor ``[K, *p.shape]`` per parameter."""
    return [f.vmp(coefficients) for f in factors]


class VProducts(Protocol):
    """The products of one group (the functions here): by factors or data passes."""

    dtype: torch.dtype  # the type the products run in

    def v_matmul(self, coefficients: Tensor) -> list[Tensor]: ...  # noqa: D102

    def vt_matmul(self, vectors: Sequence[Tensor]) -> Tensor: ...  # noqa: D102

    def gram_matmul(self, vectors: Tensor) -> Tensor: ...  # noqa: D102


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
