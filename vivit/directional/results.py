"""Results along GGN eigendirections: derivatives, their noise, Newton steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vivit.errors import InvalidSubsamplingError


def _variance(samples: Tensor, name: str, argument: str) -> Tensor:
    """Unbiased variance over the samples (axis 0); ``argument`` selects them."""
    if samples.shape[0] < 2:
        raise InvalidSubsamplingError(
            f"The variance of {name} needs at least two samples, got "
            f"{samples.shape[0]}: use a mini-batch of two samples or more and pass "
            f"{argument} with at least two indices (or None for all)."
        )
    return samples.var(0, correction=1)


def _snr(mean: Tensor, variance: Tensor) -> Tensor:
    """``mean² / variance``; ``inf`` if the variance is 0, ``0`` if the mean is too."""
    snr = mean.pow(2) / variance
    return torch.where(variance == 0, torch.where(mean == 0, 0.0, torch.inf), snr)


@dataclass(frozen=True)
class DirectionalDerivatives:
    """First and second directional derivatives along GGN eigenvectors.

    Directions ``k`` ascend with the eigenvalues. Variances and signal-to-noise
    ratios raise :class:`~vivit.InvalidSubsamplingError` for fewer than two samples.

    Attributes:
        evals: GGN eigenvalues ``λ_k`` of the directions, ``[K]``.
        gammas: ``γ_nk = e_kᵀ ∇ℓ_n`` of the gradient samples, ``[N_grad, K]``.
        lambdas: ``λ_nk = e_kᵀ G_n e_k`` of the GGN samples, ``[N_ggn, K]``.
        gamma_bar: ``γ̄_k = R Σ_n γ_nk``, the loss's directional gradient on the
            gradient samples (``R``: the loss's reduction), ``[K]``.
    """

    evals: Tensor
    gammas: Tensor
    lambdas: Tensor
    gamma_bar: Tensor

    @property
    def gamma_mean(self) -> Tensor:
        """Sample mean of ``γ_·k``, ``[K]``."""
        return self.gammas.mean(0)

    @property
    def gamma_var(self) -> Tensor:
        """Unbiased sample variance (``ddof=1``) of ``γ_·k``, ``[K]``."""
        return _variance(self.gammas, "gammas", "subsampling_grad")

    @property
    def gamma_snr(self) -> Tensor:
        """Signal-to-noise ratio ``mean² / variance`` of ``γ_·k``, ``[K]``."""
        return _snr(self.gamma_mean, self.gamma_var)

    @property
    def lambda_mean(self) -> Tensor:
        """Sample mean of ``λ_·k``, ``[K]``."""
        return self.lambdas.mean(0)

    @property
    def lambda_var(self) -> Tensor:
        """Unbiased sample variance (``ddof=1``) of ``λ_·k``, ``[K]``."""
        return _variance(self.lambdas, "lambdas", "subsampling")

    @property
    def lambda_snr(self) -> Tensor:
        """Signal-to-noise ratio ``mean² / variance`` of ``λ_·k``, ``[K]``."""
        return _snr(self.lambda_mean, self.lambda_var)


@dataclass(frozen=True)
class NewtonStep:
    """A directionally damped Newton step ``Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k``.

    Attributes:
        directional: Eigenvalues, per-sample ``γ``, ``λ`` and ``γ̄`` of the directions.
        dampings: ``δ_k`` as used, after any trust region (``inf``: skipped), ``[K]``.
        step: The step ``lr · Δθ``, one tensor per parameter, shaped like it.
    """

    directional: DirectionalDerivatives
    dampings: Tensor
    step: list[Tensor]

    @property
    def gamma_bar(self) -> Tensor:
        """Batch directional gradients ``γ̄_k``, ``[K]``."""
        return self.directional.gamma_bar
