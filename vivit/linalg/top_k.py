"""Leading eigenpairs of a group's Gram matrix or GGN: the solvers, and running one.

``"dense"``: LAPACK on the Gram matrix; ``"gram_krylov"``: block Krylov on it;
``"factor_krylov"``: on products with ``V``'s factors; ``"ggn_krylov"``: on ``G``
(:mod:`vivit.sources.implicit`). ``"auto"`` (:mod:`vivit.memory.costs`) falls back
to ``"dense"`` where an iterative solve does not converge; one asked for raises.
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
#: Block size of the implicit route's products (at most ``top_k``): products run one
#: vector at a time, and thinner blocks take fewer of them; a single vector cannot
#: tell copies of an eigenvalue apart (``docs/math.rst``, "Narrow blocks").
IMPLICIT_BLOCK = 2
#: Extra columns of the block of Gram products beyond ``top_k``.
GRAM_OVERSAMPLING = 8


def check_solver(solver: str, top_k: int | None = 1) -> None:
    """Check that ``solver`` is one of :data:`SOLVERS` and fits ``top_k``.

    Raises:
        InvalidArgumentError: If it is not a solver, if ``top_k`` is invalid, or if
            an iterative solver is asked for all eigenpairs.
    """
    if isinstance(solver, str) and solver in RENAMED:
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
    """Block size ``b`` (at most ``size``); wide for gram_krylov: a pass a product."""
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
    """Bytes of the iterative solvers' workspace besides the ``size²`` Gram matrix.

    In the products' type (at least float32): the basis (``columns``, default
    ``basis_capacity``), its images, a confirmation's Ritz vectors and their
    combined images (``max(b, k)`` each); in float64: three blocks of ``b`` being
    orthogonalized, ``Qᵀ A Q`` and ``Qᵀ Q``; two blocks of ``max(b, k)`` in
    ``dtype`` (``D = params`` long too for the matrix-free solver). ``solver``
    defaults to ``"gram_krylov"`` without ``params``, else to ``"factor_krylov"``.
    """
    solver, width = _block_of(solver, top_k, size, params)
    wide = max(width, min(top_k, size))
    if columns is None:
        columns = basis_capacity(width, size, top_k=top_k)
    stored = max(itemsize(dtype), 4)  # the basis' type
    workspace = 2 * (columns + wide) * size * stored
    workspace += (3 * width * size + 2 * columns**2) * 8  # float64
    return workspace + 2 * wide * (size + (params or 0)) * itemsize(dtype)


def _block_of(solver: str | None, top_k: int, size: int, params: int | None):
    """The solver (default by ``params``) and its :func:`solver_block_size`."""
    solver = solver or ("gram_krylov" if params is None else "factor_krylov")
    return solver, solver_block_size(solver, top_k, size)


def fitting_basis_columns(
    size: int,
    top_k: int,
    dtype: torch.dtype,
    budget_bytes: float,
    params: int | None = None,
    solver: str | None = None,
) -> int:
    """Columns ``m`` of the Krylov basis (the solver's ``max_columns``) that fit.

    The default basis where its workspace fits ``budget_bytes``, else the most
    columns that fit, never below :func:`~vivit.linalg.iterative.minimum_capacity`
    (the caller refuses where even that does not fit). A cut basis restarts more
    often and converges all the same (``docs/math.rst``, "A basis cut by memory").
    ``size`` is the operator's (``D`` on the implicit route); ``params`` and
    ``solver`` as for :func:`iterative_workspace_bytes`.
    """
    solver, width = _block_of(solver, top_k, size, params)
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

    ``products`` is ``U ↦ G̃ U`` for columns ``[N·C, K]`` without the Gram matrix
    (``G V`` in parameter space for ``"ggn_krylov"``, ``size`` then ``D``);
    ``gram`` returns the Gram matrix, formed if needed. Under ``requested="auto"``
    an iterative solve that does not converge warns and falls back to ``"dense"``.
    ``tol``, ``seed`` and ``max_columns`` (:func:`fitting_basis_columns`) are
    :func:`~vivit.linalg.iterative.block_krylov_eigh`'s.

    Returns:
        Eigenvalues ``[k]`` ascending, eigenvectors ``[size, k]``, and the report.

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
                f"{error} Falling back to the dense solver.", RuntimeWarning, 3
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
