"""Dampings: ``damping(evals [K], gram_evecs [NC, K], gammas, lambdas) -> δ [K]``.

``gammas [N_grad, K]``, ``lambdas [N_ggn, K]``; ``δ_k ≥ 0`` (``inf`` skips the
direction) on the scale of ``evals`` (``docs/math.rst``, "Damped Newton step in
the eigenspace").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vivit.errors import InvalidArgumentError


class ConstantDamping:
    """The same ``damping ≥ 0`` for every direction, on the scale of ``evals``.

    Raises:
        InvalidArgumentError: If ``damping`` is negative or NaN.
    """

    def __init__(self, damping: float = 1.0):
        if not damping >= 0.0:  # also rejects NaN
            raise InvalidArgumentError(f"damping must be non-negative, got {damping}.")
        self.damping = float(damping)

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """``damping`` for each direction, like ``evals``; the rest is unused."""
        return torch.full_like(evals, self.damping)


class BootstrapDamping:
    """Per-direction damping whose predicted loss change is most reliably negative.

    With the sample means ``γ̄``, ``λ̄`` of direction ``k``, each grid value ``δ'``
    gives the step ``τ = −γ̄ / (λ̄ + δ')`` and the predicted change
    ``Δ_b = γ̂_b τ + ½ λ̂_b τ²`` on bootstrap resamples ``b`` (the rows of
    ``gammas`` and of ``lambdas`` drawn independently; ``γ̂_b``, ``λ̂_b`` their
    means). The rule picks the grid value that minimises the upper ``percentile``
    of ``Δ_b`` (ties: the smaller one), and skips the direction (``inf``) where
    that is not negative for any value, always where ``γ̄ = 0``. With exact
    curvature it shrinks the Newton step by about ``g / |γ̄|``, ``g`` the lower
    ``100 − percentile`` percentile of ``sign(γ̄) γ̂_b``, and skips ``g ≤ 0``. A
    single sample is taken as exact.

    The grid is on the per-sample-mean scale; the result ``δ'_k · evals_k / λ̄_k``
    on that of ``evals`` (``N · δ'_k`` for a loss summed over the ``N`` samples of
    ``lambdas``; where ``λ̄_k ≤ 0`` the ratio ``Σ evals / Σ λ̄`` of the other
    directions, or 1).

    Only sampling noise is accounted for: a flat direction with a reliable
    gradient sign gets the smallest grid value, a step of about ``γ̄ / δ'_min``.
    Bound it by a trust region (``trust_fraction`` of
    :class:`~vivit.optim.DampedNewton`, ``max_decrease`` of
    :meth:`vivit.LowRankGGN.newton`).

    Args:
        damping_grid: Candidate non-negative, finite dampings ``δ'`` (default: 21
            log-spaced in ``[1e-3, 1e2]``); ``λ̄ + δ' ≤ 0`` is never chosen.
        num_resamples: Number of bootstrap resamples.
        percentile: Percentile in ``(0, 100]`` of the resampled changes that must
            be negative and is minimised.
        generator: Generator of the resamples (``None``: PyTorch's global one).

    Raises:
        InvalidArgumentError: If an argument is out of range.
    """

    def __init__(
        self,
        damping_grid: Sequence[float] | Tensor | None = None,
        num_resamples: int = 100,
        percentile: float = 95.0,
        generator: torch.Generator | None = None,
    ):
        if damping_grid is None:
            damping_grid = torch.logspace(-3, 2, 21, dtype=torch.float64)
        grid = torch.as_tensor(damping_grid, dtype=torch.float64).detach().cpu()
        if grid.ndim != 1 or grid.numel() == 0:
            raise InvalidArgumentError("damping_grid must be a non-empty 1d sequence.")
        if not (grid.isfinite().all() and (grid >= 0).all()):
            raise InvalidArgumentError(
                f"damping_grid must be finite and non-negative, got {grid.tolist()}."
            )
        if not (isinstance(num_resamples, int) and num_resamples >= 1):
            raise InvalidArgumentError(
                f"num_resamples must be an int ≥ 1, got {num_resamples}."
            )
        if not 0.0 < percentile <= 100.0:
            raise InvalidArgumentError(
                f"percentile must lie in (0, 100], got {percentile}."
            )
        self.damping_grid = grid.sort().values
        self.num_resamples = num_resamples
        self.percentile = float(percentile)
        self.generator = generator

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """A damping per direction; ``evals`` sets the result's scale and type.

        Raises:
            InvalidArgumentError: If the shapes do not match or there are no samples.
        """
        (K,) = evals.shape
        if K == 0:  # no direction: nothing to choose
            return evals.new_empty(0)
        for name, t in (("gammas", gammas), ("lambdas", lambdas)):
            if t.ndim != 2 or t.shape[1] != K or t.shape[0] == 0:
                raise InvalidArgumentError(
                    f"{name} must have shape [N ≥ 1, {K}], got {tuple(t.shape)}."
                )
        # float64: differences between neighbouring grid values are tiny
        gammas, lambdas = gammas.detach().double(), lambdas.detach().double()
        gamma_bar, lambda_bar = gammas.mean(0), lambdas.mean(0)  # [K]
        gamma_hat = self._resample_means(gammas)  # [B, K]
        lambda_hat = self._resample_means(lambdas)  # [B, K]

        grid = self.damping_grid.to(gammas.device).unsqueeze(1)  # [G, 1]
        denominator = lambda_bar + grid  # [G, K]
        valid = denominator > 0
        tau = -gamma_bar / torch.where(valid, denominator, 1.0)  # [G, K]
        change = gamma_hat.unsqueeze(1) * tau + 0.5 * lambda_hat.unsqueeze(1) * tau**2
        pessimistic = torch.quantile(change, self.percentile / 100, dim=0)  # [G, K]
        pessimistic = torch.where(valid, pessimistic, torch.inf)

        best, index = pessimistic.min(0)  # first minimum: smallest damping on ties
        delta = torch.where(best < 0, grid.squeeze(1)[index], torch.inf)  # [K]
        return self._to_evals_scale(delta, evals, lambda_bar)

    def _resample_means(self, samples: Tensor) -> Tensor:
        """Means of bootstrap resamples of the rows, shape ``[B, K]``."""
        N = samples.shape[0]
        device = samples.device if self.generator is None else self.generator.device
        index = torch.randint(
            N, (self.num_resamples, N), generator=self.generator, device=device
        ).to(samples.device)
        counts = samples.new_zeros(self.num_resamples, N)
        counts.scatter_add_(1, index, torch.ones_like(counts))
        return counts @ samples / N

    @staticmethod
    def _to_evals_scale(delta: Tensor, evals: Tensor, lambda_bar: Tensor) -> Tensor:
        """Rescale mean-scale dampings by ``evals / λ̄`` (see class docstring)."""
        evals64 = evals.detach().double()
        positive = lambda_bar > 0
        fallback = evals64[positive].sum() / lambda_bar[positive].sum()
        if not (positive.any() and fallback > 0):
            fallback = torch.ones_like(fallback)
        scale = torch.where(
            positive, evals64 / lambda_bar.where(positive, 1.0), fallback
        )
        delta = torch.where(delta.isinf(), delta, (delta * scale).clamp_min(0.0))
        return delta.to(evals.dtype)
