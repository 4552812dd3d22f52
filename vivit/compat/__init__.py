"""The ViViT-compatible computation classes (``vivit-for-pytorch`` 1.0's API).

Each hands out a BackPACK extension and an extension hook for use inside a training
loop, and returns its result per parameter group after the backward pass. ViViT
1.0's import paths (``vivit.linalg.eigh`` and friends) re-export them.
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
