"""GGN eigenvalues during backpropagation (ViViT-compatible)."""

from __future__ import annotations

from torch import Tensor

from vivit.compat.computation import GroupComputation
from vivit.linalg.solvers import gram_eigvalsh
from vivit.sources.collector import GroupCurvature


class EigvalshComputation(GroupComputation):
    """Provide a BackPACK extension and hook to compute GGN eigenvalues.

    Each parameter group carries ``"params"``; see ``docs/migration.rst`` for the
    protocol. ``subsampling``, ``mc_samples`` and ``gram_dtype`` are options of
    :class:`~vivit.options.CurvatureOptions`; ``verbose`` prints what happens
    during backpropagation.
    """

    def compute(self, group: dict, curvature: GroupCurvature) -> Tensor:
        """Eigenvalues of the group's GGN block.

        Returns:
            All ``N·C`` (``N·M`` with MC) eigenvalues of the Gram matrix, ascending,
            as computed (numerical zeros possibly slightly negative), in
            ``gram_dtype``.
        """
        return gram_eigvalsh(curvature.gram)
