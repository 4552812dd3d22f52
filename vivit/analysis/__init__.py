"""Analyses built on the front doors: what the exact Gram matrix shows.

- :func:`audit_approximations`: which approximation of the GGN recovers the exact
  top-k eigenpairs and damped Newton step of a mini-batch.
- :func:`hierarchy`: Papyan's split of a cross-entropy GGN into class means,
  cross-class means and within-class deviations.
- :func:`spectral_density`: stochastic Lanczos quadrature with its error bound.
- :class:`CurvatureMonitor`: the GGN's curvature every ``k`` training steps, and
  :func:`read_records`, :func:`lightning_callback`, :func:`huggingface_callback`.
"""

from vivit.analysis.audit import (
    APPROXIMATIONS,
    ApproximationAudit,
    AuditRow,
    audit_approximations,
)
from vivit.analysis.density import (
    SpectralDensity,
    spectral_density,
    wasserstein_bound,
    wasserstein_distance,
)
from vivit.analysis.hierarchy import Hierarchy, SpectrumPart, hierarchy
from vivit.analysis.monitor import CurvatureMonitor
from vivit.analysis.monitor_adapters import huggingface_callback, lightning_callback
from vivit.analysis.monitor_record import read_records

__all__ = [
    "APPROXIMATIONS",
    "ApproximationAudit",
    "AuditRow",
    "CurvatureMonitor",
    "Hierarchy",
    "SpectralDensity",
    "SpectrumPart",
    "audit_approximations",
    "hierarchy",
    "huggingface_callback",
    "lightning_callback",
    "read_records",
    "spectral_density",
    "wasserstein_bound",
    "wasserstein_distance",
]
