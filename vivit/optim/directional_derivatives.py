"""ViViT 1.0's import path; the class lives in vivit.compat.directional_derivatives."""

from vivit.compat.directional_derivatives import DirectionalDerivativesComputation

__all__ = ["DirectionalDerivativesComputation"]
