"""Leading eigenpairs of a group's Gram matrix or GGN: the solvers, and running one.

``"dense"`` is LAPACK on the Gram matrix; ``"gram_krylov"`` block Krylov
(:mod:`vivit.linalg.iterative`) on it; ``"factor_krylov"`` on products with the
factors of ``V`` (the Gram matrix never formed); ``"ggn_krylov"`` on ``G`` in
parameter space (:mod:`vivit.sources.implicit`). ``"auto"`` is the cost model's
choice (:mod:`vivit.memory.costs`), and falls back to ``"dense"`` where an
iterative solve does not converge; one asked for by name raises.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from vivit.errors import InvalidArgumentError, SolverNotConvergedError
from vivit.gram.memory import itemsize
from vivit.linalg.iterative import (
    SolverReport,
    basis_capacity,
    block_krylov_eigh,
    default_block_size,
    minimum_capacity,
    restart_size,
)
from vivit.linalg.solvers import check_top_k, gram_eigh_top

#: The accepted values of ``solver``.
SOLVERS = ("auto", "dense", "gram_krylov", "factor_krylov")
#: Former solver names, and what they are now.
RENAMED = {
    "iterative": "solver='gram_krylov'",
    "matrix_free": "solver='factor_krylov'",
    "implicit": "a route: route='implicit', chosen at construction",
}
#: Block size of the implicit route's products (at most ``top_k``): thinner blocks
#: reach the leading pairs in fewer products, a vmapped product of ``b`` vectors
#: costs a fixed overhead plus ``b`` vectors' work (``benchmarks/README.md``,
#: "Narrow blocks").
IMPLICIT_BLOCK = 3
#: Extra columns of the block of Gram products beyond ``top_k``
#: (:func:`solver_block_size`).
GRAM_OVERSAMPLING = 8
#: Bytes per entry of the iterative solvers' Krylov blocks (float64).
_KRYLOV_ITEMSIZE = 8


def check_solver(solver: str, top_k: int | None = 1) -> None:
    """Check that ``solver`` is one of :data:`SOLVERS` and fits ``top_k``.

    Raises:
        InvalidArgumentError: If it is not a solver, if ``top_k`` is invalid, or if
            an iterative solver is asked for all eigenpairs.
    """
    if solver in RENAMED:
        raise InvalidArgumentError(
            f"solver={solver!r} is now {RENAMED[solver]} (docs/migration.rst)."
        )
    if not isinstance(solver, str) or solver not in SOLVERS:
        raise InvalidArgumentError(f"solver must be one of {SOLVERS}, got {solver!r}.")
    check_top_k(top_k)
    if top_k is None and solver not in ("dense", "auto"):
        raise InvalidArgumentError(
            f"solver={solver!r} computes a few leading eigenpairs: pass top_k "
            "(e.g. top_k=10), or use solver='dense' for all of them."
        )


def solver_block_size(solver: str, top_k: int, size: int) -> int:
    """Block size ``b`` of an iterative solver (at most ``size``).

    ``"ggn_krylov"``: ``min(k,`` :data:`IMPLICIT_BLOCK` ``)``, certified by
    :func:`~vivit.linalg.iterative.narrow_block_doubt`; ``"factor_krylov"``:
    ``k``; ``"gram_krylov"``: ``max(2·k, k +`` :data:`GRAM_OVERSAMPLING` ``)``, as
    a product with a Gram matrix larger than the cache costs a pass over it.
    ``size`` is the Gram matrix's side length (``D`` for ``"ggn_krylov"``).
    """
    if solver == "ggn_krylov":
        return min(size, top_k, IMPLICIT_BLOCK)
    if solver == "factor_krylov":
        return default_block_size(top_k, size)
    return min(size, max(2 * top_k, top_k + GRAM_OVERSAMPLING))


def iterative_workspace_bytes(
    size: int,
    top_k: int,
    dtype: torch.dtype,
    params: int | None = None,
    columns: int | None = None,
    solver: str | None = None,
) -> int:
    """Memory of the iterative solvers besides the Gram matrix.

    The float64 basis and its images (``m`` columns each), their projection
    (``m × m``), the Ritz vectors a restart keeps and their images, a block with
    its image and the next (``max(b, k)`` each) and two blocks in ``dtype``.

    Args:
        size: Side length ``R`` of the Gram matrix.
        top_k: Number of leading eigenpairs.
        dtype: Data type of the products.
        params: ``D`` for the matrix-free solver (a block of ``D``-vectors between
            the two ``V``-products and its copy); ``None`` for Gram products.
        columns: Columns ``m`` of the basis (``None``: the default,
            :func:`~vivit.linalg.iterative.basis_capacity`).
        solver: ``"gram_krylov"``, ``"factor_krylov"`` or ``"ggn_krylov"``
            (``None``: ``"gram_krylov"`` without ``params``, else
            ``"factor_krylov"``), for its :func:`solver_block_size`.

    Returns:
        Bytes.
    """
    solver = solver or ("gram_krylov" if params is None else "factor_krylov")
    width = solver_block_size(solver, top_k, size)
    wide = max(width, min(top_k, size))
    if columns is None:
        columns = basis_capacity(width, size, top_k=top_k)
    kept = restart_size(top_k, width, columns)
    workspace = ((columns + 2 * kept + 3 * wide) * size + columns**2) * (
        _KRYLOV_ITEMSIZE
    )
    workspace += columns * size * max(itemsize(dtype), 4)  # the images
    workspace += 2 * wide * size * itemsize(dtype)
    if params is not None:
        workspace += 2 * wide * params * itemsize(dtype)
    return workspace


def fitting_basis_columns(
    size: int,
    top_k: int,
    dtype: torch.dtype,
    budget_bytes: float,
    params: int | None = None,
    solver: str | None = None,
) -> int:
    """Columns ``m`` of the Krylov basis that the memory allows.

    The default basis where its workspace fits ``budget_bytes``, else the most
    columns that fit, never below :func:`~vivit.linalg.iterative.minimum_capacity`
    (the caller refuses where even that does not fit). A cut basis restarts more
    often and converges all the same (``docs/math.rst``, "A basis cut by memory").

    Args:
        size: Side length of the operator (``D`` on the implicit route).
        top_k: Number of leading eigenpairs.
        dtype: Data type of the products.
        budget_bytes: Memory the solver's workspace may take.
        params: As for :func:`iterative_workspace_bytes`.
        solver: As for :func:`iterative_workspace_bytes`.

    Returns:
        ``m``, the solver's ``max_columns``.
    """
    solver = solver or ("gram_krylov" if params is None else "factor_krylov")
    width = solver_block_size(solver, top_k, size)
    top_k = min(top_k, size)
    low = minimum_capacity(top_k, width, size)  # returned where nothing fits
    high = max(low, basis_capacity(width, size, top_k=top_k))
    while low < high:  # the workspace grows with m: the largest m that fits
        middle = (low + high + 1) // 2
        workspace = iterative_workspace_bytes(
            size, top_k, dtype, params, middle, solver
        )
        if workspace <= budget_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def leading_eigenpairs(
    products: Callable[[Tensor], Tensor],
    top_k: int,
    solver: str,
    gram: Callable[[], Tensor],
    *,
    size: int,
    requested: str,
    dtype: torch.dtype,
    device: torch.device,
    tol: float | None = None,
    seed: int = 0,
    max_columns: int | None = None,
) -> tuple[Tensor, Tensor, SolverReport]:
    """The ``top_k`` leading eigenpairs of a group's Gram matrix.

    Args:
        products: ``U ↦ G̃ U`` for columns ``[N·C, K]``, without the Gram matrix
            (``G V`` in parameter space for ``"ggn_krylov"``).
        top_k: Number of leading eigenpairs.
        solver: ``"dense"``, ``"gram_krylov"``, ``"factor_krylov"`` or
            ``"ggn_krylov"``.
        gram: Returns the Gram matrix, forming it if needed.
        size: Side length ``N·C`` of the Gram matrix (``D`` for ``"ggn_krylov"``).
        requested: The solver asked for; under ``"auto"`` an iterative solve that
            does not converge warns and falls back to ``"dense"``.
        dtype: Data type of the factors' products.
        device: Their device.
        tol: Relative residual bound of the iterative solvers (``None``: default).
        seed: Seed of their start block.
        max_columns: Most columns of their Krylov basis the memory allows
            (:func:`fitting_basis_columns`; ``None``: the default basis).

    Returns:
        Eigenvalues ``[k]`` ascending, eigenvectors ``[size, k]`` as columns, and
        the report.

    Raises:
        SolverNotConvergedError: If an explicitly requested iterative solver does
            not converge.
    """
    fallback = None
    if solver != "dense":
        matmul = gram().__matmul__ if solver == "gram_krylov" else products
        try:
            evals, evecs, report = block_krylov_eigh(
                matmul,
                size,
                top_k,
                dtype=dtype,
                device=device,
                tol=tol,
                seed=seed,
                block_size=solver_block_size(solver, top_k, size),
                max_columns=max_columns,
                # under "auto" the Gram routes fall back to the exact dense solver
                rounding_floor=requested != "auto" or solver == "ggn_krylov",
            )
            report = dataclasses.replace(report, solver=solver, requested=requested)
            return evals, evecs, report
        except SolverNotConvergedError as error:
            if requested != "auto":
                raise
            warnings.warn(
                f"{error} Falling back to the dense solver.",
                RuntimeWarning,
                stacklevel=3,
            )
            fallback = str(error)
    matrix = gram()
    evals, evecs = gram_eigh_top(matrix, top_k)
    residual = relative_residual(matrix @ evecs, evals, evecs)
    report = SolverReport(
        "dense", requested, residual, tolerance=None, converged=True, fallback=fallback
    )
    return evals, evecs, report


def relative_residual(images: Tensor, evals: Tensor, evecs: Tensor) -> float:
    """``max_k ‖G̃ ũ_k − λ_k ũ_k‖ / λ_max`` of ``images = G̃ U`` (``0`` if ``G̃ = 0``)."""
    if evals.numel() == 0:
        return 0.0
    scale = evals.abs().max().item()
    residual = (images - evecs * evals).norm(dim=0).max().item()
    return residual / scale if scale > 0 else residual
