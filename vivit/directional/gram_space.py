"""Directional derivatives and Newton steps from Gram-space quantities.

``docs/math.rst``, "Directional derivatives and curvature noise", "Damped Newton step
in the eigenspace", "Trust region of a Newton step". ``gram_evecs`` ``[N·C, K]``,
``evals`` ``[K]`` (``λ_k > 0``); ``dampings`` ``[K]``, ``δ_k ≥ 0`` (``inf``: skipped).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vivit.directional.results import DirectionalDerivatives
from vivit.engines.base import BatchInfo
from vivit.errors import InvalidArgumentError, ZeroStepWarning

#: A damping rule: ``(evals [K], gram_evecs [N·C, K], gammas [N_grad, K],
#: lambdas [N_ggn, K]) → δ [K]`` (``inf`` skips a direction).
Damping = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
#: Bisection steps of :func:`trust_region_dampings` (``2⁻⁶⁰`` relative accuracy).
_BISECTION_STEPS = 60


def directional_gradients(
    vt_grads: Tensor, gram_evecs: Tensor, evals: Tensor
) -> Tensor:
    """``γ_nk = ẽ_kᵀ (Vᵀ ∇ℓ_n) / √λ_k``, ``[N_grad, K]``, from ``[N·C, N_grad]``."""
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


def predicted_decrease(
    evals: Tensor, gamma_bar: Tensor, dampings: Tensor, lr: float = 1.0
) -> Tensor:
    """Decrease ``d_k``, ``[K]``, of the GGN's model for ``lr · Δθ`` (0 if skipped)."""
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


def damped_step_sizes(
    directions: Tensor,
    directional: DirectionalDerivatives,
    damping: float | Damping,
    *,
    lr: float = 1.0,
    max_decrease: float | None = None,
    stacklevel: int = 4,
) -> tuple[Tensor, Tensor]:
    """The dampings ``[K]`` of a damped Newton step and its step sizes ``lr·t_k``.

    ``t_k = −γ̄_k / (λ_k + δ_k)``. ``directions`` (Gram eigenvectors ``[N·C, K]``,
    ``[D, K]`` on the implicit route) go to a :data:`Damping` rule; ``max_decrease``
    bounds the model's predicted decrease (:func:`trust_region_dampings`). Warns
    (:class:`~vivit.errors.ZeroStepWarning`, at ``stacklevel``) if no direction
    contributes. The front door checked ``damping``, ``lr`` and ``max_decrease``.

    Raises:
        InvalidArgumentError: If a rule's dampings are not one ``δ_k ≥ 0`` (or
            ``inf``) per direction.
    """
    evals, gamma_bar = directional.evals, directional.gamma_bar
    if not callable(damping):
        dampings = torch.full_like(evals, float(damping))
    elif evals.numel() > 0:
        dampings = damping(evals, directions, directional.gammas, directional.lambdas)
    else:  # no direction: nothing for the rule to choose
        dampings = evals.new_empty(0)
    dampings = torch.as_tensor(dampings, dtype=evals.dtype, device=evals.device)
    if dampings.shape != evals.shape:
        raise InvalidArgumentError(
            f"The damping returned shape {tuple(dampings.shape)}, expected one value "
            f"per direction, {tuple(evals.shape)}."
        )
    if torch.isnan(dampings).any() or (dampings < 0).any():
        raise InvalidArgumentError(
            f"Dampings must be >= 0 (inf skips a direction), got {dampings}."
        )
    if max_decrease is not None:
        dampings = trust_region_dampings(evals, gamma_bar, dampings, lr, max_decrease)
    skipped = torch.isinf(dampings)
    sizes = lr * torch.where(skipped, 0.0, -gamma_bar / (evals + dampings))
    if evals.numel() == 0:
        reason = (
            "the GGN has no numerically non-zero eigenvalue (e.g. a saturated "
            "softmax: the loss has no curvature on this batch)"
        )
    elif skipped.all():
        reason = (
            f"the damping skipped all {evals.numel()} directions (no reliable "
            "predicted decrease, or a trust region around a loss of 0)"
        )
    elif (gamma_bar[~skipped] == 0).all():
        reason = "the gradient has no component along the kept directions"
    else:
        return dampings, sizes
    warnings.warn(
        f"The Newton step is zero: {reason}.", ZeroStepWarning, stacklevel=stacklevel
    )
    return dampings, sizes


def newton_coefficients_damped(
    gram_evecs: Tensor,
    directional: DirectionalDerivatives,
    damping: float | Damping,
    *,
    lr: float = 1.0,
    max_decrease: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The dampings and ``u``, ``[N·C]``, with ``lr·Δθ = V u``.

    Arguments and errors as for :func:`damped_step_sizes`.
    """
    dampings, sizes = damped_step_sizes(
        gram_evecs, directional, damping, lr=lr, max_decrease=max_decrease, stacklevel=5
    )
    return dampings, gram_evecs @ (sizes / directional.evals.sqrt())
