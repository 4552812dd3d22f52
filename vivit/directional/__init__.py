"""Directional derivatives and Newton steps along GGN eigenvectors, in Gram space.

Engine-independent computations used by every front door: the formulas of
``docs/math.rst`` ("Directional derivatives", "Damped Newton step") and their
result types.
"""

from vivit.directional.results import DirectionalDerivatives, NewtonStep

__all__ = ["DirectionalDerivatives", "NewtonStep"]
