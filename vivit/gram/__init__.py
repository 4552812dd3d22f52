"""Gram algebra: products of the GGN square root ``V`` computed from layer factors.

A :class:`ParamFactors` holds a parameter's columns of ``V`` in the cheapest form
its layer allows and answers ``V₁ᵀ V₂``, ``V u`` and ``Vᵀ w``. Gram space is
ordered sample-major: entry ``n·C + c`` is column ``c`` of sample ``n``.
"""

from vivit.gram.dense import DenseFactors
from vivit.gram.embedding import EmbeddingFactors
from vivit.gram.factors import ParamFactors
from vivit.gram.outer import OuterProductFactors
from vivit.gram.stacked import StackedFactors
from vivit.gram.sum import SumFactors

__all__ = [
    "DenseFactors",
    "EmbeddingFactors",
    "OuterProductFactors",
    "ParamFactors",
    "StackedFactors",
    "SumFactors",
]
