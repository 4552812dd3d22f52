"""GGN eigenvalues and eigenvectors during backpropagation (ViViT-compatible)."""

from __future__ import annotations

from torch import Tensor

from vivit.compat.computation import CriterionComputation
from vivit.linalg.solvers import gram_to_param
from vivit.sources.collector import GroupCurvature


class EighComputation(CriterionComputation):
    """Provide a BackPACK extension and hook to compute GGN eigenpairs.

    Each parameter group carries ``"params"`` and ``"criterion"``: a function from
    the Gram matrix's eigenvalues (ascending) to the indices (or mask) of those kept,
    e.g. ``lambda evals: [evals.numel() - 1]`` (``docs/migration.rst``).

    Its arguments are :class:`~vivit.EigvalshComputation`'s and ``warn_small_eigvals``:
    warn (``UserWarning``) when a kept eigenvalue is smaller in magnitude (its
    eigenvector divides by ``√λ``); ``0`` disables the warning.
    """

    keep_factors = True

    def compute(
        self, group: dict, curvature: GroupCurvature
    ) -> tuple[Tensor, list[Tensor]]:
        """Eigenvalues and eigenvectors of the group's GGN block.

        Returns:
            Selected eigenvalues ``[K]`` as computed, in the criterion's order, and
            the eigenvectors, one ``[K, *p.shape]`` per parameter in its dtype: of unit
            norm, or zero if ``evals[k]`` is numerically zero or negative.
        """
        kept = self._select(group, curvature)
        factors = curvature.ggn_factors
        evecs = gram_to_param(factors, kept.gram_evecs, kept.evals, kept.tolerance)
        return kept.evals, curvature.in_param_dtypes(evecs)
