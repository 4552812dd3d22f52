"""Directional derivatives, damped Newton steps and dampings (ViViT-compatible path)."""

from vivit.directional.results import NewtonStep
from vivit.optim.damped_newton import DampedNewton
from vivit.optim.damping import BootstrapDamping, ConstantDamping
from vivit.optim.directional_damped_newton import DirectionalDampedNewtonComputation
from vivit.optim.directional_derivatives import DirectionalDerivativesComputation

__all__ = [
    "BootstrapDamping",
    "ConstantDamping",
    "DampedNewton",
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "NewtonStep",
]
