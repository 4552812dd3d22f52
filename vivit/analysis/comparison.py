"""How far an approximation's top-k eigenpairs and damped step are from the exact.

The three measures of ``docs/math.rst`` ("Approximation audit"), on float64
tensors: eigenvalue relative errors rank by rank, principal angles between the
top-k eigenspaces, and the cosine between two damped Newton steps.
"""

from __future__ import annotations

import torch
from torch import Tensor


def eigenvalue_errors(exact: Tensor, approx: Tensor) -> Tensor:
    """``|λ̂_i − λ_i| / λ_i`` rank by rank, both sorted descending.

    An approximation with fewer than ``k`` eigenvalues (lower rank) has the
    eigenvalue zero at the missing ranks: relative error ``1`` there.

    Args:
        exact: The exact top-k eigenvalues ``[k]``, descending, positive.
        approx: The approximation's top eigenvalues ``[k' ≤ k]``, descending.

    Returns:
        ``[k]`` relative errors.
    """
    padded = exact.new_zeros(exact.shape)
    padded[: approx.numel()] = approx[: exact.numel()]
    return (padded - exact).abs() / exact


def principal_cosines(exact: Tensor, approx: Tensor) -> Tensor:
    """Cosines of the principal angles between two eigenspaces, descending.

    The singular values ``σ_1 ≥ … ≥ σ_k`` of ``U Ûᵀ`` for orthonormal rows ``U``
    (``[k, D]``) and ``Û`` (``[k', D]``): ``σ_i = cos θ_i``. A space of lower
    dimension ``k' < k`` is orthogonal to ``k − k'`` of the exact directions: those
    cosines are zero.

    Args:
        exact: The exact top-k eigenvectors as orthonormal rows ``[k, D]``.
        approx: The approximation's top eigenvectors as orthonormal rows.

    Returns:
        ``[k]`` cosines in ``[0, 1]``, descending.
    """
    cosines = exact.new_zeros(exact.shape[0])
    if approx.shape[0] > 0:
        singular = torch.linalg.svdvals(exact @ approx.T)
        cosines[: singular.numel()] = singular[: exact.shape[0]]
    return cosines.clamp(max=1.0)


def principal_sines(cosines: Tensor) -> Tensor:
    """``sin θ_i = √(1 − cos² θ_i)`` of the principal angles.

    Args:
        cosines: Cosines of the principal angles, in ``[0, 1]``.

    Returns:
        The sines, ascending where the cosines descend.
    """
    return (1 - cosines.square()).clamp(min=0.0).sqrt()


def step_cosine(exact: Tensor, approx: Tensor) -> float | None:
    """``⟨s, ŝ⟩ / (‖s‖ ‖ŝ‖)`` of two flattened steps.

    Args:
        exact: The exact damped Newton step ``[D]``.
        approx: The approximation's damped Newton step ``[D]``.

    Returns:
        The cosine in ``[-1, 1]``; ``None`` where a step is zero (a zero gradient:
        no direction to compare).
    """
    norms = exact.norm() * approx.norm()
    if norms == 0:
        return None
    return float((exact @ approx) / norms)
