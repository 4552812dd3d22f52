"""GGN eigenvalues and eigenvectors during backpropagation (ViViT-compatible)."""

from __future__ import annotations

from torch import Tensor

from vivit.compat.computation import CriterionComputation
from vivit.linalg.solvers import gram_to_param
from vivit.sources.collector import GroupCurvature


class EighComputation(CriterionComputation):
    """Provide a BackPACK extension and hook to compute GGN eigenpairs.

    Each parameter group carries ``"params"`` and ``"criterion"``, a function that
    receives the Gram matrix's eigenvalues (ascending) and returns the indices of
    those whose eigenvectors are computed, e.g. ``lambda evals: [evals.numel() - 1]``
    for the leading one. Any selection works, as in ViViT 1.0 (``docs/migration.rst``).

    Its arguments are :class:`~vivit.EigvalshComputation`'s (eigenvectors come in
    the parameters' dtype) and ``warn_small_eigvals``: warn (``UserWarning``) when
    a selected eigenvalue is smaller in magnitude (its eigenvector divides by
    ``√λ``); ``0`` disables the warning.
    """

    keep_factors = True

    def compute(
        self, group: dict, curvature: GroupCurvature
    ) -> tuple[Tensor, list[Tensor]]:
        """Eigenvalues and eigenvectors of the group's GGN block.

        Returns:
            Selected eigenvalues ``[K]`` as computed, in the criterion's order, and
            the eigenvectors, one tensor ``[K, *p.shape]`` per parameter: of unit
            norm, or zero if ``evals[k]`` is numerically zero or negative.
        """
        selection = self._select(group, curvature)
        evecs = gram_to_param(
            curvature.ggn_factors,
            selection.gram_evecs,
            selection.evals,
            selection.tolerance,
        )
        return selection.evals, curvature.in_param_dtypes(evecs)
