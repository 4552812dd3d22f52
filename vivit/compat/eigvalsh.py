"""GGN eigenvalues during backpropagation (ViViT-compatible)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vivit.compat.computation import GroupComputation
from vivit.linalg.solvers import gram_eigvalsh
from vivit.sources.collector import GroupCurvature


class EigvalshComputation(GroupComputation):
    """Provide a BackPACK extension and hook to compute GGN eigenvalues.

    Usage::

        computation = EigvalshComputation()
        groups = [{"params": list(model.parameters())}]
        with backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ):
            loss.backward()
        evals = computation.get_result(groups[0])

    Args:
        subsampling: Indices of the samples whose curvature is used. ``None`` uses
            the whole mini-batch. The GGN is then that of the same loss on those
            samples alone (mean over them for ``reduction="mean"``).
        mc_samples: ``0`` uses the exact loss Hessian; ``M > 0`` its unbiased
            Monte-Carlo estimate with ``M`` samples per datum.
        verbose: Print what happens during backpropagation.
        gram_dtype: Type of the Gram matrix and its eigenvalues (``None``: the
            model's); ``torch.float64`` resolves the small eigenvalues of a
            float32 model (see :class:`vivit.LowRankGGN`).
    """

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
        *,
        gram_dtype: torch.dtype | None = None,
    ):
        super().__init__(
            subsampling=subsampling,
            mc_samples=mc_samples,
            verbose=verbose,
            gram_dtype=gram_dtype,
        )

    def compute(self, group: dict, curvature: GroupCurvature) -> Tensor:
        """Compute the group's result from its curvature (see ``get_result``)."""
        return gram_eigvalsh(curvature.gram)

    def get_result(self, group: dict) -> Tensor:
        """Eigenvalues of the group's GGN block after the backward pass.

        Args:
            group: The parameter group.

        Returns:
            All ``N·C`` (``N·M`` with MC) eigenvalues of the Gram matrix, ascending,
            as computed: the GGN's non-zero eigenvalues plus numerical zeros
            (possibly slightly negative through rounding), in ``gram_dtype``.

        Raises:
            ResultNotReadyError: If the backward pass has not run for this group.
        """
        return self._result(group)
