"""Directional derivatives and Newton steps from Gram-space quantities.

The formulas of ``docs/math.rst``, "Directional derivatives and curvature noise",
"Damped Newton step in the eigenspace" and "Trust region of a Newton step".
Arguments: ``gram_evecs`` ``[N·C, K]``, the Gram eigenvectors of the directions;
``evals`` ``[K]``, their eigenvalues ``λ_k > 0``; ``vt_grads`` ``[N·C, N_grad]``,
``Vᵀ∇ℓ_n`` of the gradient samples ``grad_samples`` (``None``: the mini-batch);
``batch``, the Gram matrix's :class:`~vivit.engines.base.BatchInfo` (``R``,
``C``); ``gamma_bar`` ``[K]``, ``γ̄_k``; ``dampings`` ``[K]``, ``δ_k ≥ 0`` (``inf``
skips a direction: no step); ``lr``, the scale of the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vivit._validation import check_damping, check_lr, check_max_decrease
from vivit.directional.results import DirectionalDerivatives, NewtonStep
from vivit.engines.base import BatchInfo
from vivit.errors import InvalidArgumentError, ZeroStepWarning
from vivit.gram import ParamFactors
from vivit.linalg.group_products import v_matmul

#: A damping rule: ``(evals [K], gram_evecs [N·C, K], gammas [N_grad, K],
#: lambdas [N_ggn, K]) → δ [K]`` (``inf`` skips a direction).
Damping = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def directional_gradients(
    vt_grads: Tensor, gram_evecs: Tensor, evals: Tensor
) -> Tensor:
    """``γ_nk = ẽ_kᵀ (Vᵀ ∇ℓ_n) / √λ_k``, ``[N_grad, K]``."""
    return (vt_grads.T @ gram_evecs) / evals.sqrt()


def directional_curvatures(
    gram_evecs: Tensor, evals: Tensor, batch: BatchInfo
) -> Tensor:
    """``λ_nk = (λ_k / R) ‖ẽ_k[(n, ·)]‖²``, ``[N_ggn, K]``, of the Gram's samples."""
    num_samples = len(batch.ggn_samples)
    per_sample = gram_evecs.reshape(num_samples, batch.columns_per_sample, -1)
    return per_sample.pow(2).sum(1) * evals / batch.ggn_reduction_factor


def batch_directional_gradient(
    gammas: Tensor, batch: BatchInfo, grad_samples: Sequence[int] | None = None
) -> Tensor:
    """``γ̄_k = R Σ_n γ_nk``, ``[K]``, of ``gammas`` ``[N_grad, K]``."""
    return batch.reduction_factor(grad_samples) * gammas.sum(0)


def directional_derivatives(
    vt_grads: Tensor,
    gram_evecs: Tensor,
    evals: Tensor,
    batch: BatchInfo,
    grad_samples: Sequence[int] | None = None,
) -> DirectionalDerivatives:
    """``γ``, ``λ`` and ``γ̄`` along the directions given by Gram eigenpairs."""
    gammas = directional_gradients(vt_grads, gram_evecs, evals)
    return DirectionalDerivatives(
        evals=evals,
        gammas=gammas,
        lambdas=directional_curvatures(gram_evecs, evals, batch),
        gamma_bar=batch_directional_gradient(gammas, batch, grad_samples),
    )


def check_dampings(dampings: Tensor, evals: Tensor) -> None:
    """Check that a damping rule returned one ``δ_k ≥ 0`` (or ``inf``) per direction.

    Raises:
        InvalidArgumentError: If the shape is wrong or a damping is negative or NaN.
    """
    if dampings.shape != evals.shape:
        raise InvalidArgumentError(
            f"The damping returned shape {tuple(dampings.shape)}, expected one value "
            f"per direction, {tuple(evals.shape)}."
        )
    if torch.isnan(dampings).any() or (dampings < 0).any():
        raise InvalidArgumentError(
            f"Dampings must be >= 0 (inf skips a direction), got {dampings}."
        )


def newton_step_sizes(evals: Tensor, gamma_bar: Tensor, dampings: Tensor) -> Tensor:
    """``t_k = −γ̄_k / (λ_k + δ_k)``, ``[K]``, the step along each direction.

    Raises:
        InvalidArgumentError: As :func:`check_dampings`.
    """
    check_dampings(dampings, evals)
    return torch.where(
        torch.isinf(dampings), torch.zeros_like(evals), -gamma_bar / (evals + dampings)
    )


def newton_coefficients(
    gram_evecs: Tensor, evals: Tensor, gamma_bar: Tensor, dampings: Tensor
) -> Tensor:
    """Gram-space vector ``u``, ``[N·C]``, with ``Δθ = V u`` the damped Newton step.

    Raises:
        InvalidArgumentError: As :func:`check_dampings`.
    """
    return gram_evecs @ (newton_step_sizes(evals, gamma_bar, dampings) / evals.sqrt())


def predicted_decrease(
    evals: Tensor, gamma_bar: Tensor, dampings: Tensor, lr: float = 1.0
) -> Tensor:
    """Decrease ``d_k``, ``[K]``, of the GGN's quadratic model along each direction.

    Of the step ``lr · Δθ``; ``0`` for a skipped direction.
    """
    gain = lr / (evals + dampings)
    decrease = gamma_bar.pow(2) * gain * (1 - 0.5 * evals * gain)
    return torch.where(torch.isinf(dampings), torch.zeros_like(decrease), decrease)


def trust_region_dampings(
    evals: Tensor, gamma_bar: Tensor, dampings: Tensor, lr: float, max_decrease: float
) -> Tensor:
    """Dampings for which the GGN's quadratic model vouches for the step ``lr · Δθ``.

    No overshoot (``δ_k ≥ (lr − 1) λ_k``), then the smallest ``μ`` added to every
    damping that brings the predicted decrease down to ``max_decrease`` (``≤ 0``:
    every direction skipped); ``inf`` stays ``inf``.
    """
    dampings = torch.maximum(dampings, (lr - 1.0) * evals)

    def decrease(mu: float) -> float:
        return float(predicted_decrease(evals, gamma_bar, dampings + mu, lr).sum())

    if decrease(0.0) <= max_decrease:
        return dampings
    if max_decrease <= 0:
        return torch.full_like(dampings, torch.inf)
    # The decrease is below lr Σ γ̄² / μ, so ``high`` is feasible: bisect [0, high].
    low, high = 0.0, lr * float(gamma_bar.pow(2).sum()) / max_decrease
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if decrease(middle) > max_decrease else (low, middle)
    return dampings + high


#: Bisection steps of :func:`trust_region_dampings` (``2⁻⁶⁰`` relative accuracy).
_BISECTION_STEPS = 60


def damped_step_sizes(
    directions: Tensor,
    directional: DirectionalDerivatives,
    damping: float | Damping,
    *,
    lr: float = 1.0,
    max_decrease: float | None = None,
    stacklevel: int = 4,
) -> tuple[Tensor, Tensor]:
    """The dampings of a damped Newton step and its step sizes ``lr·t_k``.

    With ``max_decrease`` the rule's dampings are raised by
    :func:`trust_region_dampings`. Warns with
    :class:`~vivit.errors.ZeroStepWarning` if no direction contributes.

    Args:
        directions: The directions' coordinates handed to a :data:`Damping`
            rule: Gram eigenvectors ``[N·C, K]`` (parameter-space eigenvectors
            ``[D, K]`` on the implicit route).
        directional: Eigenvalues, ``γ``, ``λ`` and ``γ̄`` of the directions.
        damping: A constant ``δ ≥ 0`` or a :data:`Damping` rule.
        lr: Scale of the step.
        max_decrease: Largest decrease of the loss the GGN's quadratic model may
            predict for the step (``None``: no bound).
        stacklevel: Of the warning (the caller's caller by default).

    Returns:
        The dampings used, ``[K]``, and ``lr · t``, ``[K]``.

    Raises:
        InvalidArgumentError: If ``lr`` is not a positive finite number,
            ``max_decrease`` not ``None`` or a number ``≥ 0``, or a damping is
            invalid.
    """
    check_damping(damping)
    check_lr(lr)
    check_max_decrease(max_decrease)
    evals = directional.evals
    if evals.numel() > 0 and callable(damping):
        dampings = damping(evals, directions, directional.gammas, directional.lambdas)
    elif callable(damping):  # no direction: nothing for the rule to choose
        dampings = evals.new_empty(0)
    else:
        dampings = torch.full_like(evals, float(damping))
    dampings = torch.as_tensor(dampings, dtype=evals.dtype, device=evals.device)
    check_dampings(dampings, evals)
    if max_decrease is not None:
        dampings = trust_region_dampings(
            evals, directional.gamma_bar, dampings, lr, max_decrease
        )
    sizes = lr * newton_step_sizes(evals, directional.gamma_bar, dampings)
    warn_if_zero_step(evals, directional.gamma_bar, dampings, stacklevel=stacklevel)
    return dampings, sizes


def newton_coefficients_damped(
    gram_evecs: Tensor,
    directional: DirectionalDerivatives,
    damping: float | Damping,
    *,
    lr: float = 1.0,
    max_decrease: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The dampings of a damped Newton step and ``u``, ``[N·C]``, with ``lr·Δθ = V u``.

    Arguments as for :func:`damped_step_sizes`.

    Raises:
        InvalidArgumentError: As :func:`damped_step_sizes`.
    """
    dampings, sizes = damped_step_sizes(
        gram_evecs,
        directional,
        damping,
        lr=lr,
        max_decrease=max_decrease,
        stacklevel=5,
    )
    return dampings, gram_evecs @ (sizes / directional.evals.sqrt())


def damped_newton_step(
    factors: Sequence[ParamFactors],
    gram_evecs: Tensor,
    directional: DirectionalDerivatives,
    damping: float | Damping,
    *,
    lr: float = 1.0,
    max_decrease: float | None = None,
) -> NewtonStep:
    """The damped Newton step ``lr · Δθ`` in parameter space, one product with ``V``.

    Arguments as for :func:`damped_step_sizes`; ``factors`` has one entry per
    parameter. A step to which no direction contributes is zero and warns with
    :class:`~vivit.errors.ZeroStepWarning`.

    Raises:
        InvalidArgumentError: As :func:`damped_step_sizes`.
    """
    dampings, u = newton_coefficients_damped(
        gram_evecs, directional, damping, lr=lr, max_decrease=max_decrease
    )
    return NewtonStep(
        directional=directional,
        dampings=dampings,
        step=[s.squeeze(0) for s in v_matmul(factors, u.unsqueeze(0))],
    )


def warn_if_zero_step(
    evals: Tensor, gamma_bar: Tensor, dampings: Tensor, stacklevel: int = 3
) -> None:
    """Warn that a Newton step is zero, and why, if no direction contributes to it."""
    if evals.numel() == 0:
        reason = (
            "the GGN has no numerically non-zero eigenvalue (e.g. a saturated "
            "softmax: the loss has no curvature on this batch)"
        )
    elif torch.isinf(dampings).all():
        reason = (
            f"the damping skipped all {evals.numel()} directions (no reliable "
            "predicted decrease, or a trust region around a loss of 0)"
        )
    elif (gamma_bar[~torch.isinf(dampings)] == 0).all():
        reason = "the gradient has no component along the kept directions"
    else:
        return
    warnings.warn(
        f"The Newton step is zero: {reason}.", ZeroStepWarning, stacklevel=stacklevel
    )
