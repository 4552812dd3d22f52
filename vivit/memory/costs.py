"""One cost model, in multiply-adds, for every automatic choice.

Arithmetic counts its multiply-adds, a pass through the model its measured ones
times :data:`PASS_SLOWDOWN` plus :data:`OP_WORK` per operation, a pass over a
matrix larger than the cache :data:`PASS_WORK` per entry (``docs/math.rst``,
"Choosing the route", "Choosing the solver"). The constants are calibrated by
``benchmarks/solver_costs.py`` and ``benchmarks/eigenpairs.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vivit.gram import ParamFactors
from vivit.gram.memory import (
    PARTIAL_FRACTION,
    available_bytes,
    dense_workspace_bytes,
    itemsize,
)
from vivit.linalg.top_k import iterative_workspace_bytes, solver_block_size

#: Blocks of products an iterative solve is expected to multiply.
EXPECTED_BLOCKS = 15
#: The iterative solver is chosen over the dense one if it is expected to do this
#: many times less work.
ITERATIVE_ADVANTAGE = 2.0
#: Multiply-adds one pass over an entry of a matrix larger than the cache costs.
PASS_WORK = 25
#: Passes over ``R × R`` matrices per parameter while a Gram matrix is formed.
GRAM_PASSES = 6
#: Matrices of at most this many bytes are taken to stay in the cache.
CACHE_BYTES = 32 * 2**20
#: How many times slower than a large matrix product a pass through the model
#: runs per multiply-add.
PASS_SLOWDOWN = 3.0
#: Multiply-adds that one operation of a pass costs besides its arithmetic.
OP_WORK = 3e5


def pass_cost(work: float, ops: float) -> float:
    """Multiply-adds a pass through the model costs (its arithmetic, its calls)."""
    return PASS_SLOWDOWN * work + OP_WORK * ops


def memory_passes(entries: float, dtype: torch.dtype) -> float:
    """Work of one pass over a tensor: ``PASS_WORK`` per entry beyond the cache."""
    return PASS_WORK * entries if entries * itemsize(dtype) > CACHE_BYTES else 0.0


def krylov_work(size: int, width: int, product: float) -> float:
    """An iterative solve: ``EXPECTED_BLOCKS`` products, the basis orthogonalized."""
    columns = min(size, EXPECTED_BLOCKS * width)
    return EXPECTED_BLOCKS * product + 2 * columns**2 * size


def solver_works(
    factors: Sequence[ParamFactors], top_k: int, dtype: torch.dtype
) -> dict[str, float]:
    """Expected work of each Gram-route solver, and ``"formation"`` of the Gram.

    Forming it: its contractions and passes over it; the dense solver: ``4/3·R³``.
    """
    size = factors[0].num_rows
    formation = GRAM_PASSES * len(factors) * memory_passes(size**2, dtype)
    gram_width = solver_block_size("gram_krylov", top_k, size)
    width = solver_block_size("factor_krylov", top_k, size)
    entries = sum(t.numel() for f in factors for t in f.tensors())
    products = sum(f.product_work(width) for f in factors)
    return {
        "formation": formation + sum(f.gram_work() for f in factors),
        "dense": 4 / 3 * size**3,
        "gram_krylov": krylov_work(
            size, gram_width, gram_width * size**2 + memory_passes(size**2, dtype)
        ),
        "factor_krylov": krylov_work(
            size, width, products + 2 * memory_passes(entries, dtype)
        ),
    }


def choose_solver(
    factors: Sequence[ParamFactors],
    top_k: int | None,
    dtype: torch.dtype,
    device: torch.device,
    gram_formed: bool = False,
    num_grams: int = 1,
    available: int | None = None,
) -> str:
    """The Gram-route solver ``"auto"`` stands for: the least expected work.

    ``docs/math.rst``, "Choosing the solver". Only the factors' shapes are read;
    ``num_grams`` Gram matrices are held at once unless ``gram_formed``;
    ``available``: bytes the solve may take (``None``: what the device has).
    """
    size = factors[0].num_rows
    if top_k is None or top_k > PARTIAL_FRACTION * size:
        return "dense"
    available = available_bytes(device) if available is None else available
    grams = (0 if gram_formed else num_grams) * size**2 * itemsize(dtype)
    if not gram_formed and grams + iterative_workspace_bytes(size, top_k, dtype) > (
        available
    ):
        return "factor_krylov"
    work = solver_works(factors, top_k, dtype)
    formation = 0.0 if gram_formed else work["formation"]
    if not gram_formed and work["factor_krylov"] < formation + min(
        work["gram_krylov"], work["dense"]
    ):
        return "factor_krylov"
    dense_fits = grams + dense_workspace_bytes(size, top_k, dtype, device) <= available
    if ITERATIVE_ADVANTAGE * work["gram_krylov"] <= work["dense"] or not dense_fits:
        return "gram_krylov"
    return "dense"
