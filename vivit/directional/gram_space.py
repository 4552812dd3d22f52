"""Directional derivatives and Newton steps from Gram-space quantities.

Every formula here is one of ``docs/math.rst`` ("Directional derivatives",
"Damped Newton step"); none of them forms a per-sample gradient or a column of
``V`` in parameter space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vivit._validation import check_damping
from vivit.directional.results import DirectionalDerivatives, NewtonStep
from vivit.engines.base import BatchInfo
from vivit.gram import ParamFactors

#: A damping rule: ``(evals [K], gram_evecs [N·C, K], gammas [N_grad, K],
#: lambdas [N_ggn, K]) → δ [K]`` (``inf`` skips a direction).
Damping = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def directional_gradients(
    vt_grads: Tensor, gram_evecs: Tensor, evals: Tensor
) -> Tensor:
    """``γ_nk = ẽ_kᵀ (Vᵀ ∇ℓ_n) / √λ_k``.

    Args:
        vt_grads: ``Vᵀ∇ℓ_n`` for the gradient samples, ``[N·C, N_grad]``.
        gram_evecs: Gram eigenvectors of the directions, ``[N·C, K]``.
        evals: Their eigenvalues, ``[K]``.

    Returns:
        ``γ``, shape ``[N_grad, K]``.
    """
    return (vt_grads.T @ gram_evecs) / evals.sqrt()


def directional_curvatures(
    gram_evecs: Tensor, evals: Tensor, batch: BatchInfo
) -> Tensor:
    """``λ_nk = (λ_k / R) ‖ẽ_k[(n, ·)]‖²`` for the samples of the Gram matrix.

    Args:
        gram_evecs: Gram eigenvectors of the directions, ``[N·C, K]``.
        evals: Their eigenvalues, ``[K]``.
        batch: Batch context; gives ``R`` of the GGN samples and ``C``.

    Returns:
        ``λ``, shape ``[N_ggn, K]``.
    """
    num_samples = len(batch.ggn_samples)
    per_sample = gram_evecs.reshape(num_samples, batch.columns_per_sample, -1)
    return per_sample.pow(2).sum(1) * evals / batch.ggn_reduction_factor


def batch_directional_gradient(
    gammas: Tensor, batch: BatchInfo, grad_samples: Sequence[int] | None = None
) -> Tensor:
    """``γ̄_k = R Σ_n γ_nk``: directional gradient of the loss on the gradient samples.

    Args:
        gammas: Per-sample directional gradients, ``[N_grad, K]``.
        batch: Batch context (gives ``R`` of the loss on the gradient samples).
        grad_samples: The gradient samples (``None``: the whole mini-batch).

    Returns:
        ``γ̄``, shape ``[K]``.
    """
    return batch.reduction_factor(grad_samples) * gammas.sum(0)


def directional_derivatives(
    vt_grads: Tensor,
    gram_evecs: Tensor,
    evals: Tensor,
    batch: BatchInfo,
    grad_samples: Sequence[int] | None = None,
) -> DirectionalDerivatives:
    """``γ``, ``λ`` and ``γ̄`` along the directions given by Gram eigenpairs.

    Args:
        vt_grads: ``Vᵀ∇ℓ_n`` for the gradient samples, ``[N·C, N_grad]``.
        gram_evecs: Gram eigenvectors of the directions, ``[N·C, K]``.
        evals: Their eigenvalues, ``[K]``.
        batch: Batch context of the Gram matrix.
        grad_samples: The gradient samples (``None``: the whole mini-batch).

    Returns:
        The directional derivatives.
    """
    gammas = directional_gradients(vt_grads, gram_evecs, evals)
    return DirectionalDerivatives(
        evals=evals,
        gammas=gammas,
        lambdas=directional_curvatures(gram_evecs, evals, batch),
        gamma_bar=batch_directional_gradient(gammas, batch, grad_samples),
    )


def newton_coefficients(
    gram_evecs: Tensor, evals: Tensor, gamma_bar: Tensor, dampings: Tensor
) -> Tensor:
    """Gram-space vector ``u`` with ``Δθ = V u`` the damped Newton step.

    ``u = −Σ_k γ̄_k / ((λ_k + δ_k) √λ_k) ẽ_k``; a direction with ``δ_k = ∞`` gets no
    step.

    Args:
        gram_evecs: Gram eigenvectors of the directions, ``[N·C, K]``.
        evals: Their eigenvalues ``λ_k > 0``, ``[K]``.
        gamma_bar: Batch directional gradients, ``[K]``.
        dampings: ``δ_k ≥ 0`` (``inf`` to skip), ``[K]``.

    Returns:
        ``u``, shape ``[N·C]``.

    Raises:
        ValueError: If a damping is negative or NaN, or has the wrong shape.
    """
    if dampings.shape != evals.shape:
        raise ValueError(
            f"The damping returned shape {tuple(dampings.shape)}, expected one value "
            f"per direction, {tuple(evals.shape)}."
        )
    if torch.isnan(dampings).any() or (dampings < 0).any():
        raise ValueError(
            f"Dampings must be >= 0 (inf skips a direction), got {dampings}."
        )
    step_sizes = torch.where(
        torch.isinf(dampings), torch.zeros_like(evals), -gamma_bar / (evals + dampings)
    )
    return gram_evecs @ (step_sizes / evals.sqrt())


def damped_newton_step(
    factors: Sequence[ParamFactors],
    gram_evecs: Tensor,
    directional: DirectionalDerivatives,
    damping: float | Damping,
) -> NewtonStep:
    """The damped Newton step in parameter space, with one product with ``V``.

    Args:
        factors: Factors of ``V``, one per parameter of the group.
        gram_evecs: Gram eigenvectors of the directions, ``[N·C, K]``.
        directional: Eigenvalues, ``γ``, ``λ`` and ``γ̄`` of the directions.
        damping: A constant ``δ ≥ 0`` or a :data:`Damping` rule.

    Returns:
        The step with the quantities that define it.
    """
    check_damping(damping)
    evals = directional.evals
    if callable(damping):
        dampings = damping(evals, gram_evecs, directional.gammas, directional.lambdas)
    else:
        dampings = torch.full_like(evals, float(damping))
    dampings = torch.as_tensor(dampings, dtype=evals.dtype, device=evals.device)
    u = newton_coefficients(gram_evecs, evals, directional.gamma_bar, dampings)
    return NewtonStep(
        directional=directional,
        dampings=dampings,
        step=[f.vmp(u.unsqueeze(0)).squeeze(0) for f in factors],
    )
