"""Leading eigenpairs of a symmetric positive semi-definite operator, iteratively.

Restarted block Krylov (block Lanczos) with Rayleigh-Ritz (``docs/math.rst``, "The
Gram matrix and exact eigenpairs"). Names: ``k = top_k``, block size ``b = width``,
``m`` basis columns (``capacity``), ``size`` the operator's side length.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from vivit.errors import (
    InvalidArgumentError,
    RoundingFloorWarning,
    SolverNotConvergedError,
)
from vivit.linalg.krylov_basis import KrylovBasis, orthonormalize, relative_norm
from vivit.linalg.solver_report import (
    SolverReport,
    check_seed,
    check_tolerance,
    default_tolerance,
)

#: Krylov depth ``q`` per cycle (:func:`basis_capacity`).
DEPTH = 20
#: Fewest columns of a cycle's basis, so that small blocks go deep enough.
MIN_BASIS = 64
#: Cycles after the first before the solver gives up.
MAX_RESTARTS = 30
#: Cycles in a row without a new smallest residual (at the rounding floor) to give up.
STAGNATION_CYCLES = 3
#: Pairs are accepted at this multiple of the products' measured rounding ``ρ``
#: where that is above ``tol`` (``docs/math.rst``, "Rounding floor of the products").
ROUNDING_FACTOR = 2.0
#: Ritz values closer than this multiple of the residual bound (relative to
#: ``θ_max``) may approximate one eigenvalue.
CLUSTER_FACTOR = 2.0


def default_block_size(top_k: int, size: int) -> int:
    """``b = k`` (at most ``size``): the ``k`` copies of an eigenvalue stay in reach."""
    return min(size, top_k)


def basis_capacity(
    width: int, size: int, depth: int | None = None, top_k: int = 0
) -> int:
    """Columns ``m = b·(depth + 1)`` of a cycle's basis (at most ``size``).

    Without ``depth``: :data:`DEPTH`, and at least :data:`MIN_BASIS` and ``3·k``.
    """
    if depth is not None:
        return min(size, width * (depth + 1))
    return min(size, max(width * (DEPTH + 1), MIN_BASIS, 3 * top_k))


def minimum_capacity(top_k: int, width: int, size: int) -> int:
    """Fewest columns of a basis cut by memory, ``k + 2·b`` (at most ``size``)."""
    return min(size, top_k + 2 * width)


def cycle_budget(top_k: int, width: int, capacity: int, full: int) -> float:
    """Factor (≥ 1) on the cycles of a basis cut from ``full``: as many blocks."""
    added = capacity - restart_size(top_k, width, capacity)
    return max(1.0, (full - restart_size(top_k, width, full)) / added)


def restart_size(top_k: int, width: int, capacity: int) -> int:
    """Ritz vectors a thick restart keeps: ``(m + k) // 2`` within ``[b, m − b]``."""
    return max(width, min(capacity - width, (capacity + top_k) // 2))


def block_krylov_eigh(
    matmul: Callable[[Tensor], Tensor],
    size: int,
    top_k: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tol: float | None = None,
    seed: int = 0,
    max_restarts: int = MAX_RESTARTS,
    block_size: int | None = None,
    depth: int | None = None,
    max_columns: int | None = None,
    rounding_floor: bool = True,
) -> tuple[Tensor, Tensor, SolverReport]:
    """The ``top_k`` leading eigenpairs of a symmetric positive semi-definite operator.

    Every returned pair has ``‖A u − θ u‖ ≤ tolerance · θ_max``: ``tol``, or twice
    the products' measured rounding where that is larger. Deterministic for a
    given ``seed``. Where :func:`narrow_block_doubt` doubts a narrow block's pairs,
    or :func:`cluster_doubt` its converged Ritz pairs during the solve, the solve
    runs again with ``b = top_k`` (or the widest block ``max_columns`` allows);
    the report's ``widened`` says why.

    Args:
        matmul: ``U ↦ A U`` for ``U`` ``[size, b]``.
        size: Side length of ``A``.
        top_k: Number of leading eigenpairs (at most ``size`` are returned).
        dtype: Data type of ``U`` and of the results.
        device: Device of ``U``.
        tol: Relative residual bound (default: :func:`default_tolerance`).
        seed: Seed of the random start block.
        max_restarts: Cycles after the first before giving up.
        block_size: ``b`` (default :func:`default_block_size`; within ``[1, size]``).
        depth: Krylov depth ``q`` per cycle (default: see :func:`basis_capacity`).
        max_columns: Most basis columns the memory allows (``None``: no limit); a
            cut basis runs :func:`cycle_budget` times the cycles.
        rounding_floor: Whether pairs may be accepted at the products' measured
            rounding above ``tol`` (``False``: that raises instead).

    Returns:
        Eigenvalues ``[k]`` ascending, orthonormal eigenvectors ``[size, k]``, report.

    Raises:
        SolverNotConvergedError: If the residuals stay above the bound, the
            rounding floor is at least 1 (or above ``tol`` without
            ``rounding_floor``), or a narrow block's pairs are in doubt and
            ``max_columns`` leaves no room for a wider block.
        InvalidArgumentError: If ``tol``, ``seed`` or ``depth`` is invalid or
            ``max_columns`` is below :func:`minimum_capacity`.

    Warns:
        RoundingFloorWarning: If the pairs were accepted at ``2·ρ`` above ``tol``.
    """
    check_tolerance(tol)
    check_seed(seed)
    tol = default_tolerance(dtype) if tol is None else tol
    if depth is not None and depth < 1:
        raise InvalidArgumentError(f"depth must be at least 1, got {depth!r}.")
    top_k = min(top_k, size)
    width = default_block_size(top_k, size) if block_size is None else block_size
    width = min(size, max(width, 1))

    def solve(width: int) -> tuple[Tensor, Tensor, SolverReport, str | None]:
        """One solve with block size ``width``, and why its pairs are in doubt.

        A solve that a converged cluster puts in doubt stops there: its pairs are
        ``None`` and its report (not converged) counts the products.
        """
        capacity = basis_capacity(width, size, depth, top_k)
        cut = None
        cycles, stagnation = max_restarts + 1, STAGNATION_CYCLES
        if max_columns is not None and max_columns < capacity:
            least = minimum_capacity(top_k, width, size)
            if max_columns < least:
                raise InvalidArgumentError(
                    f"max_columns={max_columns} leaves the Krylov basis fewer than "
                    f"{least} columns (top_k + 2 blocks of {width}), too few for a "
                    "restart to keep the leading Ritz vectors and add a block: allow "
                    "more columns or ask for fewer pairs."
                )
            # a cut cycle adds fewer blocks: as many blocks to run and to stagnate
            ratio = cycle_budget(top_k, width, max_columns, capacity)
            cycles = math.ceil(cycles * ratio)
            stagnation = math.ceil(stagnation * ratio)
            cut = f"basis cut to {max_columns} of {capacity} columns by memory"
            capacity = max_columns
        kept = restart_size(top_k, width, capacity)
        generator = torch.Generator().manual_seed(seed)
        start = torch.randn(size, width, generator=generator, dtype=torch.float64)
        # blocks are rows [b, size], as the basis: row-by-row products run faster
        block, _ = orthonormalize(None, start.T.contiguous().to(device))
        rounding = None  # ρ: at the latest confirmation
        products, limit = 0, tol
        history: list[float] = []
        # the basis and its images in the products' type, at least float32
        storage = torch.float64 if torch.finfo(dtype).bits > 32 else torch.float32

        def apply(rows: Tensor) -> Tensor:
            """``(A Uᵀ)ᵀ`` for a block of rows ``U``: the operator takes columns."""
            nonlocal products
            products += rows.shape[0]
            return matmul(rows.to(dtype).T).T

        def report(cycle: int, residual: float, converged: bool) -> SolverReport:
            """The report of this solve."""
            return SolverReport(
                solver="gram_krylov",
                requested="gram_krylov",
                residual=residual,
                tolerance=limit,
                converged=converged,
                cycles=cycle,
                products=products,
                rounding=rounding,
                requested_tolerance=tol,
                basis_columns=capacity,
                basis_cut=cut,
                block_size=width,
            )

        krylov = KrylovBasis(capacity, size, storage, device)
        krylov.append(block, apply(block))
        for cycle in range(1, cycles + 1):
            while True:
                # the kept Ritz pairs (a restart's), the leading k of them the result's
                theta, restart_coefficients = krylov.rayleigh_ritz(kept)
                theta, coefficients = theta[-top_k:], restart_coefficients[:, -top_k:]
                new, residual_gram = krylov.expansion()
                fits = new is not None and new.shape[0] <= krylov.room
                residuals = krylov.estimated_residuals(
                    theta, coefficients, residual_gram
                )
                residual = residuals.max().item()
                if width < top_k and theta.numel() == top_k:
                    # copies found now stay (docs/math.rst, "Narrow blocks")
                    doubt = cluster_doubt(theta, limit, width, residuals <= limit)
                    if doubt is not None:
                        return None, None, report(cycle, residual, False), doubt
                # a narrow block confirms once the basis holds top_k Ritz pairs
                ready = residual <= limit and theta.numel() == top_k
                if ready or not fits:  # confirm, or the last chance
                    ritz, stored_images = krylov.ritz_vectors(coefficients)
                    ritz_images = apply(ritz)
                    # the residual from fresh images, ρ from the same products
                    residual = relative_norm(theta, ritz_images, ritz, theta)
                    rounding = relative_norm(theta, ritz_images, stored_images)
                    del stored_images
                    limit = max(tol, ROUNDING_FACTOR * rounding)
                    if limit >= 1 or (limit > tol and not rounding_floor):
                        break  # pairs within the floor resolve nothing, or are refused
                    if residual <= limit:
                        if limit > tol:
                            _warn_rounding_floor(tol, limit, residual, rounding, dtype)
                        found = report(cycle, residual, True)
                        doubt = narrow_block_doubt(theta, found, width, top_k)
                        return theta.to(dtype), ritz.to(dtype).T, found, doubt
                if not fits:
                    break
                krylov.append(new, apply(new))
            history.append(residual)
            if limit >= 1 or (limit > tol and not rounding_floor):
                break
            if min(history) < min(history[-stagnation:], default=0.0):
                break
            # the last chance confirmed the leading k of the kept Ritz vectors: they
            # and their fresh images replace the ones combined from the basis'
            krylov.restart(restart_coefficients, ritz, ritz_images)
            del ritz, ritz_images  # copied into the basis
            if new is not None:  # thick restart: go on from the last remainder
                krylov.append(new, apply(new))
        raise SolverNotConvergedError(
            f"The iterative eigensolver did not reach the relative residual "
            f"{_unreached(tol, limit, rounding, rounding_floor)} "
            f"for the top {top_k} eigenpairs of the {size} x {size} operator (the Gram "
            "matrix; with route='implicit' the GGN in parameter space): best "
            f"{min(history):.1e} after {len(history)} Krylov cycles ({products} "
            f"products{'' if cut is None else f'; {cut}'}). Use a larger tol (at "
            "least the rounding floor of the data type, about 100·eps), float64 "
            "(gram_dtype=torch.float64; with route='implicit' a float64 model, "
            "model.double()), or, where the Gram matrix can be formed (LowRankGGN), "
            "solver='dense' (exact, O((N·C)^3))."
        )

    total_products, widened = 0, None
    while True:
        theta, vectors, report, doubt = solve(width)
        total_products += report.products
        if doubt is None:
            break
        widened = widened or doubt
        # the widest block whose smallest basis, top_k + 2·b columns, fits
        fits_all = max_columns is None or max_columns >= size
        wider = min(top_k, top_k if fits_all else (max_columns - top_k) // 2)
        if wider <= width:
            raise SolverNotConvergedError(
                f"The block of {width} vectors cannot certify the top {top_k} "
                f"eigenpairs ({doubt}), and the memory allows no wider block "
                f"(max_columns={max_columns}): ask for fewer pairs, or free memory "
                "for a larger Krylov basis."
            )
        width = wider
    report = dataclasses.replace(report, products=total_products, widened=widened)
    return theta, vectors, report


def narrow_block_doubt(
    theta: Tensor, report: SolverReport, width: int, top_k: int
) -> str | None:
    """Why a block of ``width < top_k`` may have missed a leading pair, or ``None``.

    ``docs/math.rst``, "Narrow blocks"; ``theta`` are the Ritz values, ascending.
    """
    if width >= top_k:
        return None
    if theta.numel() < top_k:
        return (
            f"its Krylov space ran out after {theta.numel()} directions: the "
            "operator's rank is below the pairs asked for"
        )
    if report.tolerance > report.requested_tolerance:
        return (
            f"the pairs were accepted at the products' rounding floor "
            f"{report.tolerance:.1e}, above the {report.requested_tolerance:.1e} "
            "asked for"
        )
    return cluster_doubt(theta, report.tolerance, width)


def cluster_doubt(
    theta: Tensor, bound: float, width: int, converged: Tensor | None = None
) -> str | None:
    """A cluster of at least ``width`` Ritz values above smaller ones, or ``None``.

    Values within ``CLUSTER_FACTOR · bound · θ_max`` of their neighbours form a
    cluster; with ``converged`` (a mask, during a solve) only one whose pairs all
    have residuals within ``bound`` counts (``docs/math.rst``, "Narrow blocks").
    """
    scale = theta.abs().max().item()
    close = (theta.diff() <= CLUSTER_FACTOR * bound * scale).tolist()
    start = 0
    for index, joined in enumerate([*close, False]):
        if not joined:
            size = index + 1 - start
            members = slice(start, index + 1)
            if (
                size >= width
                and start > 0
                and (converged is None or bool(converged[members].all()))
            ):
                values = theta[members]
                return (
                    f"{size} Ritz values from {values.min().item():.6g} to "
                    f"{values.max().item():.6g} agree within the residual bound, "
                    f"as many as the block holds copies of one eigenvalue, and "
                    "smaller ones follow"
                )
            start = index + 1
    return None


def _unreached(
    tol: float, limit: float, rounding: float | None, rounding_floor: bool
) -> str:
    """The bound a failed solve did not reach, and why it is not ``tol`` if not."""
    if limit <= tol:
        return f"{tol:.1e}"
    if rounding_floor:
        return (
            f"{limit:.1e} (raised from {tol:.1e} to twice the products' measured "
            f"rounding {rounding:.1e})"
        )
    return (
        f"{tol:.1e} (the products' measured rounding {rounding:.1e} is above half "
        "of it: no residual they give can confirm it)"
    )


def _warn_rounding_floor(
    tol: float, limit: float, residual: float, rounding: float | None, dtype
) -> None:
    """Say that the pairs were accepted at the products' rounding floor."""
    wider = (
        "For more, use float64 products (with route='implicit' a float64 model, "
        "model.double())."
        if dtype != torch.float64
        else "The products are float64 already: their rounding is the limit."
    )
    warnings.warn(
        f"The requested relative residual {tol:.1e} lies below the rounding of the "
        f"operator's products: two evaluations of the Ritz vectors' images differ "
        f"by {rounding:.1e} of the largest eigenvalue, so the eigenpairs were "
        f"accepted at twice that, {limit:.1e} (residual {residual:.1e}). "
        "Eigenvalues closer than that (relative to the largest) to each other or "
        f"to zero are not resolved. {wider}",
        RoundingFloorWarning,
        stacklevel=3,
    )
