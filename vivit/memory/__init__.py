"""Memory and the plan: a request measured on a few samples, its decisions and estimate.

Its modules, one job each, are listed in ``docs/architecture.rst``.
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
