"""Columns ``V = Σ_u V_u`` of a parameter used in several ways (a tied embedding).

``docs/math.rst``, "Layer structure".
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from vivit.gram.factors import CompositeFactors, ParamFactors
from vivit.gram.stacked import StackedFactors


class SumFactors(CompositeFactors):
    """A parameter's columns of ``V`` as the sum of its uses' factors, ``parts``.

    Raises:
        ValueError: If fewer than two parts, or they disagree in shape.
    """

    def __init__(self, parts: Sequence[ParamFactors]):
        if len(parts) < 2:
            raise ValueError("A sum of factors needs at least two parts.")
        first = parts[0]
        shape = (first.num_samples, first.num_columns, first.param_shape)
        for part in parts[1:]:
            if (part.num_samples, part.num_columns, part.param_shape) != shape:
                raise ValueError(
                    "The parts of a sum of factors disagree in samples, columns "
                    "or parameter shape."
                )
        self.parts = self.members = list(parts)
        self.num_samples, self.num_columns, self.param_shape = shape

    def map_tensors(self, function) -> SumFactors:  # noqa: D102
        return SumFactors([part.map_tensors(function) for part in self.parts])

    def scaled(self, factor: float) -> SumFactors:  # noqa: D102
        return SumFactors([part.scaled(factor) for part in self.parts])

    def gram(self, other: ParamFactors | None = None) -> Tensor:  # noqa: D102
        if other is None or other is self:
            gram = None
            for i, part in enumerate(self.parts):
                diagonal = part.gram()
                gram = diagonal if gram is None else gram.add_(diagonal)
                for later in self.parts[i + 1 :]:
                    cross = part.gram(later)
                    gram.add_(cross).add_(cross.T)
            return gram
        if isinstance(other, StackedFactors):
            return other.gram(self).T
        others = other.parts if isinstance(other, SumFactors) else [other]
        return sum(part.gram(theirs) for part in self.parts for theirs in others)

    def gram_work(self) -> int:  # noqa: D102
        return len(self.parts) ** 2 * max(part.gram_work() for part in self.parts)

    def vmp(self, u: Tensor) -> Tensor:  # noqa: D102
        return sum(part.vmp(u) for part in self.parts)

    def vtmp(self, w: Tensor) -> Tensor:  # noqa: D102
        return sum(part.vtmp(w) for part in self.parts)

    def select(self, samples: Sequence[int]) -> SumFactors:  # noqa: D102
        return SumFactors([part.select(samples) for part in self.parts])

    def materialize(self) -> Tensor:  # noqa: D102
        return sum(part.materialize() for part in self.parts)
