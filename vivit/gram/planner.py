"""Choose the cheaper of several contraction routes for one product.

A route is described by its floating-point work and the number of tensor entries
its largest intermediate holds. The planner picks the route with the least work
among those whose intermediates fit the memory budget; if none fits, the one with
the smallest intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Largest intermediate (in tensor entries) a route may create before it is avoided.
#: 2**28 entries are 1 GiB in float32.
MEMORY_BUDGET_ENTRIES = 2**28


@dataclass(frozen=True)
class Route:
    """Cost of one way to evaluate a product.

    Attributes:
        name: Identifier of the route.
        flops: Multiply-adds it performs.
        memory: Entries of its largest intermediate tensor.
    """

    name: str
    flops: int
    memory: int


def choose(*routes: Route, budget: int = MEMORY_BUDGET_ENTRIES) -> str:
    """Return the name of the cheapest route whose intermediates fit the budget.

    Args:
        *routes: Candidate routes.
        budget: Maximum number of entries an intermediate may hold.

    Returns:
        Name of the chosen route.
    """
    fitting = [r for r in routes if r.memory <= budget]
    if fitting:
        return min(fitting, key=lambda r: (r.flops, r.memory)).name
    return min(routes, key=lambda r: (r.memory, r.flops)).name
