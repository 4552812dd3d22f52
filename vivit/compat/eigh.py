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

    Args:
        subsampling: Indices of the samples whose curvature is used (``None``: all).
        mc_samples: ``0`` uses the exact loss Hessian; ``M > 0`` its Monte-Carlo
            estimate with ``M`` samples per datum.
        verbose: Print what happens during backpropagation.
        warn_small_eigvals: Warn (``UserWarning``) when a selected eigenvalue is
            smaller in magnitude (its eigenvector divides by ``√λ``). ``0``
            disables the warning.
        gram_dtype: As for :class:`~vivit.EigvalshComputation`; eigenvectors are
            returned in the parameters' dtype.
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
