"""Columns of ``V`` held explicitly, for layers without a cheaper factor form."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vivit.gram.factors import ParamFactors, scaled_cat
from vivit.gram.stacked import StackedFactors
from vivit.gram.symmetric import self_gram


class DenseFactors(ParamFactors):
    """A parameter's columns of ``V`` stored as a matrix.

    For small ``V`` (biases, normalization layers) or layers without a factor form.

    Args:
        columns: ``Vᵀ`` restricted to the parameter, shape ``[N, C, *param_shape]``;
            stored detached, so products never track gradients.
    """

    def __init__(self, columns: Tensor):
        self.num_samples, self.num_columns = columns.shape[:2]
        self.param_shape = columns.shape[2:]
        self._vt = columns.detach().reshape(  # explicit: no samples is allowed
            self.num_samples * self.num_columns, self.param_shape.numel()
        )

    @classmethod
    def concatenate(
        cls, blocks: Sequence[DenseFactors], scales: Sequence[float]
    ) -> DenseFactors:
        """The columns of consecutive parts of the samples as one matrix (a copy).

        Args:
            blocks: Columns of the same parameter.
            scales: Each block's scale.
        """
        first = blocks[0]
        columns = scaled_cat([block._vt for block in blocks], scales, dim=0)
        return cls(columns.reshape(-1, first.num_columns, *first.param_shape))

    def scaled(self, factor: float) -> DenseFactors:  # noqa: D102
        return DenseFactors(
            (self._vt * factor).reshape(
                self.num_samples, self.num_columns, *self.param_shape
            )
        )

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
        return DenseFactors(
            columns[index].reshape(len(index), self.num_columns, *self.param_shape)
        )

    def materialize(self) -> Tensor:  # noqa: D102
        return self._vt
