"""Directional derivatives along GGN eigenvectors during backprop (ViViT-compatible)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vivit._validation import check_subsampling
from vivit.compat.computation import CriterionComputation
from vivit.compat.selection import Selection, selected_directional_derivatives
from vivit.directional.results import DirectionalDerivatives
from vivit.engines.backpack import GramGGN
from vivit.sources.collector import GroupCurvature


class DirectionalDerivativesComputation(CriterionComputation):
    """Provide a BackPACK extension and hook for 1ˢᵗ/2ⁿᵈ directional derivatives.

    The directions are GGN eigenvectors ``e_k`` selected by each group's
    ``"criterion"``; ``γ_nk = e_kᵀ∇ℓ_n`` and ``λ_nk = e_kᵀ G_n e_k``
    (``docs/math.rst``).
    Neither per-sample gradients nor ``V`` are formed where a layer has a factor
    form. Both loss reductions and any number of MC samples are supported.

    As in ViViT 1.0 any criterion works. A selected eigenvalue at or below the
    numerical-zero tolerance has the zero vector as its direction, so its ``γ``
    and ``λ`` columns are zero (ViViT returned NaN or rounding noise there).

    Usage::

        computation = DirectionalDerivativesComputation()
        groups = [{"params": list(model.parameters()), "criterion": top_3}]
        with backpack(
            *computation.get_extensions(),
            extension_hook=computation.get_extension_hook(groups),
        ):
            loss.backward()
        gammas, lambdas = computation.get_result(groups[0])

    Args:
        subsampling_grad: Samples whose directional gradients ``γ`` are computed
            (``None``: all).
        subsampling_ggn: Samples whose GGN defines the directions and whose
            directional curvatures ``λ`` are computed (``None``: all).
        mc_samples_ggn: ``0`` for the exact loss Hessian, else ``M`` MC samples.
        verbose: Print what happens during backpropagation.
        warn_small_eigvals: Warn (``UserWarning``) when a selected eigenvalue is
            smaller in magnitude. ``0`` disables the warning.
        gram_dtype: Type of the Gram matrix and its products (``None``: the
            model's); ``torch.float64`` resolves the small eigenvalues of a
            float32 model (see :class:`vivit.options.CurvatureOptions`). ``γ`` and
            ``λ`` are returned in it.
    """

    compute_gradients = True

    def __init__(
        self,
        subsampling_grad: Sequence[int] | None = None,
        subsampling_ggn: Sequence[int] | None = None,
        mc_samples_ggn: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
        *,
        gram_dtype: torch.dtype | None = None,
    ):
        self._subsampling_grad = check_subsampling(
            subsampling_grad, name="subsampling_grad"
        )
        super().__init__(
            subsampling_ggn,
            mc_samples_ggn,
            verbose,
            warn_small_eigvals,
            gram_dtype=gram_dtype,
        )

    def get_extensions(self) -> list[GramGGN]:
        """Instantiate the BackPACK extensions for this computation.

        Returns:
            Extensions to unpack into ``with backpack(...)``.
        """
        return [self.get_extension()]

    def gradient_samples(self) -> list[int] | None:  # noqa: D102
        return self._subsampling_grad

    def _directional(
        self, group: dict, curvature: GroupCurvature
    ) -> tuple[Selection, DirectionalDerivatives]:
        selection = self._select(group, curvature)
        return selection, selected_directional_derivatives(
            curvature.vt_grads, selection, curvature.batch, self.gradient_samples()
        )

    def compute(self, group: dict, curvature: GroupCurvature) -> tuple[Tensor, Tensor]:
        """Directional derivatives of the group.

        Args:
            group: The parameter group.
            curvature: Its Gram matrix and ``Vᵀ∇ℓ_n``.

        Returns:
            ``γ`` of shape ``[N_grad, K]`` (``γ[n, k]``: sample ``n`` of the gradient
            samples, direction ``k``) and ``λ`` of shape ``[N_ggn, K]``; directions
            ordered as the criterion selected them (ascending for ascending
            indices); zero columns for numerically zero or negative eigenvalues.
        """
        _, directional = self._directional(group, curvature)
        return directional.gammas, directional.lambdas
