"""Analyses built on the front doors: curvature while a network trains.

- :class:`CurvatureMonitor`: a callback for a training loop that, every ``k``
  steps, records the GGN's top eigenvalues, the gradient's share in their span,
  the signal-to-noise ratios of ``γ`` and ``λ`` per direction and the angle of the
  damped Newton step to the gradient (JSON lines, optionally TensorBoard).
- :func:`read_records`: the records of a monitor's JSON lines file, checked.
- :func:`lightning_callback`, :func:`huggingface_callback`: the monitor as a
  PyTorch Lightning or Hugging Face Trainer callback (packages imported lazily).
"""

from vivit.analysis.monitor import CurvatureMonitor
from vivit.analysis.monitor_adapters import huggingface_callback, lightning_callback
from vivit.analysis.monitor_record import read_records

__all__ = [
    "CurvatureMonitor",
    "huggingface_callback",
    "lightning_callback",
    "read_records",
]
