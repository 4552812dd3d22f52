"""Leading eigenpairs of a symmetric positive semi-definite operator, iteratively.

A restarted block Krylov (block Lanczos) method with Rayleigh-Ritz extraction. It
only multiplies the operator onto blocks of vectors, so it serves the Gram matrix
``G̃ = Vᵀ V`` (``docs/math.rst``, "The Gram matrix and exact eigenpairs") both held
densely (``G̃ U``) and matrix-free (``G̃ U = Vᵀ (V U)``, the Gram matrix never
formed).

One cycle builds the orthonormal basis ``Q`` of the block Krylov space
``[X, A X, …, A^q X]`` (block size ``b``, depth ``q``), projects ``T = Qᵀ A Q`` and
takes the leading eigenpairs ``(θ_i, s_i)`` of ``T``. The Ritz vectors
``u_i = Q s_i`` come with their images ``A u_i`` for free (``A Q`` is kept), so
the residuals ``‖A u_i − θ_i u_i‖`` cost no product. If the top ``k`` residuals are
at most ``tol · θ_max``, the pairs are returned; otherwise the next cycle starts
from the ``b`` leading Ritz vectors.

Accuracy contract: every returned pair satisfies
``‖A u − θ u‖ ≤ tol · θ_max`` with ``θ_max`` the largest Ritz value, so each ``θ`` is
within ``tol · θ_max`` of an eigenvalue of ``A`` (and within
``(tol · θ_max)² / gap`` when it is separated by ``gap`` from the rest of the
spectrum). This is the form of the dense solver's bound, an error of order
``ε · ‖A‖``. Results are deterministic for a given ``seed``: it fixes the random
start block, and nothing else is random.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vivit.errors import InvalidArgumentError, SolverNotConvergedError

#: Extra columns of the block beyond ``top_k``: ``b = max(2·k, k + 8)``. Krylov
#: convergence of ``λ_k`` is governed by ``λ_{b+1} / λ_k``; oversampling makes
#: this ratio small for the fast-decaying spectra of GGN Gram matrices.
MIN_OVERSAMPLING = 8
#: Krylov depth ``q`` per cycle: the basis holds ``b·(q+1)`` vectors.
DEPTH = 10
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


def default_tolerance(dtype: torch.dtype) -> float:
    """The default relative residual tolerance: ``max(100·ε, 1e-12)``.

    ``100·ε`` lies above the rounding floor of a product with the operator (in
    float32 about ``1.2e-5``); float64 stops at ``1e-12``.

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
            pairs (``None`` for a full decomposition, which LAPACK guarantees).
        tolerance: The residual bound that was requested (``None`` for dense).
        converged: Whether ``residual ≤ tolerance`` (always ``True`` for dense).
        cycles: Krylov cycles run (``0`` for dense).
        products: Vectors the operator was multiplied onto (``0`` for dense).
        fallback: Why another solver than the requested one was used, or ``None``.
    """

    solver: str
    requested: str
    residual: float | None
    tolerance: float | None
    converged: bool
    cycles: int = 0
    products: int = 0
    fallback: str | None = None


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
    depth: int = DEPTH,
) -> tuple[Tensor, Tensor, SolverReport]:
    """The ``top_k`` leading eigenpairs of a symmetric positive semi-definite operator.

    Args:
        matmul: ``U ↦ A U`` for ``U`` of shape ``[size, b]`` in ``dtype``.
        size: Side length of ``A``.
        top_k: Number of leading eigenpairs (at most ``size`` are returned).
        dtype: Data type of the operator (of ``U`` and of the results).
        device: Device of the operator.
        tol: Relative residual bound (default: :func:`default_tolerance`).
        seed: Seed of the random start block.
        max_restarts: Cycles after the first before giving up.
        block_size: Block size ``b`` (default ``max(2·k, k + 8)``, at most ``size``).
        depth: Krylov depth ``q`` per cycle.

    Returns:
        Eigenvalues ``[k]`` ascending, orthonormal eigenvectors ``[size, k]`` as
        columns, and the report.

    Raises:
        SolverNotConvergedError: If the residuals stay above ``tol``.
    """
    tol = default_tolerance(dtype) if tol is None else tol
    if not tol > 0:
        raise InvalidArgumentError(f"tol must be positive, got {tol!r}.")
    top_k = min(top_k, size)
    width = min(size, block_size or max(2 * top_k, top_k + MIN_OVERSAMPLING))
    width = max(width, top_k)
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(size, width, generator=generator, dtype=torch.float64)
    block = _orthonormalize(None, start.to(device))
    image = None
    products = 0
    history: list[float] = []

    def apply(vectors: Tensor) -> Tensor:
        nonlocal products
        products += vectors.shape[1]
        return matmul(vectors.to(dtype)).to(torch.float64)

    for cycle in range(1, max_restarts + 2):
        basis, images = _krylov(apply, block, image, depth)
        projected = basis.T @ images
        theta, coefficients = torch.linalg.eigh((projected + projected.T) / 2)
        keep = min(width, theta.numel())
        theta, coefficients = theta[-keep:], coefficients[:, -keep:]
        ritz, ritz_images = basis @ coefficients, images @ coefficients
        scale = theta.abs().max().item()
        residuals = (ritz_images - ritz * theta).norm(dim=0)[-top_k:]
        residual = residuals.max().item() / scale if scale > 0 else 0.0
        history.append(residual)
        if residual <= tol:
            report = SolverReport(
                solver="iterative",
                requested="iterative",
                residual=residual,
                tolerance=tol,
                converged=True,
                cycles=cycle,
                products=products,
            )
            return (
                theta[-top_k:].to(dtype),
                ritz[:, -top_k:].to(dtype),
                report,
            )
        if min(history) < min(history[-STAGNATION_CYCLES:], default=0.0):
            break
        block, image = ritz, ritz_images
    raise SolverNotConvergedError(
        f"The iterative eigensolver did not reach the relative residual {tol:.1e} "
        f"for the top {top_k} eigenpairs of the {size} x {size} Gram matrix: best "
        f"{min(history):.1e} after {len(history)} Krylov cycles ({products} "
        "products). Use solver='dense' (exact, O((N·C)^3)), a larger tol (at least "
        "the rounding floor of the data type, about 100·eps), or float64."
    )


def _krylov(
    apply: Callable[[Tensor], Tensor],
    block: Tensor,
    image: Tensor | None,
    depth: int,
) -> tuple[Tensor, Tensor]:
    """Orthonormal basis of ``[X, A X, …, A^q X]`` and its image under ``A``.

    Args:
        apply: The operator on float64 blocks.
        block: Orthonormal start block ``X``.
        image: ``A X`` if known (the Ritz vectors' images of the last cycle).
        depth: ``q``.

    Returns:
        ``Q`` and ``A Q``, both ``[size, m]``.
    """
    size, width = block.shape
    capacity = min(size, width * (depth + 1))
    basis = block.new_empty(size, capacity)
    images = block.new_empty(size, capacity)
    basis[:, :width] = block
    images[:, :width] = apply(block) if image is None else image
    filled, last = width, slice(0, width)
    while filled < capacity:
        new = _orthonormalize(basis[:, :filled], images[:, last])
        new = new[:, : capacity - filled]
        if new.shape[1] == 0:  # invariant subspace: the Krylov space is exhausted
            break
        last = slice(filled, filled + new.shape[1])
        basis[:, last] = new
        images[:, last] = apply(new)
        filled = last.stop
    return basis[:, :filled], images[:, :filled]


def _orthonormalize(basis: Tensor | None, block: Tensor) -> Tensor:
    """Orthonormal columns spanning ``block`` minus its part in ``span(basis)``.

    Projection twice (classical Gram-Schmidt with reorthogonalization), then
    eigenvalue-based normalization (SVQB), once more projection and SVQB for
    orthonormality to working precision. Directions that vanish on projection
    (relative to the block's largest column) are dropped.

    Args:
        basis: Orthonormal columns, or ``None``.
        block: Columns to orthonormalize.

    Returns:
        ``[size, b']`` with ``b' ≤ b``.
    """
    scale = block.norm(dim=0).max()
    if scale == 0:
        return block[:, :0]
    eps = torch.finfo(block.dtype).eps
    for projections in (2, 1):
        if basis is not None:
            for _ in range(projections):
                block = block - basis @ (basis.T @ block)
        evals, evecs = torch.linalg.eigh(block.T @ block)
        # below these, an eigenvalue of the block's Gram matrix is rounding noise
        floor = max((DROP_TOLERANCE * scale) ** 2, block.shape[1] * eps * evals[-1])
        keep = evals > floor
        block = (block @ evecs[:, keep]) / evals[keep].sqrt()
        if block.shape[1] == 0:
            break
        scale = 1.0
    return block
