"""How far an approximation's top-k eigenpairs and damped step are from the exact.

The measures of ``docs/math.rst``, "Approximation audit", on float64 tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor


def eigenvalue_errors(exact: Tensor, approx: Tensor) -> Tensor:
    """``|λ̂_i − λ_i| / λ_i`` rank by rank, both sorted descending.

    Args:
        exact: The exact top-k eigenvalues ``[k]``, descending, positive.
        approx: The approximation's top eigenvalues ``[k' ≤ k]``, descending.

    Returns:
        ``[k]`` relative errors (``1`` at ranks the approximation lacks).
    """
    padded = exact.new_zeros(exact.shape)
    padded[: approx.numel()] = approx[: exact.numel()]
    return (padded - exact).abs() / exact


def principal_cosines(exact: Tensor, approx: Tensor) -> Tensor:
    """Cosines of the principal angles between two eigenspaces: ``svdvals(U Ûᵀ)``.

    Args:
        exact: The exact top-k eigenvectors as orthonormal rows ``[k, D]``.
        approx: The approximation's top eigenvectors as orthonormal rows
            ``[k', D]``.

    Returns:
        ``[k]`` cosines in ``[0, 1]``, descending (zero for ``k − k'`` of them
        if ``k' < k``).
    """
    cosines = exact.new_zeros(exact.shape[0])
    if approx.shape[0] > 0:
        singular = torch.linalg.svdvals(exact @ approx.T)
        cosines[: singular.numel()] = singular[: exact.shape[0]]
    return cosines.clamp(max=1.0)


def principal_sines(cosines: Tensor) -> Tensor:
    """``sin θ_i = √(1 − cos² θ_i)`` of the principal angles, given their cosines."""
    return (1 - cosines.square()).clamp(min=0.0).sqrt()


def step_cosine(exact: Tensor, approx: Tensor) -> float | None:
    """``⟨s, ŝ⟩ / (‖s‖ ‖ŝ‖)`` of two flattened steps ``[D]``.

    Returns:
        The cosine in ``[-1, 1]``; ``None`` where a step is zero.
    """
    norms = exact.norm() * approx.norm()
    if norms == 0:
        return None
    return float((exact @ approx) / norms)
