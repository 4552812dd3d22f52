"""Directional derivatives, damped Newton steps and dampings (ViViT-compatible path)."""

from vivit.compat import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
)
from vivit.directional.results import NewtonStep
from vivit.optim.damped_newton import DampedNewton
from vivit.optim.damping import BootstrapDamping, ConstantDamping

__all__ = [
    "BootstrapDamping",
    "ConstantDamping",
    "DampedNewton",
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "NewtonStep",
]
