"""Analyses built on the front doors' results: what the curvature looks like.

- :func:`hierarchy`: the exact split of a cross-entropy GGN into class means,
  cross-class means and within-class deviations (Papyan's three levels), each
  part's non-zero spectrum and eigenspace from the Gram matrix, and the spectra
  of its parameter groups (``docs/math.rst``, "Hierarchy of the spectrum").
- :func:`spectral_density`: stochastic Lanczos quadrature over any symmetric
  positive semi-definite operator, with its Wasserstein error bound
  (``docs/math.rst``, "Spectral density by stochastic Lanczos quadrature").
"""

from vivit.analysis.density import (
    SpectralDensity,
    spectral_density,
    wasserstein_bound,
    wasserstein_distance,
)
from vivit.analysis.hierarchy import Hierarchy, SpectrumPart, hierarchy

__all__ = [
    "Hierarchy",
    "SpectralDensity",
    "SpectrumPart",
    "hierarchy",
    "spectral_density",
    "wasserstein_bound",
    "wasserstein_distance",
]
