"""Directional derivatives and Newton steps along GGN eigenvectors, in Gram space.

Engine-independent; the formulas are those of ``docs/math.rst``, "Directional
derivatives and curvature noise" and "Damped Newton step in the eigenspace".
"""

from vivit.directional.results import DirectionalDerivatives, NewtonStep

__all__ = ["DirectionalDerivatives", "NewtonStep"]
