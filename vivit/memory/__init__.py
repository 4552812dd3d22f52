"""Memory: how much a curvature request needs, before and while it runs.

- :mod:`vivit.memory.request`: :func:`estimate_memory`,
  :func:`estimate_data_set_memory` and :func:`largest_batch` estimate the peak
  memory of a request before it runs, on the route it takes (the Gram route's
  :class:`MemoryEstimate` or the implicit route's :class:`ImplicitEstimate`,
  each with the route and the reason);
- :mod:`vivit.memory.estimate`: each route's estimate, from the layer sizes of a
  probe forward pass (:mod:`vivit.memory.probe`), for the run's options,
  engine and factor forms (:mod:`vivit.memory.forms`);
- :mod:`vivit.memory.route`: which route ``solver="auto"`` takes, and why (the
  run's decision and the estimate's);
- :mod:`vivit.memory.budget`: the memory of a pass over a data loader, checked
  while it runs;
- :func:`check_gram_fits` refuses Gram matrices that would not fit, as the run
  does before it forms them (the facts live in :mod:`vivit.gram.memory`, among
  them what this process can still allocate).
"""

from vivit.gram.memory import check_gram_fits
from vivit.memory.estimate import ImplicitEstimate, MemoryEstimate
from vivit.memory.request import (
    RequestEstimate,
    estimate_data_set_memory,
    estimate_memory,
    largest_batch,
)

__all__ = [
    "ImplicitEstimate",
    "MemoryEstimate",
    "RequestEstimate",
    "check_gram_fits",
    "estimate_data_set_memory",
    "estimate_memory",
    "largest_batch",
]
