"""Analyses built on the front doors: what the exact Gram matrix shows.

- :func:`audit_approximations`: which approximation of the GGN (Monte-Carlo,
  subsampled, block-diagonal, diagonal, KFAC, EKFAC) recovers the exact top-k
  eigenpairs and damped Newton step of a mini-batch, as an
  :class:`ApproximationAudit` table.
- :func:`hierarchy`: the exact split of a cross-entropy GGN into class means,
  cross-class means and within-class deviations (Papyan's three levels), each
  part's non-zero spectrum and eigenspace from the Gram matrix, and the spectra
  of its parameter groups (``docs/math.rst``, "Hierarchy of the spectrum").
- :func:`spectral_density`: stochastic Lanczos quadrature over any symmetric
  positive semi-definite operator, with its Wasserstein error bound
  (``docs/math.rst``, "Spectral density by stochastic Lanczos quadrature").
- :class:`CurvatureMonitor`: a callback for a training loop that, every ``k``
  steps, records the GGN's top eigenvalues, the gradient's share in their span,
  the signal-to-noise ratios of ``γ`` and ``λ`` per direction and the angle of the
  damped Newton step to the gradient (JSON lines, optionally TensorBoard).
- :func:`read_records`: the records of a monitor's JSON lines file, checked.
- :func:`lightning_callback`, :func:`huggingface_callback`: the monitor as a
  PyTorch Lightning or Hugging Face Trainer callback (packages imported lazily).
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
