"""The report of a Gram eigensolve; the iterative solvers' ``tol`` and ``seed``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vivit._validation import _is_int, _is_number
from vivit.errors import InvalidArgumentError


def default_tolerance(dtype: torch.dtype) -> float:
    """The default relative residual bound, ``max(100·ε, 1e-12)``: above rounding."""
    return max(100 * torch.finfo(dtype).eps, 1e-12)


@dataclass(frozen=True)
class SolverReport:
    """How the leading eigenpairs of a Gram matrix were computed.

    For the dense solver ``cycles`` and ``products`` are ``0``, ``tolerance`` and
    the fields after ``fallback`` ``None``.

    Attributes:
        solver: ``"dense"``, ``"gram_krylov"`` (on the Gram matrix) or
            ``"factor_krylov"`` (on products with ``V``).
        requested: The solver asked for (``"auto"`` or one of the above).
        residual: Largest relative residual ``‖G̃ ũ − λ ũ‖ / λ_max`` of the returned
            pairs, from fresh products (``None`` for a full decomposition).
        tolerance: The bound the pairs satisfy: the requested one, or
            ``2·rounding`` where that is larger.
        converged: Whether ``residual ≤ tolerance`` (always ``True`` for dense).
        cycles: Krylov cycles run.
        products: Vectors the operator was multiplied onto (all solves).
        fallback: Why another solver than the requested one ran, or ``None``.
        rounding: The products' measured rounding ``ρ``, relative to ``θ_max``.
        requested_tolerance: The bound asked for.
        basis_columns: Columns of a cycle's Krylov basis.
        basis_cut: Why the basis holds fewer columns than its default.
        block_size: Block size ``b`` of the solve that returned the pairs.
        widened: Why a block narrower than ``top_k`` was widened
            (:func:`~vivit.linalg.iterative.narrow_block_doubt`).
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
    """Check a relative residual bound (``name`` in the message).

    Raises:
        InvalidArgumentError: Unless ``None`` or a number in ``(0, 1)``.
    """
    if tol is not None and not (_is_number(tol) and 0 < tol < 1):
        raise InvalidArgumentError(
            f"{name} must be a number in (0, 1) or None, got {tol!r}: the relative "
            "residual bound of the eigenpairs, e.g. 1e-6 (None: the data type's "
            "default)."
        )


def check_seed(seed: object, name: str = "seed") -> None:
    """Check a start block's seed (``name`` in the message).

    Raises:
        InvalidArgumentError: Unless an integer in ``[-2⁶³, 2⁶⁴)`` (torch's seeds).
    """
    if not (_is_int(seed) and -(2**63) <= seed < 2**64):
        raise InvalidArgumentError(
            f"{name} must be an integer in [-2**63, 2**64), got {seed!r}."
        )
