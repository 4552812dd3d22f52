"""A parameter's columns of ``V`` over several blocks of samples.

The samples of a GGN may come in blocks: the batches of a data loader, the shards
of the processes of a ``torch.distributed`` group, the chunks of a large batch.
``V = [V_1, V_2, …]`` stacks the blocks' columns, so its Gram matrix is made of
cross-Gram blocks ``V_aᵀ V_b`` of the blocks' factors (never of ``V``), and
``V u = Σ_b V_b u_b`` (``docs/math.rst``, "Data sets and processes").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from vivit.gram.factors import ParamFactors


class SampleBlockFactors(ParamFactors):
    """Columns of ``V`` of one parameter, held per block of samples.

    Gram-space entries are ordered block by block, each block sample-major:
    entry ``(offset_b + n)·C + c`` is column ``c`` of sample ``n`` of block ``b``.

    Args:
        blocks: Factors of the same parameter, one per block of samples, with the
            same columns per sample and scaling (``√R`` of the loss on all blocks
            together, see :meth:`ParamFactors.scaled`).

    Raises:
        ValueError: If there are no blocks, or they disagree in parameter shape,
            columns per sample or floating-point type.
    """

    def __init__(self, blocks: Sequence[ParamFactors]):
        flat: list[ParamFactors] = []
        for block in blocks:
            flat.extend(
                block.blocks if isinstance(block, SampleBlockFactors) else [block]
            )
        if not flat:
            raise ValueError("SampleBlockFactors needs at least one block.")
        first = flat[0]
        for block in flat[1:]:
            if (block.param_shape, block.num_columns, block.dtype) != (
                first.param_shape,
                first.num_columns,
                first.dtype,
            ):
                raise ValueError(
                    "Sample blocks disagree: parameter shape, columns per sample and "
                    f"dtype {tuple(block.param_shape)}, {block.num_columns}, "
                    f"{block.dtype} against {tuple(first.param_shape)}, "
                    f"{first.num_columns}, {first.dtype}."
                )
        self.blocks = flat
        self.num_samples = sum(block.num_samples for block in flat)
        self.num_columns = first.num_columns
        self.param_shape = first.param_shape

    @property
    def dtype(self) -> torch.dtype:  # noqa: D102
        return self.blocks[0].dtype

    def to(self, dtype: torch.dtype) -> SampleBlockFactors:  # noqa: D102
        if dtype == self.dtype:
            return self
        return SampleBlockFactors([block.to(dtype) for block in self.blocks])

    def scaled(self, factor: float) -> SampleBlockFactors:  # noqa: D102
        return SampleBlockFactors([block.scaled(factor) for block in self.blocks])

    def _row_bounds(self) -> list[int]:
        bounds = [0]
        for block in self.blocks:
            bounds.append(bounds[-1] + block.num_rows)
        return bounds

    def gram(self, other: ParamFactors | None = None) -> Tensor:  # noqa: D102
        if other is None:
            return self._self_gram()
        others = other.blocks if isinstance(other, SampleBlockFactors) else [other]
        return torch.cat(
            [torch.cat([a.gram(b) for b in others], dim=1) for a in self.blocks]
        )

    def _self_gram(self) -> Tensor:
        """``Vᵀ V`` from the blocks on and above the diagonal, mirrored."""
        bounds = self._row_bounds()
        diagonal = self.blocks[0].gram()
        gram = diagonal.new_empty(bounds[-1], bounds[-1])
        for a, block_a in enumerate(self.blocks):
            rows = slice(bounds[a], bounds[a + 1])
            gram[rows, rows] = diagonal if a == 0 else block_a.gram()
            for b in range(a + 1, len(self.blocks)):
                cols = slice(bounds[b], bounds[b + 1])
                cross = block_a.gram(self.blocks[b])
                gram[rows, cols] = cross
                gram[cols, rows] = cross.T
        return gram

    def product_work(self, num_vectors: int) -> int:  # noqa: D102
        return sum(block.product_work(num_vectors) for block in self.blocks)

    def gram_work(self) -> int:  # noqa: D102
        # each block's Gram, and the cross-Gram of blocks a < b: √(work_a · work_b)
        # (exact where the Gram is formed from products of sample pairs)
        roots = [math.sqrt(block.gram_work()) for block in self.blocks]
        return round((sum(r * r for r in roots) + sum(roots) ** 2) / 2)

    def vmp(self, u: Tensor) -> Tensor:  # noqa: D102
        bounds = self._row_bounds()
        result = self.blocks[0].vmp(u[:, : bounds[1]])
        for b, block in enumerate(self.blocks[1:], start=1):
            result.add_(block.vmp(u[:, bounds[b] : bounds[b + 1]]))
        return result

    def vtmp(self, w: Tensor) -> Tensor:  # noqa: D102
        return torch.cat([block.vtmp(w) for block in self.blocks], dim=1)

    def select(self, samples: Sequence[int]) -> ParamFactors:  # noqa: D102
        """Restrict to samples (positions over all blocks), in the given order.

        Consecutive samples of the same block stay one block.
        """
        starts = [0]
        for block in self.blocks:
            starts.append(starts[-1] + block.num_samples)
        runs: list[tuple[int, list[int]]] = []
        if len(samples) == 0:
            return self.blocks[0].select([])
        for n in samples:
            if not 0 <= n < self.num_samples:
                raise IndexError(f"Sample {n} out of range [0, {self.num_samples}).")
            b = next(b for b in range(len(self.blocks)) if n < starts[b + 1])
            if runs and runs[-1][0] == b:
                runs[-1][1].append(n - starts[b])
            else:
                runs.append((b, [n - starts[b]]))
        selected = [self.blocks[b].select(local) for b, local in runs]
        return selected[0] if len(selected) == 1 else SampleBlockFactors(selected)

    def materialize(self) -> Tensor:  # noqa: D102
        return torch.cat([block.materialize() for block in self.blocks])
