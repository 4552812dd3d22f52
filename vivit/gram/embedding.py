"""Columns of ``V`` of an embedding table, held as token indices and vectors.

The indices stand for the one-hot inputs (``docs/math.rst``, "Layer structure").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, einsum

from vivit.gram.factors import ParamFactors, per_sample_projections, self_gram
from vivit.gram.stacked import StackedFactors


class EmbeddingFactors(ParamFactors):
    """An embedding table's columns of ``V`` as indices and backpropagated vectors.

    Args:
        indices: Token of every position, ``[N, T]``; positions that contribute
            nothing carry zero vectors.
        vectors: Backpropagated vectors at the looked-up rows, ``[C, N, T, D]``.
        param_shape: Shape of the table, ``[vocabulary, D]``.

    Raises:
        ValueError: If indices and vectors disagree in samples or positions.
    """

    def __init__(self, indices: Tensor, vectors: Tensor, param_shape: torch.Size):
        self.num_columns, self.num_samples, positions, _ = vectors.shape
        if tuple(indices.shape) != (self.num_samples, positions):
            raise ValueError(
                f"Indices {tuple(indices.shape)} and vectors {tuple(vectors.shape)} "
                "disagree in samples or positions."
            )
        self.param_shape = torch.Size(param_shape)
        self._i = indices.detach()
        self._s = vectors.detach()

    def _used_rows(self, tokens: Tensor, place: Tensor) -> Tensor:
        """``Vᵀ`` restricted to the rows of the tokens that occur, ``[N·C, U·D]``."""
        C, N, T, D = self._s.shape
        rows = self._s.new_zeros(C, N, len(tokens), D)
        index = place.reshape(1, N, T, 1).expand(C, N, T, D)
        rows.scatter_add_(2, index, self._s)
        return rows.transpose(0, 1).reshape(self.num_rows, -1)

    def scaled(self, factor: float) -> EmbeddingFactors:  # noqa: D102
        return EmbeddingFactors(self._i, self._s * factor, self.param_shape)

    def gram(self, other: ParamFactors | None = None) -> Tensor:  # noqa: D102
        if other is None or other is self:
            return self_gram(
                self._used_rows(*torch.unique(self._i, return_inverse=True))
            )
        if isinstance(other, StackedFactors):
            return other.gram(self).T
        if isinstance(other, EmbeddingFactors):
            tokens, place = torch.unique(
                torch.cat([self._i.flatten(), other._i.flatten()]), return_inverse=True
            )
            mine, theirs = place.split([self._i.numel(), other._i.numel()])
            return (
                self._used_rows(tokens, mine.view_as(self._i))
                @ other._used_rows(tokens, theirs.view_as(other._i)).T
            )
        # one V formed (the other form's), this one's by its lookups
        return self.vtmp(other.materialize()).T

    def gram_memory(self) -> int:  # noqa: D102
        rows = min(self._i.numel(), self.param_shape[0])  # of the tokens used
        return self.num_rows * rows * self.param_shape[1]

    def gram_work(self) -> int:  # noqa: D102
        return self.num_rows * self.gram_memory()

    def product_memory(self, num_vectors: int) -> int:  # noqa: D102
        return num_vectors * self._s[0].numel()

    def product_work(self, num_vectors: int) -> int:  # noqa: D102
        return 2 * num_vectors * self._s.numel()

    def vmp(self, u: Tensor) -> Tensor:  # noqa: D102
        K = u.shape[0]
        C, N, T, D = self._s.shape
        weighted = einsum("knc,cntd->kntd", u.reshape(K, N, C), self._s)
        result = u.new_zeros(K, *self.param_shape)
        result.index_add_(1, self._i.flatten(), weighted.reshape(K, N * T, D))
        return result

    def vtmp(self, w: Tensor) -> Tensor:  # noqa: D102
        K = w.shape[0]
        looked_up = w.reshape(K, *self.param_shape)[:, self._i]  # [K, N, T, D]
        return per_sample_projections(looked_up, self._s).reshape(K, -1)

    def select(self, samples: Sequence[int]) -> EmbeddingFactors:  # noqa: D102
        index = torch.as_tensor(samples, dtype=torch.long, device=self._i.device)
        return EmbeddingFactors(self._i[index], self._s[:, index], self.param_shape)

    def materialize(self) -> Tensor:  # noqa: D102
        C, N, T, D = self._s.shape
        vt = self._s.new_zeros(N, C, *self.param_shape)
        vectors = self._s.transpose(0, 1).reshape(N, C, T, D)
        for n in range(N):
            vt[n].index_add_(1, self._i[n], vectors[n])
        return vt.reshape(self.num_rows, -1)
