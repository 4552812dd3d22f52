"""Leading eigenpairs of a group's Gram matrix or GGN: the solvers, and running one.

``"dense"`` is LAPACK on the Gram matrix; ``"gram_krylov"`` block Krylov
(:mod:`vivit.linalg.iterative`) on the Gram matrix; ``"factor_krylov"`` the same
iteration on products with the factors of ``V`` (the Gram matrix never formed);
``"ggn_krylov"`` the same on ``G`` in parameter space (a route of its own,
:mod:`vivit.sources.implicit`). Which one ``"auto"`` runs is the cost model's
choice (:mod:`vivit.memory.costs`). An iterative solve that does not converge
raises where it was asked for by name and falls back to the dense solver under
``"auto"`` (``docs/math.rst``, "The Gram matrix and exact eigenpairs").
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from vivit.errors import InvalidArgumentError, SolverNotConvergedError
from vivit.gram.memory import (
    itemsize,
)
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
#: Block size of the implicit route's products (at most ``top_k``): thinner
#: blocks reach the leading eigenpairs in fewer products (a higher Krylov degree
#: per product), a vmapped product of ``b`` vectors costs a fixed overhead plus
#: ``b`` times a vector's work. Top-10 in float32, one thread (CPU seconds of the
#: solve, products): ``gpt2-2l-64-v128`` N = 4 b = 10: 0.94 s, 100; b = 3: 0.75 s,
#: 61; ``gpt2-4l-128-v500`` N = 8: 17.8 s, 110; 10.4 s, 67; char-LSTM N = 32:
#: 0.76 s, 110; 0.53 s, 61 (``benchmarks/README.md``, "Narrow blocks").
IMPLICIT_BLOCK = 3
#: Extra columns of the block of Gram products beyond ``top_k``
#: (:func:`solver_block_size`).
GRAM_OVERSAMPLING = 8
#: Bytes per entry of the iterative solvers' Krylov blocks (float64).
_KRYLOV_ITEMSIZE = 8


def check_solver(solver: str, top_k: int | None = 1) -> None:
    """Check that ``solver`` is one of :data:`SOLVERS` and fits the request.

    Args:
        solver: The solver name.
        top_k: Number of leading eigenpairs requested (``None``: all).

    Raises:
        ValueError: If it is not a solver, if ``top_k`` is invalid, or if an
            iterative solver is asked for all eigenpairs.
    """
    if solver in RENAMED:
        raise InvalidArgumentError(
            f"solver={solver!r} is now {RENAMED[solver]} (docs/migration.rst)."
        )
    if not isinstance(solver, str) or solver not in SOLVERS:
        raise InvalidArgumentError(f"solver must be one of {SOLVERS}, got {solver!r}.")
    check_top_k(top_k)
    if top_k is None and solver != "dense" and solver != "auto":
        raise InvalidArgumentError(
            f"solver={solver!r} computes a few leading eigenpairs: pass top_k "
            "(e.g. top_k=10), or use solver='dense' for all of them."
        )


def solver_block_size(solver: str, top_k: int, size: int) -> int:
    """Block size ``b`` of an iterative solver (at most ``R``).

    ``"ggn_krylov"``: ``b = min(k,`` :data:`IMPLICIT_BLOCK` ``)``, certified by
    :func:`~vivit.linalg.iterative.narrow_block_doubt` (a cluster that could hide
    a copy of a multiple eigenvalue is solved again with ``b = k``).
    ``"factor_krylov"``: ``b = k`` (:func:`~vivit.linalg.iterative.
    default_block_size`). ``"gram_krylov"``:
    ``b = max(2·k, k + GRAM_OVERSAMPLING)``: a product with a Gram matrix larger
    than the cache costs a pass over it, so wider blocks (fewer passes) win
    although they need more products.

    Args:
        solver: ``"gram_krylov"``, ``"factor_krylov"`` or ``"ggn_krylov"``.
        top_k: Number of leading eigenpairs.
        size: Side length ``R`` of the Gram matrix (``D`` for ``"ggn_krylov"``).

    Returns:
        ``b``.
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

    Args:
        size: Side length ``R`` of the Gram matrix.
        top_k: Number of leading eigenpairs.
        dtype: Data type of the products.
        params: ``D`` for the matrix-free solver (a block of ``D``-vectors
            between the two ``V``-products and the contraction's copy of it,
            measured); ``None`` for products with the Gram.
        columns: Columns ``m`` of the basis (``None``: its default,
            :func:`~vivit.linalg.iterative.basis_capacity`; a basis cut by
            memory: :func:`fitting_basis_columns`).
        solver: ``"gram_krylov"``, ``"factor_krylov"`` or ``"ggn_krylov"`` (``None``:
            ``"gram_krylov"`` without ``params``, else ``"factor_krylov"``); its
            block size :func:`solver_block_size`.

    Returns:
        Bytes: the float64 basis and its image in the products' type (``m``
        columns each), their projection (``m × m``), the Ritz vectors a restart
        keeps and their images (:func:`~vivit.linalg.iterative.restart_size`
        each), a block with its image and the next (``max(b, k)`` each, in
        float64: a confirmation multiplies the ``k`` Ritz vectors at once) and
        two blocks in the products' dtype.
    """
    if solver is None:
        solver = "gram_krylov" if params is None else "factor_krylov"
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

    ``m = min(m_default, the most columns whose workspace fits the budget)``,
    never below :func:`~vivit.linalg.iterative.minimum_capacity` (``k + 2·b``;
    the caller refuses where even that does not fit). A cut basis restarts more
    often; the iteration converges by its thick restart all the same
    (``docs/math.rst``, "The Gram matrix and exact eigenpairs", "A basis cut by
    memory").

    Args:
        size: Side length of the operator (``D`` on the implicit route).
        top_k: Number of leading eigenpairs.
        dtype: Data type of the products.
        budget_bytes: Memory the solver's workspace may take (what is available
            less the products' own memory).
        params: As for :func:`iterative_workspace_bytes`.
        solver: As for :func:`iterative_workspace_bytes`.

    Returns:
        ``m``, for :func:`iterative_workspace_bytes` and the solver's
        ``max_columns``.
    """
    if solver is None:
        solver = "gram_krylov" if params is None else "factor_krylov"
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
        products: ``U ↦ G̃ U`` without the Gram matrix (``[N·C, K]`` columns),
            for the matrix-free solver.
        top_k: Number of leading eigenpairs.
        solver: ``"dense"``, ``"gram_krylov"``, ``"factor_krylov"`` or
            ``"ggn_krylov"`` (``products`` are then ``G V`` in parameter space).
        gram: Returns the Gram matrix, forming it if needed (not called by the
            matrix-free and implicit solvers).
        size: Side length ``N·C`` of the Gram matrix (``D`` for ``"ggn_krylov"``).
        requested: The solver the caller asked for; under ``"auto"`` an iterative
            solve that does not converge falls back to ``"dense"``.
        dtype: Data type of the factors' products.
        device: Their device.
        tol: Relative residual bound of the iterative solvers (default:
            :func:`~vivit.linalg.iterative.default_tolerance`).
        seed: Seed of their start block.
        max_columns: Most columns of their Krylov basis the memory allows
            (:func:`fitting_basis_columns`; ``None``: the default basis).

    Returns:
        Eigenvalues ``[k]`` ascending, Gram eigenvectors ``[N·C, k]`` as columns,
        and the report (with the residual for every solver).

    Raises:
        SolverNotConvergedError: If an explicitly requested iterative solver does
            not converge.
    """
    if solver == "dense":
        matrix = gram()
        evals, evecs = gram_eigh_top(matrix, top_k)
        report = SolverReport(
            solver="dense",
            requested=requested,
            residual=relative_residual(matrix @ evecs, evals, evecs),
            tolerance=None,
            converged=True,
        )
        return evals, evecs, report
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
    except SolverNotConvergedError as error:
        if requested != "auto":
            raise
        warnings.warn(
            f"{error} Falling back to the dense solver.", RuntimeWarning, stacklevel=3
        )
        evals, evecs, report = leading_eigenpairs(
            products,
            top_k,
            "dense",
            gram,
            size=size,
            requested=requested,
            dtype=dtype,
            device=device,
        )
        return evals, evecs, dataclasses.replace(report, fallback=str(error))
    return evals, evecs, dataclasses.replace(report, solver=solver, requested=requested)


def relative_residual(images: Tensor, evals: Tensor, evecs: Tensor) -> float:
    """``max_k ‖G̃ ũ_k − λ_k ũ_k‖ / λ_max`` (``0`` for a zero matrix).

    Args:
        images: ``G̃ U``, ``[N·C, K]``.
        evals: ``[K]``.
        evecs: ``U``, ``[N·C, K]``.

    Returns:
        The largest relative residual.
    """
    if evals.numel() == 0:
        return 0.0
    scale = evals.abs().max().item()
    residual = (images - evecs * evals).norm(dim=0).max().item()
    return residual / scale if scale > 0 else residual
