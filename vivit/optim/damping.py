"""Dampings for Newton steps in the GGN eigenspace.

A damping is a callable

    ``damping(evals, gram_evecs, gammas, lambdas) -> deltas``

that maps the eigenvalues ``evals`` (shape ``[K]``) of the step's directions, the Gram
matrix eigenvectors ``gram_evecs`` (``[NC, K]``), and the per-sample first and second
directional derivatives ``gammas`` (``[N_grad, K]``) and ``lambdas`` (``[N_ggn, K]``,
rows are samples) to one damping ``δ_k ≥ 0`` per direction (``[K]``). The Newton
step along direction ``k`` is ``-γ̄_k / (λ_k + δ_k)``; ``δ_k = inf`` skips the
direction (it gets no step).

Scale: depending on the loss reduction, ``evals`` are on the "sum" scale
(``λ_k = Σ_n λ_nk``) or the "mean" scale (``λ_k = mean_n λ_nk``), and the step uses
``γ̄_k`` on the same scale. A damping must therefore be returned on the scale of
``evals``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vivit.errors import InvalidArgumentError


class ConstantDamping:
    """The same damping for every direction.

    The value is used as is, on the scale of ``evals``: with a sum-reduced loss, the
    same constant damps relatively less than with a mean-reduced loss.

    Args:
        damping: Non-negative damping added to every eigenvalue. Default: ``1.0``.

    Raises:
        ValueError: If ``damping`` is negative or not a number.
    """

    def __init__(self, damping: float = 1.0):
        if not damping >= 0.0:  # also rejects NaN
            raise InvalidArgumentError(f"damping must be non-negative, got {damping}.")
        self.damping = float(damping)

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return the constant damping for each direction.

        Args:
            evals: Eigenvalues of the directions, shape ``[K]``.
            gram_evecs: Gram matrix eigenvectors, shape ``[NC, K]`` (unused).
            gammas: First directional derivatives, shape ``[N_grad, K]`` (unused).
            lambdas: Second directional derivatives, shape ``[N_ggn, K]`` (unused).

        Returns:
            ``damping`` for each direction, shape ``[K]``, dtype and device of
            ``evals``.
        """
        return torch.full_like(evals, self.damping)


class BootstrapDamping:
    """Per-direction damping whose predicted loss change is most reliably negative.

    For direction ``k``, let ``γ̄ = mean_n γ_nk`` and ``λ̄ = mean_n λ_nk`` be the
    per-sample-mean estimates. A damping ``δ'`` from ``damping_grid`` gives the step
    ``τ(δ') = -γ̄ / (λ̄ + δ')``. Its predicted loss change (per sample) is estimated
    on ``num_resamples`` bootstrap resamples ``b``: the rows of ``gammas`` and,
    independently, those of ``lambdas`` are drawn with replacement, their means
    ``γ̂_b``, ``λ̂_b`` give

        ``Δ_b(δ') = γ̂_b τ + ½ λ̂_b τ²``.

    The rule picks, per direction, the grid value minimising the upper
    ``percentile`` of ``Δ_b(δ')`` over the resamples, i.e. the most negative
    pessimistic prediction (ties go to the smaller damping). If this percentile is
    not negative for any grid value, the loss decrease is not reliable and the
    direction is skipped (``δ = inf``); this is the case whenever ``γ̄ = 0``.

    Noise-free data (all samples equal) gives the smallest grid value, since the
    undamped Newton step minimises an exact quadratic. With exact curvature, the
    percentile is ``½ λ̄ τ² - |τ| g``, with ``g`` the lower ``100 - percentile``
    percentile of ``sign(γ̄) γ̂_b`` (a pessimistic slope), so the rule shrinks the
    Newton step by about ``g / |γ̄|``, and skips directions whose gradient sign is
    uncertain (``g ≤ 0``).

    Scale: the grid holds dampings ``δ'`` for the per-sample-mean scale. The
    returned damping is ``δ_k = δ'_k · evals_k / λ̄_k``, so that
    ``λ_k + δ_k = (evals_k / λ̄_k) · (λ̄_k + δ'_k)``: the evaluated ``δ'_k``
    rescaled to the scale of ``evals`` (``λ_k = evals_k``). This equals ``δ'_k``
    for a mean-reduced loss and ``N · δ'_k`` for a sum-reduced loss over ``N``
    samples (if ``lambdas`` are from the same samples as ``evals``). Where
    ``λ̄_k ≤ 0`` the ratio ``Σ evals / Σ λ̄`` over the other directions is used
    (``1`` if there are none).

    With a single sample (``N_grad = 1`` or ``N_ggn = 1``), resampling reproduces
    it, so that quantity is treated as exact. Without directions (``K = 0``) the
    result is empty.

    The rule accounts for the sampling noise of ``γ`` and ``λ``, not for how far
    the quadratic model holds: along a direction with ``λ̄ ≪ δ'_min`` and a
    reliable gradient sign it picks the smallest grid value, a step of about
    ``γ̄ / δ'_min``. :class:`~vivit.optim.DampedNewton` bounds such steps by its
    trust region (``trust_fraction``); with :meth:`vivit.LowRankGGN.newton`,
    pass ``max_decrease`` for the same protection.

    Args:
        damping_grid: Candidate non-negative, finite dampings ``δ'`` on the
            per-sample-mean scale. Default: 21 values log-spaced in
            ``[1e-3, 1e2]``. Candidates with ``λ̄ + δ' ≤ 0`` are never chosen.
        num_resamples: Number of bootstrap resamples. Default: ``100``.
        percentile: Percentile (in ``(0, 100]``) of the resampled predicted
            changes that must be negative and is minimised. Default: ``95.0``.
        generator: Random number generator for the resamples, for reproducible
            results. Default: ``None`` (PyTorch's global generator).

    Raises:
        ValueError: If an argument is out of range.
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
        """Choose a damping per direction by bootstrapping the predicted change.

        Args:
            evals: Eigenvalues of the directions, shape ``[K]``; set the scale of
                the result.
            gram_evecs: Gram matrix eigenvectors, shape ``[NC, K]`` (unused).
            gammas: First directional derivatives, shape ``[N_grad, K]``.
            lambdas: Second directional derivatives, shape ``[N_ggn, K]``.

        Returns:
            Dampings ``δ_k ≥ 0`` on the scale of ``evals``, ``inf`` for skipped
            directions, shape ``[K]``, dtype and device of ``evals``.

        Raises:
            ValueError: If the shapes do not match or there are no samples.
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
