"""Memory and the plan: a request measured on a few samples, its decisions and estimate.

- :mod:`vivit.memory.counter`: what a piece of code allocates and computes;
- :mod:`vivit.memory.profile`: a request measured on a copy of the model;
- :mod:`vivit.memory.costs`: one cost model for every automatic choice;
- :mod:`vivit.memory.plan`: the decisions of a request (:class:`Plan`) and the
  estimate of its peak memory (:class:`MemoryEstimate`);
- :mod:`vivit.memory.request`: a request's plan from its data, or from sizes;
- :mod:`vivit.memory.estimate`: :func:`estimate_memory`,
  :func:`estimate_data_set_memory` and :func:`largest_batch`.
"""

from vivit.gram.memory import check_gram_fits
from vivit.memory.estimate import (
    estimate_data_set_memory,
    estimate_memory,
    largest_batch,
)
from vivit.memory.plan import MemoryEstimate, Plan

__all__ = [
    "MemoryEstimate",
    "Plan",
    "check_gram_fits",
    "estimate_data_set_memory",
    "estimate_memory",
    "largest_batch",
]
