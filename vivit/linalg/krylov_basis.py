"""The block Krylov solver's basis: its rows, their images, ``Qᵀ A Q`` and ``Qᵀ Q``.

The parts of :mod:`vivit.linalg.iterative` that touch vectors of the operator's side.
The rows are stored in the products' type (at least float32); every inner product
and combination of them accumulates in float64, a chunk of entries at a time
(``docs/math.rst``, "Implicit GGN-vector products", "Linear algebra").
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

#: Directions below this fraction of the block's largest norm after orthogonalization
#: are dropped: the Krylov space is exhausted (an invariant subspace).
DROP_TOLERANCE = 1e-13
#: Up to this condition number of a projected block's Gram matrix one
#: normalization (SVQB) leaves the block orthonormal within ``100·ε``, and the
#: third projection is skipped (``docs/math.rst``, "Implicit GGN-vector products").
SINGLE_SVQB_CONDITION = 100.0
#: Bytes of a chunk's float64 rows: converted, they stay in the cache for the product.
CHUNK_BYTES = 2**21
#: Fewest entries a chunk has, however many rows.
MIN_CHUNK = 256


def chunks(rows: int, size: int) -> Iterator[slice]:
    """Slices of the ``size`` entries whose ``rows`` float64 rows fill a chunk."""
    step = max(MIN_CHUNK, CHUNK_BYTES // (8 * max(rows, 1)))
    return (slice(start, start + step) for start in range(0, size, step))


def inner(rows: Tensor, *blocks: Tensor) -> Tensor:
    """``rows · [blocks…]ᵀ`` ``[n, Σ b]`` in float64: one pass over ``rows``."""
    width = sum(block.shape[0] for block in blocks)
    result = rows.new_zeros(rows.shape[0], width, dtype=torch.float64)
    for entries in chunks(rows.shape[0] + width, rows.shape[1]):
        right = torch.cat([block[:, entries] for block in blocks])
        result.addmm_(rows[:, entries].to(torch.float64), right.to(torch.float64).T)
    return result


def combine(coefficients: Tensor, rows: Tensor, out: Tensor) -> Tensor:
    """``out = coefficientsᵀ · rows`` in float64; ``out`` may be rows of ``rows``."""
    for entries in chunks(rows.shape[0], rows.shape[1]):
        out[:, entries] = coefficients.T @ rows[:, entries].to(torch.float64)
    return out


def relative_norm(
    theta: Tensor, first: Tensor, second: Tensor, scales: Tensor | None = None
) -> float:
    """``max_i ‖a_i − s_i b_i‖ / max |θ|`` (0 if ``θ = 0``) of rows, in float64."""
    scale = theta.abs().max().item()
    if scale == 0:
        return 0.0
    squares = first.new_zeros(first.shape[0], dtype=torch.float64)
    for entries in chunks(2 * first.shape[0], first.shape[1]):
        part = second[:, entries].to(torch.float64)
        if scales is not None:
            part = part * scales.unsqueeze(1)
        squares += (first[:, entries].to(torch.float64) - part).square().sum(1)
    return squares.max().sqrt().item() / scale


class KrylovBasis:
    """A basis ``Q`` of ``[X, A X, A² X, …]``, its image, ``Qᵀ A Q`` and ``Qᵀ Q``.

    One vector per row (``[m, size]``, at most ``capacity``), stored in ``dtype``
    (the products' type, at least float32): a new block writes only its rows. Stored
    rows are orthonormal up to their rounding; Rayleigh-Ritz takes their Gram
    matrix into account (``docs/math.rst``, "Implicit GGN-vector products",
    "Linear algebra").
    """

    def __init__(
        self, capacity: int, size: int, dtype: torch.dtype, device: torch.device
    ):
        self._basis_rows = torch.empty(capacity, size, dtype=dtype, device=device)
        self._image_rows = torch.empty_like(self._basis_rows)
        self._projected = torch.zeros(
            capacity, capacity, dtype=torch.float64, device=device
        )
        self._gram = torch.zeros_like(self._projected)
        self._filled = 0
        self._last = slice(0, 0)

    def append(self, block: Tensor, image: Tensor) -> None:
        """Add orthonormal rows (orthogonal to the basis) and their image ``A`` rows."""
        new = slice(self._filled, self._filled + block.shape[0])
        self._basis_rows[new] = block
        self._image_rows[new] = image
        self._couple(new)

    def restart(self, coefficients: Tensor, leading: Tensor, images: Tensor) -> None:
        """Keep the Ritz vectors ``Q s`` [m, r] only, as the basis' first rows.

        Their images are combined from the stored ones, except the last: the
        ``leading`` Ritz vectors (the last columns of ``s``) and their fresh
        ``images``, as a confirmation multiplied them. In place, a chunk at a time.
        """
        m, kept = self._filled, coefficients.shape[1]
        combined = slice(0, kept - leading.shape[0])
        for rows in (self._basis_rows, self._image_rows):
            combine(coefficients[:, combined], rows[:m], rows[combined])
        self._basis_rows[combined.stop : kept] = leading
        self._image_rows[combined.stop : kept] = images
        self._couple(slice(0, kept))

    def _couple(self, new: slice) -> None:
        """``Qᵀ A Q`` and ``Qᵀ Q`` of the rows ``new`` with those up to them."""
        rows = self._basis_rows[: new.stop]
        coupling = inner(rows, self._image_rows[new], self._basis_rows[new])
        width = new.stop - new.start
        for matrix, part in (
            (self._projected, coupling[:, :width]),
            (self._gram, coupling[:, width:]),
        ):
            matrix[: new.stop, new] = part
            matrix[new, : new.stop] = part.T
        self._filled, self._last = new.stop, new

    @property
    def room(self) -> int:
        """Vectors the basis can still take."""
        return self._basis_rows.shape[0] - self._filled

    def expansion(self) -> tuple[Tensor | None, Tensor]:
        """The next block ``R = (I − Q Qᵀ) A Q_last``, orthonormalized, and ``Rᵀ R``.

        ``‖A Q s − θ Q s‖ = ‖R s_last‖``: ``Rᵀ R`` gives every residual without Ritz
        vectors. The block (float64) is ``None`` where exhausted; it may not fit.
        """
        basis = self._basis_rows[: self._filled]
        coupling = self._projected[: self._filled, self._last]  # Qᵀ A Q_last
        image = self._image_rows[self._last]
        new, residual_gram = orthonormalize(basis, image, coupling)
        return (new if new.shape[0] > 0 else None), residual_gram

    def rayleigh_ritz(self, count: int) -> tuple[Tensor, Tensor]:
        """``count`` leading Ritz values, their ``s`` [m, c]: ``sᵀQᵀQs = I``.

        ``T s = θ Qᵀ Q s`` through the Cholesky factor ``L`` of ``Qᵀ Q``: the
        eigenpairs ``(θ, v)`` of ``L⁻¹ T L⁻ᵀ``, ``s = L⁻ᵀ v``.
        """
        m = self._filled
        projected, gram = self._projected[:m, :m], self._gram[:m, :m]
        factor = torch.linalg.cholesky((gram + gram.T) / 2)
        half = torch.linalg.solve_triangular(factor, projected, upper=False)
        reduced = torch.linalg.solve_triangular(factor, half.T, upper=False)
        theta, vectors = torch.linalg.eigh((reduced + reduced.T) / 2)
        keep = min(count, m)
        coefficients = torch.linalg.solve_triangular(
            factor.T, vectors[:, -keep:], upper=True
        )
        return theta[-keep:], coefficients

    def estimated_residuals(
        self, theta: Tensor, coefficients: Tensor, residual_gram: Tensor
    ) -> Tensor:
        """Each ``‖A u − θ u‖ / max |θ|`` from ``‖R s_last‖`` (:meth:`expansion`)."""
        scale = theta.abs().max().item()
        last = coefficients[self._last]
        squares = ((residual_gram @ last) * last).sum(dim=0).clamp(min=0)
        return squares.sqrt() / scale if scale > 0 else torch.zeros_like(squares)

    def ritz_vectors(self, coefficients: Tensor) -> tuple[Tensor, Tensor]:
        """Ritz vectors ``Q s`` and images ``A Q s``, rows in the basis' type."""
        m, count = self._filled, coefficients.shape[1]
        return tuple(
            combine(coefficients, rows[:m], rows.new_empty(count, rows.shape[1]))
            for rows in (self._basis_rows, self._image_rows)
        )


def orthonormalize(
    basis: Tensor | None, block: Tensor, coefficients: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Orthonormal float64 rows ``[b', R]``: ``block`` minus its part in the basis.

    Classical Gram-Schmidt twice, then SVQB, all again where ill-conditioned; drops
    vanishing directions. ``coefficients``: ``basis · blockᵀ`` where known. Also
    returns the block's Gram matrix ``[b, b]`` after the first projection.
    """
    # a copy, projected in place
    block = block.to(torch.float64, memory_format=torch.contiguous_format, copy=True)
    residual_gram = block.new_zeros(block.shape[0], block.shape[0])
    scale = block.norm(dim=1).max()
    if scale == 0:
        return block[:0], residual_gram
    eps = torch.finfo(block.dtype).eps
    for projections in (2, 1):
        if basis is not None:
            for _ in range(projections):
                if coefficients is None:
                    coefficients = inner(basis, block)
                for entries in chunks(basis.shape[0], basis.shape[1]):
                    part = basis[:, entries].to(torch.float64)
                    block[:, entries].addmm_(coefficients.T, part, alpha=-1)
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
