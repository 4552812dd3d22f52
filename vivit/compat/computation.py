"""The BackPACK extension + hook protocol every ViViT-compatible class follows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import Module

from vivit._param_groups import check_param_groups
from vivit._validation import (
    check_grad_mode,
    check_mc_samples,
    check_params,
    check_subsampling,
)
from vivit.compat.selection import Selection, select_eigenpairs
from vivit.engines.backpack import ContributionHook, GramGGN
from vivit.errors import ResultNotReadyError
from vivit.linalg.solvers import check_gram_dtype
from vivit.sources.collector import GroupCollector, GroupCurvature


class GroupComputation:
    """Base class: extension, and a hook storing :meth:`compute` per complete group.

    Sub-classes set :attr:`required_keys` and the collector options; the arguments
    are :class:`~vivit.EigvalshComputation`'s.
    """

    required_keys: tuple[str, ...] = ("params",)
    keep_factors = False
    compute_gradients = False
    _subsampling_grad: list[int] | None = None  # samples of Vᵀ∇ℓ_n (None: all)

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
        *,
        gram_dtype: torch.dtype | None = None,
    ):
        self._subsampling = check_subsampling(subsampling)
        self._mc_samples = check_mc_samples(mc_samples)
        self._verbose = verbose
        check_gram_dtype(gram_dtype)
        self._gram_dtype = gram_dtype
        self._results: dict[int, Any] = {}

    def get_extension(self) -> GramGGN:
        """The BackPACK extension to pass to ``with backpack(...)``."""
        return GramGGN(
            mc_samples=self._mc_samples,
            subsampling=self._subsampling,
            compute_gradients=self.compute_gradients,
            gram_dtype=self._gram_dtype,
        )

    def get_extension_hook(self, param_groups: list[dict]) -> Callable[[Module], None]:
        """The hook to pass as ``extension_hook`` to ``with backpack(...)``.

        Args:
            param_groups: Dicts with ``"params"`` (and the keys the computation
                requires), as for a ``torch.optim.Optimizer``; each one diagonal
                block of the GGN.
        """
        check_grad_mode(f"{type(self).__name__}.get_extension_hook")
        check_param_groups(param_groups, self.required_keys)
        check_params([p for group in param_groups for p in group["params"]], {})
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
            gradient_samples=self._subsampling_grad,
            gram_dtype=self._gram_dtype,
        )
        return ContributionHook(collector)

    def compute(self, group: dict, curvature: GroupCurvature) -> Any:
        """Turn a group's curvature (Gram matrix, factors) into its result."""
        raise NotImplementedError

    def get_result(self, group: dict) -> Any:
        """What :meth:`compute` returned for ``group`` (of :meth:`get_extension_hook`).

        Raises:
            ResultNotReadyError: If the backward pass has not run for this group.
        """
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


class CriterionComputation(GroupComputation):
    """Base of computations along the eigenpairs a group's ``"criterion"`` selects."""

    required_keys = ("params", "criterion")

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
        *,
        gram_dtype: torch.dtype | None = None,
    ):
        super().__init__(subsampling, mc_samples, verbose, gram_dtype=gram_dtype)
        self._warn_small_eigvals = warn_small_eigvals

    def _select(self, group: dict, curvature: GroupCurvature) -> Selection:
        return select_eigenpairs(
            curvature, group["criterion"], self._warn_small_eigvals
        )
