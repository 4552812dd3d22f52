"""Curvature studies with vivit: one command each, JSON results and figures.

The studies share one command-line interface (:mod:`studies.cli`), data and model
loading (:mod:`studies.data`, :mod:`studies.models`) and output handling
(:mod:`studies.report`):

- :mod:`studies.spectrum`: the exact GGN spectrum of a mini-batch against its cheap
  approximations (Monte-Carlo, subsampling, block-diagonal).
- :mod:`studies.noise`: top eigenvalues and the noise of the directional
  derivatives along the top eigenvectors during SGD training.
- :mod:`studies.newton`: DampedNewton (constant and bootstrap damping) against SGD
  and Adam from the same initialisation on the same batches.
- :mod:`studies.monitor`: :class:`vivit.analysis.CurvatureMonitor` during SGD
  training, its records drawn and its overhead measured.
- :mod:`studies.approximations`: which approximation (Monte-Carlo, subsampled,
  block-diagonal, diagonal, KFAC, EKFAC) recovers the exact top-k eigenpairs and
  damped Newton step (:func:`vivit.analysis.audit_approximations`).
- :mod:`studies.hierarchy`: Papyan's class-mean, cross-class and within-class parts
  of the GGN, per-layer spectra and the SLQ density against the exact spectrum.

Run them from the repository root, e.g. ``python exp/spectrum.py --help``.
"""

STUDIES = ("spectrum", "noise", "newton", "monitor", "approximations", "hierarchy")
