"""Shared machinery of the ViViT-compatible computation classes.

A computation hands out a BackPACK extension and an extension hook; the hook turns
each parameter group's curvature into the computation's result as soon as the
group is complete, and :meth:`GroupComputation.get_result` returns it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from warnings import warn

from torch import Tensor
from torch.nn import Module

from vivit._validation import check_mc_samples, check_param_groups, check_subsampling
from vivit.engines.backpack import ContributionHook, GramGGN
from vivit.errors import ResultNotReadyError
from vivit.groups import GroupCollector, GroupCurvature


class GroupComputation:
    """Base class: extension, hook, and results keyed by parameter group.

    Sub-classes set :attr:`required_keys` and the collector options, and implement
    :meth:`compute`.

    Args:
        subsampling: Samples whose curvature is used; ``None`` for all.
        mc_samples: ``0`` for the exact loss Hessian, else ``M`` MC samples.
        verbose: Print what happens during backpropagation.
    """

    required_keys: tuple[str, ...] = ("params",)
    keep_factors = False
    compute_gradients = False

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
    ):
        self._subsampling = check_subsampling(subsampling)
        self._mc_samples = check_mc_samples(mc_samples)
        self._verbose = verbose
        self._results: dict[int, Any] = {}

    def get_extension(self) -> GramGGN:
        """Instantiate the BackPACK extension for this computation.

        Returns:
            Extension to pass to ``with backpack(...)``.
        """
        return GramGGN(
            mc_samples=self._mc_samples,
            subsampling=self._subsampling,
            compute_gradients=self.compute_gradients,
        )

    def get_extension_hook(self, param_groups: list[dict]) -> Callable[[Module], None]:
        """Instantiate the BackPACK extension hook that computes the results.

        Args:
            param_groups: Groups as for a ``torch.optim.Optimizer``: dicts with
                ``"params"`` (and the keys the computation requires). Each group
                defines one diagonal block of the GGN.

        Returns:
            Hook to pass as ``extension_hook`` to ``with backpack(...)``.
        """
        check_param_groups(param_groups, self.required_keys)
        for group in param_groups:
            self._results.pop(id(group), None)

        def on_complete(index: int, curvature: GroupCurvature) -> None:
            group = param_groups[index]
            if self._verbose:
                print(f"Group {id(group)}: all parameters seen, computing the result")
            self._results[id(group)] = self.compute(group, curvature)

        collector = GroupCollector(
            [group["params"] for group in param_groups],
            on_complete,
            keep_factors=self.keep_factors,
            vt_grads=self.compute_gradients,
            gradient_samples=self.gradient_samples(),
        )
        return ContributionHook(collector)

    def gradient_samples(self) -> list[int] | None:
        """Samples whose gradients enter ``Vᵀ∇ℓ_n`` (``None``: all).

        Returns:
            Sample indices or ``None``.
        """
        return None

    def compute(self, group: dict, curvature: GroupCurvature) -> Any:
        """Turn a group's curvature into this computation's result.

        Args:
            group: The parameter group.
            curvature: Its Gram matrix and factors.

        Returns:
            The group's result.
        """
        raise NotImplementedError

    def _result(self, group: dict) -> Any:
        try:
            return self._results[id(group)]
        except KeyError:
            raise ResultNotReadyError(
                "No result for this parameter group: pass the group to "
                "get_extension_hook, run loss.backward() inside "
                "`with backpack(extension, extension_hook=hook)`, then ask for the "
                "result. If you did, some of the group's parameters received no "
                "curvature (their layer is not extended or not part of the loss)."
            ) from None

    def _select(
        self, group: dict, curvature: GroupCurvature, warn_small_eigvals: float
    ) -> tuple[Tensor, Tensor]:
        """Decompose the Gram matrix and keep the eigenpairs the criterion selects.

        Args:
            group: Parameter group with a ``"criterion"``.
            curvature: The group's curvature.
            warn_small_eigvals: Warn if a kept eigenvalue is smaller in magnitude.

        Returns:
            Kept eigenvalues ``[K]`` and Gram eigenvectors ``[N·C, K]``.
        """
        evals, evecs = curvature.select(group["criterion"])
        if (evals.abs() < warn_small_eigvals).any():
            warn(
                f"Some selected eigenvalues are smaller than {warn_small_eigvals} in "
                "magnitude. Their transformation to parameter space divides by the "
                "eigenvalue's square root and is numerically unstable; consider a "
                "more restrictive criterion.",
                stacklevel=2,
            )
        return evals, evecs
