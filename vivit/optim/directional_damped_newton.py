"""ViViT 1.0's import path.

The class lives in vivit.compat.directional_damped_newton.
"""

from vivit.compat.directional_damped_newton import DirectionalDampedNewtonComputation

__all__ = ["DirectionalDampedNewtonComputation"]
