"""Eigendecomposition of the Gram matrix and the map back to parameter space.

``G = V Vᵀ`` and ``G̃ = Vᵀ V`` share their non-zero eigenvalues; an eigenvector
``ẽ_k`` of ``G̃`` with eigenvalue ``λ_k > 0`` gives ``e_k = V ẽ_k / √λ_k``
(``docs/math.rst``).
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
    """Run a LAPACK decomposition; retry in float64 if float32 fails to converge.

    LAPACK's float32 solver can fail on Gram matrices with large clusters of
    (numerically) zero eigenvalues; the float64 result is cast back.
    """
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
    """Eigenpairs of a symmetric Gram matrix.

    Args:
        gram: ``[R, R]`` symmetric positive semi-definite matrix.

    Returns:
        Eigenvalues ``[R]`` in ascending order and orthonormal eigenvectors as the
        columns of an ``[R, R]`` matrix.
    """
    return _with_float64_fallback(torch.linalg.eigh, gram)


def gram_eigvalsh(gram: Tensor) -> Tensor:
    """Eigenvalues of a symmetric Gram matrix.

    Args:
        gram: ``[R, R]`` symmetric positive semi-definite matrix.

    Returns:
        Eigenvalues ``[R]`` in ascending order.
    """
    return _with_float64_fallback(torch.linalg.eigvalsh, gram)


def gram_eigh_top(gram: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The ``top_k`` leading eigenpairs of a symmetric Gram matrix, exactly.

    On the CPU, a request for few eigenpairs runs LAPACK's MRRR solver
    (``scipy.linalg.eigh(..., subset_by_index=..., driver="evr")``) for those
    alone: as accurate as the full decomposition, without forming every
    eigenvector (measured 2.8x faster for the top 10 of a 5120 x 5120 Gram).
    Otherwise it slices the full decomposition.

    Args:
        gram: ``[R, R]`` symmetric positive semi-definite matrix.
        top_k: Number of leading eigenpairs.

    Returns:
        The ``min(top_k, R)`` largest eigenvalues, ascending, and their
        eigenvectors as columns of an ``[R, min(top_k, R)]`` matrix.
    """
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

    ``N·C · ε_gram · λ_max + ε_factors² · tr(G̃)``. The first term is the
    convention of ``torch.linalg.matrix_rank`` (largest eigenvalue times matrix
    size times the machine epsilon of the Gram matrix's dtype): the rounding error
    of accumulating and decomposing the Gram matrix. The second bounds the
    eigenvalue that rounding the factors of ``V`` to ``ε_factors`` can fake where
    the exact one is zero, ``‖δV‖₂² ≤ ε_factors² ‖V‖_F²``; it matters only when the
    Gram matrix is accumulated in a wider type than the factors
    (``docs/math.rst``, "Precision and the numerical zero").

    Args:
        evals: Eigenvalues of the Gram matrix, the largest among them; their
            dtype is the Gram matrix's.
        size: Side length of the Gram matrix (default: ``evals.numel()``, for
            when ``evals`` holds all eigenvalues).
        factor_dtype: Type the factors of ``V`` were computed in (default: that
            of ``evals``).
        trace: ``tr(G̃)`` (default: ``Σ|λ|`` if ``evals`` holds all eigenvalues,
            else its upper bound ``size · λ_max``).

    Returns:
        The tolerance.
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

    ``(r + ρ)·θ_max``: the residual bound of the pairs against the exact
    operator. A Ritz pair ``(θ, u)`` of a symmetric ``G`` has an eigenvalue of
    ``G`` within ``‖G u − θ u‖`` of ``θ``; the solver reached the residual
    ``r·θ_max`` on the computed images (``r`` at most its tolerance), and the
    exact images differ from them by one evaluation's rounding, at most
    ``ρ·θ_max`` (``docs/math.rst``, "Precision and the numerical zero",
    "Without the Gram matrix: the residual bound"). The iterative solver
    measures ``ρ`` at every confirmation.

    Args:
        evals: The Ritz values, the largest among them.
        residual: The largest relative residual of the pairs, ``r``
            (:attr:`~vivit.linalg.iterative.SolverReport.residual`).
        rounding: The products' measured rounding relative to ``θ_max``
            (:attr:`~vivit.linalg.iterative.SolverReport.rounding`).

    Returns:
        The tolerance.
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
    """Indices of the ``top_k`` largest numerically non-zero eigenvalues.

    Args:
        evals: Ascending eigenvalues of the Gram matrix (all, or the largest).
        top_k: How many to keep; ``None`` keeps every eigenvalue above the
            numerical-zero tolerance.
        size: Side length of the Gram matrix (default: ``evals.numel()``).
        factor_dtype: Type the factors of ``V`` were computed in (see
            :func:`numerical_zero_tolerance`).
        trace: ``tr(G̃)`` (see :func:`numerical_zero_tolerance`).
        tolerance: The numerical-zero tolerance, where it is not the Gram
            matrix's (:func:`residual_zero_tolerance`; ``None``:
            :func:`numerical_zero_tolerance` of the other arguments).

    Returns:
        Indices into ``evals``, ascending.

    Raises:
        ValueError: If ``top_k`` is not a positive integer.
    """
    check_top_k(top_k)
    if tolerance is None:
        tolerance = numerical_zero_tolerance(evals, size, factor_dtype, trace)
    nonzero = [i for i, value in enumerate(evals.tolist()) if value > tolerance]
    return nonzero if top_k is None else nonzero[-top_k:]


def check_top_k(top_k: int | None) -> None:
    """Check that ``top_k`` is ``None`` or a positive integer.

    Args:
        top_k: Number of leading eigenpairs.

    Raises:
        InvalidArgumentError: If it is neither.
    """
    check_positive_int(top_k, "top_k", none="every non-zero eigenpair")


#: Types the Gram matrix may be accumulated in (LAPACK's real symmetric solvers).
GRAM_DTYPES = (torch.float32, torch.float64)


def check_gram_dtype(gram_dtype: torch.dtype | None) -> None:
    """Check that ``gram_dtype`` is ``None``, ``torch.float32`` or ``torch.float64``.

    Args:
        gram_dtype: Requested type of the Gram matrix and its products.

    Raises:
        ValueError: If it is anything else.
    """
    if gram_dtype is not None and gram_dtype not in GRAM_DTYPES:
        raise InvalidArgumentError(
            f"gram_dtype must be None (the model's dtype), torch.float32 or "
            f"torch.float64, got {gram_dtype!r}. Use torch.float64 to resolve the "
            "small eigenvalues of a float32 model."
        )


def direction_coefficients(
    gram_evecs: Tensor, evals: Tensor, tolerance: float = 0.0
) -> Tensor:
    """Gram-space coefficients ``ẽ_k / √λ_k`` of the directions ``e_k = V ẽ_k / √λ_k``.

    A direction whose eigenvalue is at or below ``tolerance`` (numerically zero,
    or negative through rounding) is not resolvable: ``V ẽ_k`` is rounding noise
    and dividing it by ``√λ_k`` amplifies that noise without bound. It gets
    coefficients zero, i.e. the zero vector as its direction (``docs/math.rst``,
    "The Gram matrix and exact eigenpairs").

    Args:
        gram_evecs: Gram eigenvectors as columns, ``[N·C, K]``.
        evals: Their eigenvalues, ``[K]``, as computed.
        tolerance: Eigenvalues at or below it give zero coefficients (at least
            ``0``; usually :func:`numerical_zero_tolerance`).

    Returns:
        ``[N·C, K]``, finite.
    """
    resolved = evals > max(tolerance, 0.0)
    inverse_roots = torch.where(resolved, evals, 1.0).rsqrt() * resolved
    return gram_evecs * inverse_roots


def gram_to_param(
    factors: Sequence[ParamFactors],
    gram_evecs: Tensor,
    evals: Tensor,
    tolerance: float = 0.0,
) -> list[Tensor]:
    """Map Gram-space eigenvectors to normalized GGN eigenvectors, ``V ẽ_k / √λ_k``.

    Args:
        factors: Factors of ``V``, one per parameter of the group.
        gram_evecs: Gram eigenvectors as columns, ``[N·C, K]``.
        evals: Their eigenvalues, ``[K]``.
        tolerance: Eigenvalues at or below it are numerically zero; their
            eigenvectors are zero vectors (see :func:`direction_coefficients`).

    Returns:
        One tensor ``[K, *p.shape]`` per parameter, in the factors' dtype.
    """
    coefficients = direction_coefficients(gram_evecs, evals, tolerance).T
    return v_matmul(factors, coefficients)
