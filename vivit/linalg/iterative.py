"""Leading eigenpairs of a symmetric positive semi-definite operator, iteratively.

A restarted block Krylov (block Lanczos) method with Rayleigh-Ritz extraction. It
only multiplies the operator onto blocks of vectors, so it serves the Gram matrix
``G̃ = Vᵀ V`` (``docs/math.rst``, "The Gram matrix and exact eigenpairs") both held
densely (``G̃ U``) and matrix-free (``G̃ U = Vᵀ (V U)``, the Gram matrix never
formed).

A cycle grows the orthonormal basis ``Q`` of the block Krylov space
``[X, A X, A² X, …]`` (block size ``b``, by default ``k``) one block at a time, up
to :func:`basis_capacity` columns. After every block it takes the leading
eigenpairs ``(θ_i, s_i)`` of the projection ``T = Qᵀ A Q`` (grown with the basis:
only the new block's columns are multiplied). The residuals
``‖A u_i − θ_i u_i‖`` of the Ritz vectors ``u_i = Q s_i`` follow from the
remainder the next block is built from (``_KrylovBasis.expansion``), without
forming ``u_i``; once they are at most ``tol · θ_max``, the Ritz vectors are
multiplied afresh (``k`` products) and the residuals of those images confirm it
before the pairs are returned. A full basis restarts the next cycle from about
half as many leading Ritz vectors (:func:`restart_size`, a thick restart), whose
leading ``k`` keep the images the cycle's last confirmation multiplied. Where
memory is short, the caller cuts the basis (``max_columns``, at least
:func:`minimum_capacity`): the same contract after more restarts. Checking
after every block, not only at the end of a cycle, lets a small block (one vector for
the top eigenpair, as in ARPACK's Lanczos) reach the tolerance in the fewest
products: on the GGN Gram matrices of the benchmarks, ``b = k`` needs 30–45 %
fewer products than ``b = max(2·k, k + 8)`` (``benchmarks/README.md``,
"Iterative solvers: a convergence check after every block"; ``docs/math.rst``,
"The Gram matrix and exact eigenpairs", for the residual). Blocks narrower than
``k`` (the implicit route's ``b = 3``) need fewer still; their pairs are
returned only where no copy of a multiple eigenvalue can have been missed, else
solved again with ``b = k`` (:func:`narrow_block_doubt`; ``docs/math.rst``,
"Narrow blocks").

Accuracy contract: every returned pair satisfies
``‖A u − θ u‖ ≤ tol · θ_max`` with ``θ_max`` the largest Ritz value (``A u``
multiplied afresh; against the exact operator up to the products' rounding, see
below), so each ``θ`` is within ``tol · θ_max`` of an eigenvalue of ``A`` (and within
``(tol · θ_max)² / gap`` when it is separated by ``gap`` from the rest of the
spectrum). This is the form of the dense solver's bound, an error of order
``ε · ‖A‖``. Results are deterministic for a given ``seed``: it fixes the random
start block, and nothing else is random.

Rounding floor of the products: the estimate above holds in exact arithmetic;
every image ``A q`` carries the rounding of its product (float32 GGN-vector
products of a language model carry up to ``10⁻³ θ_max``). Every confirmation
(where the estimate is below the bound, or at the end of a cycle) measures it
from its fresh images: ``ρ = max ‖A u − Σ s_j (A q_j)‖ / θ_max``, the
disagreement of two evaluations of the same images. The pairs are accepted where
their fresh residual is at most ``max(tol, 2ρ)``, so that against the exact
operator it is at most 1.5 times that; above ``tol`` with a
:class:`~vivit.errors.RoundingFloorWarning`, and the report says so
(``docs/math.rst``, "The Gram matrix and exact eigenpairs", "Rounding floor of
the products").
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vivit.errors import (
    InvalidArgumentError,
    RoundingFloorWarning,
    SolverNotConvergedError,
)

#: Krylov depth ``q`` per cycle: the basis holds ``b·(q+1)`` vectors (at least
#: :data:`MIN_BASIS`); the iteration usually stops long before.
DEPTH = 20
#: Fewest columns of a cycle's basis, so that small blocks go deep enough.
MIN_BASIS = 64
#: Cycles after the first before the solver gives up.
MAX_RESTARTS = 30
#: The solver gives up after this many cycles in a row without a new smallest
#: residual: it fluctuates at the rounding floor of the products.
STAGNATION_CYCLES = 3
#: Directions whose norm after orthogonalization is below this fraction of the
#: block's largest norm are dropped: at the rounding level of float64 the Krylov
#: space is exhausted (an invariant subspace). Small but larger components are kept:
#: near convergence the new directions are small, not meaningless.
DROP_TOLERANCE = 1e-13
#: A residual at most this multiple of the measured rounding ``ρ`` of the
#: products is at their floor: the residual of either evaluation of the images is
#: uncertain by its own rounding, about ``ρ / √2`` for two independent ones.
ROUNDING_FACTOR = 2.0
#: After two projections every column ``r`` of a block has ``‖Qᵀ r‖ ≤ c·ε·‖r‖``;
#: SVQB (``R V Λ^{-1/2}``) amplifies that to ``c·ε·√(b·κ)`` and leaves
#: ``‖XᵀX − I‖ = O(κ·ε)``, ``κ`` the condition number of ``RᵀR``. Up to this
#: ``κ`` both stay within ``100·ε`` of working precision and the third
#: projection, two of a block's six passes over the basis, is skipped (on the
#: char-LSTM most blocks have ``κ ≤ 50``; GPT-2's steep spectra ``κ ≥ 10²``).
SINGLE_SVQB_CONDITION = 100.0
#: Two Ritz values closer than this multiple of the accepted residual bound
#: (relative to ``θ_max``) may approximate one eigenvalue: each lies within the
#: bound of an eigenvalue, so copies of a multiple one lie within twice of it.
CLUSTER_FACTOR = 2.0
#: Entries per row of the chunks in which a confirmation compares its vectors
#: and a restart combines float32 images in float64 (their temporaries stay
#: small, not of the operator's side length).
NORM_ROWS = 2**16
#: The seeds torch's generators take: ``[-2⁶³, 2⁶⁴)``.
SEEDS = (-(2**63), 2**64)


def default_tolerance(dtype: torch.dtype) -> float:
    """The default relative residual tolerance: ``max(100·ε, 1e-12)``.

    ``100·ε`` (in float32 about ``1.2e-5``) lies above the rounding of a product
    with a stored matrix; products whose terms cancel (float32 GGN-vector
    products) can round above it, see the module's "Rounding floor of the
    products". Float64 stops at ``1e-12``.

    Args:
        dtype: Data type of the operator.

    Returns:
        The tolerance.
    """
    return max(100 * torch.finfo(dtype).eps, 1e-12)


@dataclass(frozen=True)
class SolverReport:
    """How the leading eigenpairs of a Gram matrix were computed.

    Attributes:
        solver: ``"dense"``, ``"iterative"`` (on the Gram matrix) or
            ``"matrix_free"`` (on products with ``V``).
        requested: The solver that was asked for (``"auto"`` or one of the above).
        residual: Largest relative residual ``‖G̃ ũ − λ ũ‖ / λ_max`` of the returned
            pairs, from products of the returned vectors (``None`` for a full
            decomposition, which LAPACK guarantees).
        tolerance: The residual bound the pairs satisfy (``None`` for dense): the
            requested one, or ``2·rounding`` where that is larger.
        converged: Whether ``residual ≤ tolerance`` (always ``True`` for dense).
        cycles: Krylov cycles run (``0`` for dense).
        products: Vectors the operator was multiplied onto (``0`` for dense).
        fallback: Why another solver than the requested one was used, or ``None``.
        rounding: The products' rounding ``ρ`` relative to ``θ_max``, measured on
            the returned pairs' images (``None`` for dense; see
            :func:`block_krylov_eigh`).
        requested_tolerance: The bound that was asked for (``None`` for dense).
        basis_columns: Columns of a cycle's Krylov basis (``None`` for dense).
        basis_cut: Why the basis holds fewer columns than its default, e.g.
            ``"basis cut to 96 of 210 columns by memory"``, or ``None``.
        block_size: Block size ``b`` of the solve that returned the pairs
            (``None`` for dense).
        widened: Why a solve with a block narrower than ``top_k`` was run again
            with ``b = top_k`` (:func:`narrow_block_doubt`), or ``None``.
    """

    solver: str
    requested: str
    residual: float | None
    tolerance: float | None
    converged: bool
    cycles: int = 0
    products: int = 0
    fallback: str | None = None
    rounding: float | None = None
    requested_tolerance: float | None = None
    basis_columns: int | None = None
    basis_cut: str | None = None
    block_size: int | None = None
    widened: str | None = None


def check_tolerance(tol: object, name: str = "tol") -> None:
    """Check a relative residual bound: a number in ``(0, 1)``, or ``None``.

    A bound of 1 or more accepts any Ritz pairs, even ones that are not the
    leading eigenpairs.

    Args:
        tol: The bound (``None``: :func:`default_tolerance`).
        name: The argument's name in the message.

    Raises:
        InvalidArgumentError: If it is anything else.
    """
    if tol is not None and (
        isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1
    ):
        raise InvalidArgumentError(
            f"{name} must be a number in (0, 1) or None, got {tol!r}: the relative "
            "residual bound of the eigenpairs, e.g. 1e-6 (None: the data type's "
            "default)."
        )


def check_seed(seed: object, name: str = "seed") -> None:
    """Check the seed of the random start block: an integer torch can seed with.

    Args:
        seed: The seed.
        name: The argument's name in the message.

    Raises:
        InvalidArgumentError: If it is not an integer in ``[-2⁶³, 2⁶⁴)``.
    """
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int)
        or not SEEDS[0] <= seed < SEEDS[1]
    ):
        raise InvalidArgumentError(
            f"{name} must be an integer in [-2**63, 2**64), got {seed!r}."
        )


def default_block_size(top_k: int, size: int) -> int:
    """Block size ``b = k`` (at most ``size``), the default.

    Krylov depth, not block width, does the work: a wider block converges in
    fewer blocks but more products. ``b = k`` keeps a multiple eigenvalue's
    ``k`` leading copies within reach (a block Krylov space holds at most ``b``
    directions of one eigenspace); a narrower block is checked for them
    (:func:`narrow_block_doubt`).

    Args:
        top_k: Number of leading eigenpairs.
        size: Side length of the operator.

    Returns:
        ``b``.
    """
    return min(size, top_k)


def basis_capacity(
    width: int, size: int, depth: int | None = None, top_k: int = 0
) -> int:
    """Columns ``m`` of one cycle's Krylov basis (at most ``size``).

    Args:
        width: Block size ``b``.
        size: Side length of the operator.
        depth: Krylov depth ``q``: ``m = b·(q+1)``; ``None``: :data:`DEPTH`, and at
            least :data:`MIN_BASIS` columns.
        top_k: Leading eigenpairs asked for: the default basis holds at least
            ``3·k`` columns (room for ``k`` new ones after a restart keeps
            ``(m + k)/2``), which a block narrower than ``k`` needs.

    Returns:
        ``m``.
    """
    if depth is not None:
        return min(size, width * (depth + 1))
    return min(size, max(width * (DEPTH + 1), MIN_BASIS, 3 * top_k))


def minimum_capacity(top_k: int, width: int, size: int) -> int:
    """Fewest columns a basis cut by memory may keep: ``k + 2·b`` (at most ``size``).

    A full basis of ``k + 2·b`` columns restarts from its ``k + b`` leading Ritz
    vectors (:func:`restart_size`) and the block of the last remainder: every
    cycle adds one block, and the ``b`` Ritz vectors kept beyond the wanted ``k``
    give them a gap to ``λ_{k+b+1}`` rather than to ``λ_{k+1}`` (``docs/math.rst``,
    "The Gram matrix and exact eigenpairs", "A basis cut by memory").

    Args:
        top_k: Number of leading eigenpairs.
        width: Block size ``b``.
        size: Side length of the operator.

    Returns:
        The fewest columns.
    """
    return min(size, top_k + 2 * width)


def cycle_budget(top_k: int, width: int, capacity: int, full: int) -> float:
    """How many cycles of ``capacity`` columns add the blocks of one of ``full``.

    A cycle after a restart adds ``m − r`` columns (:func:`restart_size` ``r``):
    a basis cut from ``full`` columns to ``capacity`` may run this many times the
    cycles, so that a solve may multiply as many blocks as with the full basis.

    Args:
        top_k: Number of leading eigenpairs.
        width: Block size ``b``.
        capacity: Columns ``m`` of the basis that runs.
        full: Columns of the basis without a cut (:func:`basis_capacity`).

    Returns:
        The ratio, at least 1.
    """
    added = capacity - restart_size(top_k, width, capacity)
    return max(1.0, (full - restart_size(top_k, width, full)) / added)


def restart_size(top_k: int, width: int, capacity: int) -> int:
    """Ritz vectors a full basis restarts from: ``(m + k) // 2`` within ``[b, m − b]``.

    A thick restart: the leading Ritz vectors keep what the cycle learned about the
    next eigenvectors, and the next block is still only ``b`` wide, since
    ``A Y − Y Θ = R s_last`` for the kept Ritz vectors ``Y`` lies in the span of
    the last remainder ``R`` (see ``_KrylovBasis.expansion``); half the basis is
    kept, half is room for new blocks.

    Args:
        top_k: Number of leading eigenpairs.
        width: Block size ``b``.
        capacity: Columns ``m`` of a basis.

    Returns:
        The number of Ritz vectors kept (at least ``b``).
    """
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

    A block narrower than ``top_k`` needs fewer products (a Krylov space of
    more, thinner blocks reaches a higher polynomial degree per product), but
    holds at most ``b`` directions of a multiple eigenvalue: its pairs are
    returned only where :func:`narrow_block_doubt` finds nothing that could hide
    a missed copy, else the solve runs again with ``b = top_k`` (or the widest
    block ``max_columns`` allows, itself certified; the report's ``widened``
    says why, its ``products`` count every solve).

    Args:
        matmul: ``U ↦ A U`` for ``U`` of shape ``[size, b]`` in ``dtype``.
        size: Side length of ``A``.
        top_k: Number of leading eigenpairs (at most ``size`` are returned).
        dtype: Data type of the operator (of ``U`` and of the results).
        device: Device of the operator.
        tol: Relative residual bound (default: :func:`default_tolerance`).
        seed: Seed of the random start block.
        max_restarts: Cycles after the first before giving up.
        block_size: Block size ``b`` (default :func:`default_block_size`; at least
            1, at most ``size``; below ``top_k`` certified as above).
        depth: Krylov depth ``q`` per cycle (default: see :func:`basis_capacity`).
        max_columns: Most columns of the basis the memory allows (``None``: no
            limit). A basis cut below :func:`basis_capacity` to at least
            :func:`minimum_capacity` columns restarts more often and may run
            :func:`cycle_budget` times ``max_restarts + 1`` cycles and as many
            times :data:`STAGNATION_CYCLES` without progress; the report says so
            (``basis_cut``).
        rounding_floor: Whether pairs may be accepted at the products' measured
            rounding where it lies above ``tol`` (``False``: only at ``tol``, and
            a rounding ``2ρ > tol`` ends the solve with an error, for a caller
            that has an exact solver to fall back to).

    Returns:
        Eigenvalues ``[k]`` ascending, orthonormal eigenvectors ``[size, k]`` as
        columns, and the report.

    Raises:
        SolverNotConvergedError: If the residuals stay above ``tol`` (or the
            products' rounding floor, where that is larger), or the floor is at
            least 1 (or above ``tol`` without ``rounding_floor``), or a narrow
            block's pairs are in doubt and ``max_columns`` leaves no room for a
            wider block.
        InvalidArgumentError: If ``max_columns`` is below
            :func:`minimum_capacity`.

    Warns:
        RoundingFloorWarning: If ``tol`` lies below the products' rounding and the
            pairs were accepted at ``2·ρ`` (see the module's docstring).
    """
    check_tolerance(tol)
    check_seed(seed)
    tol = default_tolerance(dtype) if tol is None else tol
    if depth is not None and depth < 1:
        raise InvalidArgumentError(f"depth must be at least 1, got {depth!r}.")
    top_k = min(top_k, size)
    width = default_block_size(top_k, size) if block_size is None else block_size
    width = min(size, max(width, 1))

    def solve(width: int) -> tuple[Tensor, Tensor, SolverReport]:
        return _block_krylov(
            matmul,
            size,
            top_k,
            width,
            dtype=dtype,
            device=device,
            tol=tol,
            seed=seed,
            max_restarts=max_restarts,
            depth=depth,
            max_columns=max_columns,
            rounding_floor=rounding_floor,
        )

    theta, vectors, report = solve(width)
    doubt = widened = narrow_block_doubt(theta, report, width, top_k)
    products = report.products
    while doubt is not None:
        # the widest block whose smallest basis, top_k + 2·b columns, fits
        fits_all = max_columns is None or max_columns >= size
        wider = top_k if fits_all else (max_columns - top_k) // 2
        if min(wider, top_k) <= width:
            raise SolverNotConvergedError(
                f"The block of {width} vectors cannot certify the top {top_k} "
                f"eigenpairs ({doubt}), and the memory allows no wider block "
                f"(max_columns={max_columns}): ask for fewer pairs, or free memory "
                "for a larger Krylov basis."
            )
        width = min(wider, top_k)
        theta, vectors, report = solve(width)
        products += report.products
        doubt = narrow_block_doubt(theta, report, width, top_k)
    return (
        theta,
        vectors,
        dataclasses.replace(report, products=products, widened=widened),
    )


def narrow_block_doubt(
    theta: Tensor, report: SolverReport, width: int, top_k: int
) -> str | None:
    """Why a block narrower than ``top_k`` may have missed a leading eigenpair.

    A block Krylov space ``span{X, A X, …}`` of block size ``b`` holds at most
    ``b`` directions of any eigenspace: of an eigenvalue of multiplicity
    ``m > b``, ``b`` copies converge together and the others are never seen
    (in exact arithmetic). Copies lie within ``2·tol·θ_max`` of each other
    (:data:`CLUSTER_FACTOR`), so a cluster of fewer than ``b`` such Ritz values
    is a whole eigenspace. A cluster of ``b`` or more may not be, and matters
    where smaller Ritz values follow it, which missed copies would displace;
    so does a Krylov space exhausted before ``top_k`` directions. Pairs
    accepted at the products' rounding floor (a tolerance above the one asked
    for) resolve no cluster reliably: their bound against the exact operator
    is the one measured for blocks of ``top_k`` (``docs/math.rst``, "The Gram
    matrix and exact eigenpairs", "Narrow blocks").

    Args:
        theta: The Ritz values returned, ascending.
        report: The solve's report (its ``tolerance``, relative to ``θ_max``).
        width: Block size ``b`` of the solve.
        top_k: Leading eigenpairs asked for.

    Returns:
        The reason, or ``None`` where the pairs are certain (always for
        ``b ≥ top_k``).
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
    scale = theta.abs().max().item()
    close = (theta.diff() <= CLUSTER_FACTOR * report.tolerance * scale).tolist()
    start = 0
    for index, joined in enumerate([*close, False]):
        if not joined:
            size = index + 1 - start
            if size >= width and start > 0:
                values = theta[start : index + 1]
                return (
                    f"{size} Ritz values from {values.min().item():.6g} to "
                    f"{values.max().item():.6g} agree within the residual bound, "
                    f"as many as the block holds copies of one eigenvalue, and "
                    "smaller ones follow"
                )
            start = index + 1
    return None


def _block_krylov(
    matmul: Callable[[Tensor], Tensor],
    size: int,
    top_k: int,
    width: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    tol: float,
    seed: int,
    max_restarts: int,
    depth: int | None,
    max_columns: int | None,
    rounding_floor: bool,
) -> tuple[Tensor, Tensor, SolverReport]:
    """One solve of :func:`block_krylov_eigh` with block size ``width``."""
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
        cycles, stagnation = math.ceil(cycles * ratio), math.ceil(stagnation * ratio)
        cut = f"basis cut to {max_columns} of {capacity} columns by memory"
        capacity = max_columns
    kept = restart_size(top_k, width, capacity)
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(size, width, generator=generator, dtype=torch.float64)
    # blocks are kept one vector per row, [b, size], as the basis: a product of
    # the basis' rows with a block's rows runs twice as fast as with columns
    block, _ = _orthonormalize(None, start.T.contiguous().to(device))
    image = None
    products = 0
    history: list[float] = []

    def apply(rows: Tensor, widen: bool = True) -> Tensor:
        """``(A Uᵀ)ᵀ`` for a block of rows ``U``: the operator takes columns."""
        nonlocal products
        products += rows.shape[0]
        images = matmul(rows.to(dtype).T).T
        if not widen:  # a confirmation's: read once, in chunks
            return images
        return images.to(torch.float64, memory_format=torch.contiguous_format)

    following = None
    rounding = None  # the products' rounding ρ at the latest confirmation
    limit = tol
    for cycle in range(1, cycles + 1):
        image = apply(block) if image is None else image
        krylov = _KrylovBasis(block, image, capacity, _image_dtype(dtype))
        block = image = None  # copied into the basis
        if following is not None:  # thick restart: go on from the last remainder
            krylov.append(following, apply(following))
        while True:
            # the kept Ritz pairs (a restart's), the leading k of them the result's
            theta, restart_coefficients = krylov.rayleigh_ritz(kept)
            theta, coefficients = theta[-top_k:], restart_coefficients[:, -top_k:]
            new, residual_gram = krylov.expansion()
            fits = new is not None and new.shape[0] <= krylov.room
            residual = krylov.estimated_residual(theta, coefficients, residual_gram)
            # a narrow block confirms once the basis holds top_k Ritz pairs
            ready = residual <= limit and theta.numel() == top_k
            if ready or not fits:  # confirm, or the last chance
                ritz, stored_images = krylov.ritz_vectors(coefficients, widen=False)
                ritz_images = apply(ritz, widen=False)
                # the residual from fresh images, ρ from the same products
                residual = _relative_norm(theta, ritz_images, ritz, theta)
                rounding = _relative_norm(theta, ritz_images, stored_images)
                del stored_images
                limit = max(tol, ROUNDING_FACTOR * rounding)
                if limit >= 1 or (limit > tol and not rounding_floor):
                    break  # pairs within the floor resolve nothing, or are refused
                if residual <= limit:
                    if limit > tol:
                        _warn_rounding_floor(tol, limit, residual, rounding, dtype)
                    report = SolverReport(
                        solver="iterative",
                        requested="iterative",
                        residual=residual,
                        tolerance=limit,
                        converged=True,
                        cycles=cycle,
                        products=products,
                        rounding=rounding,
                        requested_tolerance=tol,
                        basis_columns=capacity,
                        basis_cut=cut,
                        block_size=width,
                    )
                    return theta.to(dtype), ritz.to(dtype).T, report
            if not fits:
                break
            krylov.append(new, apply(new))
        history.append(residual)
        if limit >= 1 or (limit > tol and not rounding_floor):
            break
        if min(history) < min(history[-stagnation:], default=0.0):
            break
        # the last chance confirmed the leading k of the kept Ritz vectors: their
        # fresh images replace the ones combined from the basis' images
        block, image = krylov.ritz_vectors(restart_coefficients)
        image[-ritz_images.shape[0] :] = ritz_images
        following, krylov = new, None  # the next basis replaces this one
    raise SolverNotConvergedError(
        f"The iterative eigensolver did not reach the relative residual "
        f"{_unreached(tol, limit, rounding, rounding_floor)} "
        f"for the top {top_k} eigenpairs of the {size} x {size} operator (the Gram "
        "matrix; with solver='implicit' the GGN in parameter space): best "
        f"{min(history):.1e} after {len(history)} Krylov cycles ({products} "
        f"products{'' if cut is None else f'; {cut}'}). Use a larger tol (at "
        "least the rounding floor of the data type, about 100·eps), float64 "
        "(gram_dtype=torch.float64; with solver='implicit' a float64 model, "
        "model.double()), or, where the Gram matrix can be formed (LowRankGGN), "
        "solver='dense' (exact, "
        "O((N·C)^3))."
    )


def _image_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type the basis' images are kept in: the products', at least float32."""
    return torch.float64 if torch.finfo(dtype).bits > 32 else torch.float32


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
        "For more, use float64 products (with solver='implicit' a float64 model, "
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


def _relative_norm(
    theta: Tensor, first: Tensor, second: Tensor, scales: Tensor | None = None
) -> float:
    """``max_i ‖a_i − s_i b_i‖ / max |θ|``, relative to the top Ritz value.

    In float64 and in chunks of :data:`NORM_ROWS` entries: a confirmation
    compares ``k`` vectors of the operator's side (``D`` entries each on the
    implicit route), and a temporary of their size would be the solve's largest.

    Args:
        theta: Ritz values.
        first: Rows ``a_i``, e.g. fresh images ``A u_i``, ``[k, R]``.
        second: Rows ``b_i``, e.g. the Ritz vectors ``u_i``.
        scales: ``s_i``, e.g. ``θ_i`` for residuals (``None``: 1).

    Returns:
        The ratio (``0`` if every Ritz value is zero).
    """
    scale = theta.abs().max().item()
    if scale == 0:
        return 0.0
    squares = first.new_zeros(first.shape[0], dtype=torch.float64)
    for start in range(0, first.shape[1], NORM_ROWS):
        entries = slice(start, start + NORM_ROWS)
        part = second[:, entries].to(torch.float64)
        if scales is not None:
            part = part * scales.unsqueeze(1)
        squares += (first[:, entries].to(torch.float64) - part).square().sum(1)
    return squares.max().sqrt().item() / scale


class _KrylovBasis:
    """An orthonormal basis ``Q`` of ``[X, A X, A² X, …]``, its image and ``Qᵀ A Q``.

    The projection ``T = Qᵀ A Q`` grows with the basis (only the new columns are
    multiplied), so Rayleigh-Ritz after every block costs ``O(m·b·R)`` besides a
    small ``m × m`` eigendecomposition. Blocks, the basis and its image are kept
    one vector per row (``[b, R]``, ``[m, R]``): a new block writes (and first
    touches) only its own rows, and the passes over the basis multiply rows
    with rows (twice as fast as with the columns of a ``[R, b]`` block).

    The basis is float64; the images are kept in the products' type (``dtype``,
    at least float32): a float32 product's image is exact in float32, and
    images combined in float64 (a restart's) round at ``ε`` of the products'
    type, below the products' own rounding.

    Args:
        block: Orthonormal start block ``X``, rows ``[b, R]``.
        image: ``A X``, rows.
        capacity: Most vectors the basis may hold.
        dtype: Data type of the products.
    """

    def __init__(self, block: Tensor, image: Tensor, capacity: int, dtype: torch.dtype):
        size = block.shape[1]
        self._basis_rows = block.new_empty(capacity, size)
        self._image_rows = block.new_empty(capacity, size, dtype=dtype)
        self._projected = block.new_empty(capacity, capacity)
        self._filled = 0
        self._last = slice(0, 0)
        self._last_image = image
        self.append(block, image)

    def append(self, block: Tensor, image: Tensor) -> None:
        """Add orthonormal vectors (orthogonal to the basis) and their image.

        Args:
            block: The vectors, rows ``[b', R]``.
            image: ``A`` times them, rows.
        """
        new = slice(self._filled, self._filled + block.shape[0])
        self._basis_rows[new] = block
        self._image_rows[new] = image
        self._filled, self._last, self._last_image = new.stop, new, image
        coupling = self._basis_rows[: new.stop] @ image.T
        self._projected[: new.stop, new] = coupling
        self._projected[new, : new.stop] = coupling.T

    @property
    def room(self) -> int:
        """Vectors the basis can still take."""
        return self._basis_rows.shape[0] - self._filled

    def expansion(self) -> tuple[Tensor | None, Tensor]:
        """The next block: ``A`` times the last one minus its part in ``Q``.

        The part left after projection, ``R = (I − Q Qᵀ) A Q_last``, is all of
        ``A Q − Q T`` (the earlier blocks' images lie in ``span(Q)``), so
        ``A Q s − θ Q s = R s_last`` for a Ritz pair ``(θ, Q s)``: its Gram matrix
        ``Rᵀ R`` gives every residual norm without forming Ritz vectors. (With
        products in float32 this holds to their rounding, far below the
        tolerance; the residuals are confirmed from the Ritz vectors.)

        Returns:
            ``R`` orthonormalized, rows (``None`` if the Krylov space is
            exhausted: an invariant subspace), which may not fit into the basis,
            and ``Rᵀ R``.
        """
        basis = self._basis_rows[: self._filled]
        coupling = self._projected[: self._filled, self._last]  # Qᵀ A Q_last
        new, residual_gram = _orthonormalize(basis, self._last_image, coupling)
        return (new if new.shape[0] > 0 else None), residual_gram

    def rayleigh_ritz(self, count: int) -> tuple[Tensor, Tensor]:
        """The ``count`` leading eigenpairs of ``T = Qᵀ A Q``.

        Args:
            count: Number of pairs (at most the basis' columns are returned).

        Returns:
            Ritz values ascending ``[c]`` and their coefficients ``s`` in the basis,
            ``[m, c]``.
        """
        m = self._filled
        projected = self._projected[:m, :m]
        theta, coefficients = torch.linalg.eigh((projected + projected.T) / 2)
        keep = min(count, m)
        return theta[-keep:], coefficients[:, -keep:]

    def estimated_residual(
        self, theta: Tensor, coefficients: Tensor, residual_gram: Tensor
    ) -> float:
        """``max ‖A u − θ u‖ / max |θ|`` from ``‖R s_last‖`` (see :meth:`expansion`).

        Args:
            theta: Ritz values.
            coefficients: Their coefficients in the basis.
            residual_gram: ``Rᵀ R``.

        Returns:
            The estimate (``0`` if every Ritz value is zero).
        """
        scale = theta.abs().max().item()
        last = coefficients[self._last]
        squares = ((residual_gram @ last) * last).sum(dim=0).clamp(min=0)
        return squares.max().sqrt().item() / scale if scale > 0 else 0.0

    def ritz_vectors(
        self, coefficients: Tensor, widen: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Ritz vectors ``Q s`` and their images ``A Q s``, rows.

        Args:
            coefficients: ``s``, ``[m, c]``.
            widen: Whether the images are returned in float64 (else in the
                type they are kept in).

        Returns:
            Both ``[c, R]``.
        """
        m = self._filled
        basis, images = self._basis_rows[:m], self._image_rows[:m]
        if images.dtype == torch.float64:
            combined = coefficients.T @ images
        else:  # in float64, a chunk of entries at a time: one rounding at the end
            combined = basis.new_empty(coefficients.shape[1], images.shape[1])
            for start in range(0, images.shape[1], NORM_ROWS):
                entries = slice(start, start + NORM_ROWS)
                part = images[:, entries].to(torch.float64)
                torch.mm(coefficients.T, part, out=combined[:, entries])
            if not widen:
                combined = combined.to(images.dtype)
        return coefficients.T @ basis, combined


def _orthonormalize(
    basis: Tensor | None, block: Tensor, coefficients: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Orthonormal rows spanning ``block`` minus its part in ``span(basis)``.

    Projection twice (classical Gram-Schmidt with reorthogonalization), then
    eigenvalue-based normalization (SVQB); once more projection and SVQB where
    that normalization was ill-conditioned (see :data:`SINGLE_SVQB_CONDITION`).
    Directions that vanish on projection (relative to the block's largest
    vector) are dropped.

    Args:
        basis: Orthonormal rows ``[m, R]``, or ``None``.
        block: Rows to orthonormalize, ``[b, R]``.
        coefficients: ``basis · blockᵀ`` (``[m, b]``) if already computed (the
            first projection then costs one pass over the basis instead of two).

    Returns:
        Rows ``[b', R]`` with ``b' ≤ b``, and the Gram matrix ``R Rᵀ`` of the
        block after the first projection ``R`` (``[b, b]``).
    """
    residual_gram = block.new_zeros(block.shape[0], block.shape[0])
    scale = block.norm(dim=1).max()
    if scale == 0:
        return block[:0], residual_gram
    eps = torch.finfo(block.dtype).eps
    for projections in (2, 1):
        if basis is not None:
            for _ in range(projections):
                if coefficients is None:
                    coefficients = basis @ block.T
                # block − coefficientsᵀ·basis in one pass, no temporary
                block = torch.addmm(block, coefficients.T, basis, alpha=-1)
                coefficients = None
        gram = block @ block.T
        if projections == 2:
            residual_gram = gram
        evals, evecs = torch.linalg.eigh(gram)
        # below these, an eigenvalue of the block's Gram matrix is rounding noise
        floor = max((DROP_TOLERANCE * scale) ** 2, block.shape[0] * eps * evals[-1])
        keep = evals > floor
        kept = evals[keep]
        # the scaling on the small b × b side: one pass over the block less
        block = (evecs[:, keep] / kept.sqrt()).T @ block
        if block.shape[0] == 0 or kept[-1] <= SINGLE_SVQB_CONDITION * kept[0]:
            break  # orthonormal to working precision already
        scale = 1.0
    return block, residual_gram
