"""GGN eigenvalues and eigenvectors during backpropagation (ViViT-compatible)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from vivit.computation import GroupComputation
from vivit.groups import GroupCurvature
from vivit.linalg.solvers import gram_to_param


class EighComputation(GroupComputation):
    """Provide a BackPACK extension and hook to compute GGN eigenpairs.

    Each parameter group carries ``"params"`` and ``"criterion"``, a function that
    receives the Gram matrix's eigenvalues (ascending) and returns the indices of
    those whose eigenvectors are computed, e.g. ``lambda evals: [evals.numel() - 1]``
    for the leading one.

    Usage::

        computation = EighComputation()
        groups = [{"params": list(model.parameters()), "criterion": top_3}]
        with backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ):
            loss.backward()
        evals, evecs = computation.get_result(groups[0])

    Args:
        subsampling: Indices of the samples whose curvature is used (``None``: all).
        mc_samples: ``0`` uses the exact loss Hessian; ``M > 0`` its Monte-Carlo
            estimate with ``M`` samples per datum.
        verbose: Print what happens during backpropagation.
        warn_small_eigvals: Warn when a selected eigenvalue is smaller in magnitude
            (its eigenvector divides by ``√λ``). ``0`` disables the warning.
            Non-positive selected eigenvalues are an error.
    """

    required_keys = ("params", "criterion")
    keep_factors = True

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
    ):
        super().__init__(
            subsampling=subsampling, mc_samples=mc_samples, verbose=verbose
        )
        self._warn_small_eigvals = warn_small_eigvals

    def compute(
        self, group: dict, curvature: GroupCurvature
    ) -> tuple[Tensor, list[Tensor]]:
        """Compute the group's result from its curvature (see ``get_result``)."""
        evals, gram_evecs = self._select(group, curvature, self._warn_small_eigvals)
        return evals, gram_to_param(curvature.ggn_factors, gram_evecs, evals)

    def get_result(self, group: dict) -> tuple[Tensor, list[Tensor]]:
        """Eigenvalues and eigenvectors of the group's GGN block.

        Args:
            group: The parameter group.

        Returns:
            Selected eigenvalues ``[K]`` (ascending) and the eigenvectors, one tensor
            ``[K, *p.shape]`` per parameter of the group: eigenvector ``k`` is
            ``[evecs_p[k] for evecs_p in evecs]``.

        Raises:
            ResultNotReadyError: If the backward pass has not run for this group.
        """
        return self._result(group)
