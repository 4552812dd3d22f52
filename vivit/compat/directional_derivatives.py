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

    ``γ_nk = e_kᵀ∇ℓ_n`` and ``λ_nk = e_kᵀ G_n e_k`` along the eigenvectors ``e_k``
    each group's ``"criterion"`` selects (``docs/math.rst``, "Directional
    derivatives and curvature noise"). ``mc_samples_ggn`` is the option
    ``mc_samples`` of :class:`~vivit.options.CurvatureOptions`; the other arguments
    are :class:`~vivit.EighComputation`'s (``γ`` and ``λ`` come in ``gram_dtype``).

    Args:
        subsampling_grad: Samples whose directional gradients ``γ`` are computed
            (``None``: all).
        subsampling_ggn: Samples whose GGN defines the directions and whose
            directional curvatures ``λ`` are computed (``None``: all).
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
        grad = check_subsampling(subsampling_grad, name="subsampling_grad")
        self._subsampling_grad = grad
        args = (subsampling_ggn, mc_samples_ggn, verbose, warn_small_eigvals)
        super().__init__(*args, gram_dtype=gram_dtype)

    def get_extensions(self) -> list[GramGGN]:
        """The BackPACK extensions to unpack into ``with backpack(...)``."""
        return [self.get_extension()]

    def _directional(
        self, group: dict, curvature: GroupCurvature
    ) -> tuple[Selection, DirectionalDerivatives]:
        selection = self._select(group, curvature)
        return selection, selected_directional_derivatives(
            curvature.vt_grads, selection, curvature.batch, self._subsampling_grad
        )

    def compute(self, group: dict, curvature: GroupCurvature) -> tuple[Tensor, Tensor]:
        """Directional derivatives of the group.

        Returns:
            ``γ`` ``[N_grad, K]`` and ``λ`` ``[N_ggn, K]``, directions in the
            criterion's order; zero columns for numerically zero or negative
            eigenvalues.
        """
        _, directional = self._directional(group, curvature)
        return directional.gammas, directional.lambdas
