"""Choose the cheaper of several contraction routes for one product.

The cost model. A route is described by

- ``flops``: the multiply-adds of its contractions, counted from the tensor shapes
  (``m·n·k`` for an ``[m, k] @ [k, n]`` product). It ignores how fast each kernel
  runs: a large matrix product runs several times more multiply-adds per second
  than a small batched ``einsum``, so routes within a small factor of each other
  are close calls;
- ``memory``: the tensor entries of its largest intermediate, counted before it is
  allocated. Routes that work in chunks (``V`` formed a block of output features
  at a time; pairwise products a block of samples at a time) report the chunk,
  whose size they pick from the same budget, not the whole tensor. The result
  (a Gram block ``[N·C, N·C]``) is not counted: every route allocates it.

The planner picks the route with the least work among those whose largest
intermediate, in bytes of the factors' data type, fits :data:`MEMORY_BUDGET_BYTES`;
if none fits, the one with the smallest intermediate. The budget bounds one
intermediate, not the peak of a backward pass: the factors themselves, BackPACK's
backpropagated quantities and the ``[N·C, N·C]`` Gram matrix come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Largest intermediate (in bytes) a route may create: routes work in chunks of at
#: most this size, and one that cannot is avoided. 256 MiB, i.e. 2**26 entries in
#: float32, 2**25 in float64: large enough that chunked matrix products run at
#: full speed, small next to the Gram matrix at large N·C.
MEMORY_BUDGET_BYTES = 2**28


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


def budget_entries(dtype: torch.dtype, budget: int | None = None) -> int:
    """How many entries of ``dtype`` fit into a budget.

    Args:
        dtype: Data type of the intermediates.
        budget: Budget in bytes (``None``: :data:`MEMORY_BUDGET_BYTES`).

    Returns:
        The budget in tensor entries (at least 1).
    """
    budget = MEMORY_BUDGET_BYTES if budget is None else budget
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, budget // itemsize)


def choose(
    *routes: Route,
    dtype: torch.dtype = torch.float32,
    budget: int | None = None,
) -> str:
    """Return the name of the cheapest route whose intermediates fit the budget.

    Args:
        *routes: Candidate routes.
        dtype: Data type of the intermediates (sets the bytes per entry).
        budget: Maximum size of an intermediate, in bytes (``None``:
            :data:`MEMORY_BUDGET_BYTES`).

    Returns:
        Name of the chosen route.
    """
    entries = budget_entries(dtype, budget)
    fitting = [r for r in routes if r.memory <= entries]
    if fitting:
        return min(fitting, key=lambda r: (r.flops, r.memory)).name
    return min(routes, key=lambda r: (r.memory, r.flops)).name
