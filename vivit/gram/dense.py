"""Columns of ``V`` held explicitly: small ``V`` (biases), or no cheaper factor form."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vivit.gram.factors import ParamFactors, scaled_cat, self_gram
from vivit.gram.stacked import StackedFactors


class DenseFactors(ParamFactors):
    """A parameter's columns of ``V``, ``[N, C, *param_shape]``, as a matrix ``Vᵀ``."""

    def __init__(self, columns: Tensor):
        self.num_samples, self.num_columns = columns.shape[:2]
        self.param_shape = columns.shape[2:]
        self._vt = columns.detach().reshape(self.num_rows, self.param_shape.numel())

    def _from_rows(self, vt: Tensor) -> DenseFactors:
        """Factors of the same parameter from rows ``[N'·C, numel]`` of ``Vᵀ``."""
        samples = vt.shape[0] // self.num_columns  # explicit: no samples is allowed
        return DenseFactors(vt.reshape(samples, self.num_columns, *self.param_shape))

    @classmethod
    def concatenate(
        cls, blocks: Sequence[DenseFactors], scales: Sequence[float]
    ) -> DenseFactors:
        """The columns of consecutive parts of the samples, scaled, as one (a copy)."""
        return blocks[0]._from_rows(scaled_cat([b._vt for b in blocks], scales, dim=0))

    def scaled(self, factor: float) -> DenseFactors:  # noqa: D102
        return self._from_rows(self._vt * factor)

    def gram(self, other: ParamFactors | None = None) -> Tensor:  # noqa: D102
        if other is None:
            return self_gram(self._vt)
        if isinstance(other, StackedFactors):
            return other.gram(self).T
        return self._vt @ other.materialize().T

    def vmp(self, u: Tensor) -> Tensor:  # noqa: D102
        return (u @ self._vt).reshape(u.shape[0], *self.param_shape)

    def vtmp(self, w: Tensor) -> Tensor:  # noqa: D102
        return w.reshape(w.shape[0], -1) @ self._vt.T

    def select(self, samples: Sequence[int]) -> DenseFactors:  # noqa: D102
        columns = self._vt.reshape(self.num_samples, self.num_columns, -1)
        index = torch.as_tensor(samples, dtype=torch.long, device=self._vt.device)
        return self._from_rows(columns[index].flatten(end_dim=1))

    def materialize(self) -> Tensor:  # noqa: D102
        return self._vt
