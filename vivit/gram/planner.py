"""Choose the cheapest of several contraction routes for one product.

The route with the fewest multiply-adds among those whose largest intermediate fits
:data:`MEMORY_BUDGET_BYTES`, else the one with the smallest intermediate. The budget
bounds one intermediate, not the peak of a backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vivit.gram.memory import itemsize

#: Largest intermediate (in bytes) a route may create; chunked routes pick their
#: chunks from it. Large enough for full-speed matrix products, small next to the
#: Gram matrix at large N·C.
MEMORY_BUDGET_BYTES = 2**28


@dataclass(frozen=True)
class Route:
    """Cost of one way to evaluate a product."""

    name: str
    flops: int  # multiply-adds, counted from the shapes
    memory: int  # entries of the largest intermediate (of a chunk; not the result)


def budget_entries(dtype: torch.dtype, budget: int | None = None) -> int:
    """How many entries of ``dtype`` (at least 1) fit into ``budget`` bytes.

    ``None``: :data:`MEMORY_BUDGET_BYTES`.
    """
    budget = MEMORY_BUDGET_BYTES if budget is None else budget
    return max(1, budget // itemsize(dtype))


def choose(
    *routes: Route, dtype: torch.dtype = torch.float32, budget: int | None = None
) -> str:
    """The name of the cheapest route whose intermediate fits ``budget`` bytes.

    ``dtype`` is that of the intermediates; ``budget`` as for :func:`budget_entries`.
    """
    fitting = [r for r in routes if r.memory <= budget_entries(dtype, budget)]
    if fitting:
        return min(fitting, key=lambda r: (r.flops, r.memory)).name
    return min(routes, key=lambda r: (r.memory, r.flops)).name
