"""Analyses built on the front doors: curvature while a network trains.

- :class:`CurvatureMonitor`: a callback for a training loop that, every ``k``
  steps, records the GGN's top eigenvalues, the gradient's share in their span,
  the signal-to-noise ratios of ``γ`` and ``λ`` per direction and the angle of the
  damped Newton step to the gradient (JSON lines, optionally TensorBoard).
- :func:`read_records`: the records of a monitor's JSON lines file, checked.
"""

from vivit.analysis.monitor import CurvatureMonitor
from vivit.analysis.monitor_record import read_records

__all__ = ["CurvatureMonitor", "read_records"]
