"""ViViT 1.0's import path; the class lives in vivit.compat."""

from vivit.compat.directional_damped_newton import DirectionalDampedNewtonComputation

__all__ = ["DirectionalDampedNewtonComputation"]
