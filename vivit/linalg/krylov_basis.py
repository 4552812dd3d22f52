"""The block Krylov solver's basis: orthonormal rows, their images and ``Qᵀ A Q``.

The parts of :mod:`vivit.linalg.iterative` that touch vectors of the operator's side.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Directions below this fraction of the block's largest norm after orthogonalization
#: are dropped: the Krylov space is exhausted (an invariant subspace).
DROP_TOLERANCE = 1e-13
#: Up to this condition number of a projected block's Gram matrix one
#: normalization (SVQB) leaves the block orthonormal within ``100·ε``, and the
#: third projection is skipped (``docs/math.rst``, "Implicit GGN-vector products").
SINGLE_SVQB_CONDITION = 100.0
#: Entries per row of a float64 chunk: no temporary has the operator's side length.
NORM_ROWS = 2**16


def relative_norm(
    theta: Tensor, first: Tensor, second: Tensor, scales: Tensor | None = None
) -> float:
    """``max_i ‖a_i − s_i b_i‖ / max |θ|`` (0 if ``θ = 0``) of rows, in float64."""
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


class KrylovBasis:
    """An orthonormal basis ``Q`` of ``[X, A X, A² X, …]``, its image and ``Qᵀ A Q``.

    One vector per row (``[m, R]``, at most ``capacity``): a new block writes only
    its rows. The basis is float64, the images ``dtype`` (the products' type, at
    least float32). ``block``: the orthonormal start ``X`` ``[b, R]``, ``image`` ``AX``.
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
        """Add orthonormal rows (orthogonal to the basis) and their image ``A`` rows."""
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
        """The next block ``R = (I − Q Qᵀ) A Q_last``, orthonormalized, and ``Rᵀ R``.

        ``‖A Q s − θ Q s‖ = ‖R s_last‖``: ``Rᵀ R`` gives every residual without Ritz
        vectors. The block is ``None`` where exhausted; it may not fit the basis.
        """
        basis = self._basis_rows[: self._filled]
        coupling = self._projected[: self._filled, self._last]  # Qᵀ A Q_last
        new, residual_gram = orthonormalize(basis, self._last_image, coupling)
        return (new if new.shape[0] > 0 else None), residual_gram

    def rayleigh_ritz(self, count: int) -> tuple[Tensor, Tensor]:
        """``count`` leading Ritz values of ``T`` (ascending), their ``s`` [m, c]."""
        m = self._filled
        projected = self._projected[:m, :m]
        theta, coefficients = torch.linalg.eigh((projected + projected.T) / 2)
        keep = min(count, m)
        return theta[-keep:], coefficients[:, -keep:]

    def estimated_residual(
        self, theta: Tensor, coefficients: Tensor, residual_gram: Tensor
    ) -> float:
        """``max ‖A u − θ u‖ / max |θ|`` from ``‖R s_last‖`` (:meth:`expansion`)."""
        scale = theta.abs().max().item()
        last = coefficients[self._last]
        squares = ((residual_gram @ last) * last).sum(dim=0).clamp(min=0)
        return squares.max().sqrt().item() / scale if scale > 0 else 0.0

    def ritz_vectors(
        self, coefficients: Tensor, widen: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Ritz vectors ``Q s`` and images ``A Q s`` (float64 if ``widen``), rows."""
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


def orthonormalize(
    basis: Tensor | None, block: Tensor, coefficients: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Orthonormal rows ``[b', R]`` spanning ``block`` minus its part in the basis.

    Classical Gram-Schmidt twice, then SVQB, all again where ill-conditioned; drops
    vanishing directions. ``coefficients``: ``basis · blockᵀ`` where known. Also
    returns the block's Gram matrix ``[b, b]`` after the first projection.
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
