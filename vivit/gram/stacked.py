"""``V = [V_1, V_2, …]`` of a parameter over parts of the samples (batches, shards).

``docs/math.rst``, "Data sets and processes".
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate

import torch
from torch import Tensor

from vivit.gram.factors import CompositeFactors, ParamFactors, summed


class StackedFactors(CompositeFactors):
    """Columns of ``V`` of one parameter, held per part of the samples.

    Gram-space entries are ordered block by block, each sample-major. Block ``b``'s
    columns are ``scales[b]`` (default 1) times those of ``blocks[b]``, applied by
    the products (nothing copied). Nested blocks are flattened.

    Raises:
        ValueError: If there are no blocks, they disagree in parameter shape,
            columns per sample or dtype, or the scales do not match the blocks.
    """

    def __init__(
        self, blocks: Sequence[ParamFactors], scales: Sequence[float] | None = None
    ):
        scales = [1.0] * len(blocks) if scales is None else list(scales)
        if len(scales) != len(blocks):
            raise ValueError(
                f"{len(scales)} scales for {len(blocks)} sample blocks; pass one each."
            )
        flat: list[ParamFactors] = []
        flat_scales: list[float] = []
        for block, scale in zip(blocks, scales, strict=True):
            nested = isinstance(block, StackedFactors)
            flat.extend(block.blocks if nested else [block])
            flat_scales.extend([scale * s for s in block.scales] if nested else [scale])
        if not flat:
            raise ValueError("StackedFactors needs at least one block.")
        first = flat[0]
        for block in flat[1:]:
            kind = (tuple(block.param_shape), block.num_columns, block.dtype)
            if kind != (tuple(first.param_shape), first.num_columns, first.dtype):
                raise ValueError(
                    "Sample blocks disagree: parameter shape, columns per sample and "
                    f"dtype {kind} against {tuple(first.param_shape)}, "
                    f"{first.num_columns}, {first.dtype}."
                )
        self.blocks = self.members = flat
        self.scales = [float(scale) for scale in flat_scales]
        self.num_samples = sum(block.num_samples for block in flat)
        self.num_columns = first.num_columns
        self.param_shape = first.param_shape

    def map_tensors(self, function: Callable[[Tensor], Tensor]) -> ParamFactors:  # noqa: D102
        blocks = [block.map_tensors(function) for block in self.blocks]
        if all(new is old for new, old in zip(blocks, self.blocks, strict=True)):
            return self
        return StackedFactors(blocks, self.scales)

    def scaled(self, factor: float) -> StackedFactors:  # noqa: D102
        return StackedFactors(self.blocks, [factor * s for s in self.scales])

    def _pairs(self) -> zip:
        """The blocks with their scales."""
        return zip(self.blocks, self.scales, strict=True)

    def _bounds(self, attribute: str = "num_rows") -> list[int]:
        """Where each block starts in Gram space (or in the samples), and the end."""
        return list(accumulate((getattr(b, attribute) for b in self.blocks), initial=0))

    def gram(self, other: ParamFactors | None = None) -> Tensor:  # noqa: D102
        if other is None:
            return self._self_gram()
        if isinstance(other, StackedFactors):
            others = list(other._pairs())
        else:
            others = [(other, 1.0)]
        return torch.cat(
            [
                torch.cat([(s * t) * a.gram(b) for b, t in others], dim=1)
                for a, s in self._pairs()
            ]
        )

    def block_gram(self, a: int, b: int) -> Tensor:
        """The Gram block ``scale_a·scale_b·V_aᵀ V_b`` of blocks ``a`` and ``b``."""
        other = None if a == b else self.blocks[b]
        return self.blocks[a].gram(other) * (self.scales[a] * self.scales[b])

    def _self_gram(self) -> Tensor:
        """``Vᵀ V`` from the blocks on and above the diagonal, mirrored."""
        bounds = self._bounds()
        diagonal = self.block_gram(0, 0)
        gram = diagonal.new_empty(bounds[-1], bounds[-1])
        for a in range(len(self.blocks)):
            rows = slice(bounds[a], bounds[a + 1])
            gram[rows, rows] = diagonal if a == 0 else self.block_gram(a, a)
            for b in range(a + 1, len(self.blocks)):
                cols = slice(bounds[b], bounds[b + 1])
                cross = self.block_gram(a, b)
                gram[rows, cols] = cross
                gram[cols, rows] = cross.T
        return gram

    def gram_work(self) -> int:  # noqa: D102
        # each block's Gram, and the cross-Gram of blocks a < b: √(work_a · work_b)
        # (exact where the Gram is formed from products of sample pairs)
        roots = [math.sqrt(block.gram_work()) for block in self.blocks]
        return round((sum(r * r for r in roots) + sum(roots) ** 2) / 2)

    def vmp(self, u: Tensor) -> Tensor:  # noqa: D102
        bounds = self._bounds()
        return summed(
            block.vmp(self.scales[b] * u[:, bounds[b] : bounds[b + 1]])
            for b, block in enumerate(self.blocks)
        )

    def vtmp(self, w: Tensor) -> Tensor:  # noqa: D102
        return torch.cat([block.vtmp(w) * s for block, s in self._pairs()], dim=1)

    def select(self, samples: Sequence[int]) -> ParamFactors:  # noqa: D102
        """Restrict to samples (over all blocks); consecutive ones stay one block."""
        if len(samples) == 0:
            return self.blocks[0].select([])
        starts = self._bounds("num_samples")
        runs: list[tuple[int, list[int]]] = []
        for n in samples:
            if not 0 <= n < self.num_samples:
                raise IndexError(f"Sample {n} out of range [0, {self.num_samples}).")
            b = bisect_right(starts, n) - 1
            if runs and runs[-1][0] == b:
                runs[-1][1].append(n - starts[b])
            else:
                runs.append((b, [n - starts[b]]))
        return StackedFactors(
            [self.blocks[b].select(local) for b, local in runs],
            [self.scales[b] for b, _ in runs],
        )

    def materialize(self) -> Tensor:  # noqa: D102
        return torch.cat([block.materialize() * s for block, s in self._pairs()])
