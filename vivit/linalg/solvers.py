"""Dense eigendecomposition of the Gram matrix, its numerical zero, and the map back.

``e_k = V ẽ_k / √λ_k`` (``docs/math.rst``, "The Gram matrix and exact eigenpairs");
``evals`` ascending, ``gram_evecs`` ``[N·C, K]`` columns, ``factors`` one per parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy
import scipy.linalg
import torch
from torch import Tensor

from vivit._validation import check_positive_int
from vivit.errors import InvalidArgumentError
from vivit.gram import ParamFactors
from vivit.gram.memory import uses_subset_solver
from vivit.linalg.group_products import v_matmul


def _with_float64_fallback(decompose: Callable, gram: Tensor):
    """Run a LAPACK decomposition; retry in float64 (cast back) where float32 fails."""
    try:
        return decompose(gram)
    except (torch.linalg.LinAlgError, numpy.linalg.LinAlgError):
        if gram.dtype == torch.float64:
            raise
        result = decompose(gram.to(torch.float64))
        if isinstance(result, Tensor):
            return result.to(gram.dtype)
        return tuple(t.to(gram.dtype) for t in result)


def gram_eigh(gram: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues ``[R]`` (ascending) and eigenvectors (columns) of a Gram matrix."""
    return _with_float64_fallback(torch.linalg.eigh, gram)


def gram_eigvalsh(gram: Tensor) -> Tensor:
    """Eigenvalues ``[R]``, ascending, of a Gram matrix."""
    return _with_float64_fallback(torch.linalg.eigvalsh, gram)


def gram_eigh_top(gram: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The ``min(top_k, R)`` leading eigenpairs, exactly (alone: uses_subset_solver)."""
    size = gram.shape[0]
    top_k = min(top_k, size)
    if not uses_subset_solver(size, top_k, gram.device):
        evals, evecs = gram_eigh(gram)
        return evals[-top_k:], evecs[:, -top_k:]

    def leading(matrix: Tensor) -> tuple[Tensor, Tensor]:
        evals, evecs = scipy.linalg.eigh(
            matrix.numpy(), subset_by_index=[size - top_k, size - 1], driver="evr"
        )
        return torch.from_numpy(evals), torch.from_numpy(evecs)

    return _with_float64_fallback(leading, gram)


def numerical_zero_tolerance(
    evals: Tensor,
    size: int | None = None,
    factor_dtype: torch.dtype | None = None,
    trace: float | None = None,
) -> float:
    """Eigenvalues at or below this value are numerically zero.

    ``N·C · ε_gram · λ_max + ε_factors² · tr(G̃)``: the rounding of forming and
    decomposing the Gram matrix, and the eigenvalue that rounding the factors can
    fake (``docs/math.rst``, "Precision and the numerical zero").

    Args:
        evals: Eigenvalues of the Gram matrix, the largest among them, in its dtype.
        size: Side length of the Gram matrix (default: ``evals.numel()``).
        factor_dtype: Type of the factors of ``V`` (default: that of ``evals``).
        trace: ``tr(G̃)`` (default: ``Σ|λ|`` of all eigenvalues, else ``size·λ_max``).
    """
    if evals.numel() == 0:
        return 0.0
    size = evals.numel() if size is None else size
    largest = evals.abs().max().item()
    if trace is None:
        trace = evals.abs().sum().item() if evals.numel() == size else size * largest
    factor_eps = torch.finfo(factor_dtype or evals.dtype).eps
    return largest * size * torch.finfo(evals.dtype).eps + factor_eps**2 * trace


def residual_zero_tolerance(evals: Tensor, residual: float, rounding: float) -> float:
    """Ritz values of an operator's eigensolve at or below this may be zero.

    ``(r + ρ)·θ_max`` for the ``residual`` ``r`` and ``rounding`` ``ρ`` of the
    :class:`~vivit.linalg.iterative.SolverReport` (``docs/math.rst``, "Without the
    Gram matrix: the residual bound"); ``evals`` hold the largest Ritz value.
    """
    if evals.numel() == 0:
        return 0.0
    return (residual + rounding) * evals.abs().max().item()


def top_k_indices(
    evals: Tensor,
    top_k: int | None,
    size: int | None = None,
    factor_dtype: torch.dtype | None = None,
    trace: float | None = None,
    *,
    tolerance: float | None = None,
) -> list[int]:
    """Indices of the ``top_k`` (``None``: all) leading non-zero eigenvalues.

    Ascending. Zero: at most ``tolerance``, else :func:`numerical_zero_tolerance`.
    """
    if tolerance is None:
        tolerance = numerical_zero_tolerance(evals, size, factor_dtype, trace)
    nonzero = [i for i, value in enumerate(evals.tolist()) if value > tolerance]
    return nonzero if top_k is None else nonzero[-top_k:]


def check_top_k(top_k: int | None) -> None:
    """Raise :class:`~vivit.errors.InvalidArgumentError` unless ``None`` or ``> 0``."""
    check_positive_int(top_k, "top_k", none="every non-zero eigenpair")


def check_gram_dtype(gram_dtype: torch.dtype | None) -> None:
    """Raise :class:`~vivit.errors.InvalidArgumentError` unless ``None``, float32/64."""
    if gram_dtype not in (None, torch.float32, torch.float64):
        raise InvalidArgumentError(
            f"gram_dtype must be None (the model's dtype), torch.float32 or "
            f"torch.float64, got {gram_dtype!r}. Use torch.float64 to resolve the "
            "small eigenvalues of a float32 model."
        )


def direction_coefficients(
    gram_evecs: Tensor, evals: Tensor, tolerance: float = 0.0
) -> Tensor:
    """Gram coefficients ``ẽ_k / √λ_k``, ``[N·C, K]``; 0 where ``λ_k ≤ tolerance``."""
    resolved = evals > max(tolerance, 0.0)
    inverse_roots = torch.where(resolved, evals, 1.0).rsqrt() * resolved
    return gram_evecs * inverse_roots


def gram_to_param(
    factors: Sequence[ParamFactors],
    gram_evecs: Tensor,
    evals: Tensor,
    tolerance: float = 0.0,
) -> list[Tensor]:
    """GGN eigenvectors ``e_k``, ``[K, *p.shape]`` each, 0 where ``λ_k ≤ tolerance``."""
    coefficients = direction_coefficients(gram_evecs, evals, tolerance).T
    return v_matmul(factors, coefficients)
