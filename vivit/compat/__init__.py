"""The ViViT-compatible computation classes (``vivit-for-pytorch`` 1.0's API).

See ``docs/migration.rst``; ViViT 1.0's import paths re-export them.
"""

from vivit.compat.directional_damped_newton import DirectionalDampedNewtonComputation
from vivit.compat.directional_derivatives import DirectionalDerivativesComputation
from vivit.compat.eigh import EighComputation
from vivit.compat.eigvalsh import EigvalshComputation

__all__ = [
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "EighComputation",
    "EigvalshComputation",
]
