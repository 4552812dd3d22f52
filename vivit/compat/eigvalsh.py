"""GGN eigenvalues during backpropagation (ViViT-compatible)."""

from __future__ import annotations

from torch import Tensor

from vivit.compat.computation import GroupComputation
from vivit.linalg.solvers import gram_eigvalsh
from vivit.sources.collector import GroupCurvature


class EigvalshComputation(GroupComputation):
    """Provide a BackPACK extension and hook to compute GGN eigenvalues.

    Each parameter group carries ``"params"``; see ``docs/migration.rst`` for the
    protocol.

    Args:
        subsampling: Indices of the samples whose curvature is used (``None``:
            all); the GGN is that of the same loss on those samples alone.
        mc_samples: ``0`` uses the exact loss Hessian; ``M > 0`` its unbiased
            Monte-Carlo estimate with ``M`` samples per datum.
        verbose: Print what happens during backpropagation.
        gram_dtype: Type of the Gram matrix and its eigenvalues (``None``: the
            model's); ``torch.float64`` resolves the small eigenvalues of a
            float32 model (see :class:`vivit.options.CurvatureOptions`).
    """

    def compute(self, group: dict, curvature: GroupCurvature) -> Tensor:
        """Eigenvalues of the group's GGN block.

        Returns:
            All ``N·C`` (``N·M`` with MC) eigenvalues of the Gram matrix, ascending,
            as computed (numerical zeros possibly slightly negative), in
            ``gram_dtype``.
        """
        return gram_eigvalsh(curvature.gram)
