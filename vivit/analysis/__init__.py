"""Analyses built on the front doors: what the exact Gram matrix shows.

Which approximation to trust (:func:`audit_approximations`), Papyan's hierarchy,
spectral density, and the curvature during training (:class:`CurvatureMonitor`).
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
from vivit.analysis.monitor import (
    CurvatureMonitor,
    huggingface_callback,
    lightning_callback,
)
from vivit.analysis.monitor_record import read_records, runs

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
    "runs",
    "spectral_density",
    "wasserstein_bound",
    "wasserstein_distance",
]
