"""Shared machinery of the ViViT-compatible computation classes.

A computation hands out a BackPACK extension and an extension hook; the hook turns
each parameter group's curvature into the computation's result as soon as the
group is complete, and :meth:`GroupComputation.get_result` returns it.

These classes behave as ViViT 1.0 (``vivit-for-pytorch``) does: any criterion
works, eigenvalues are returned as computed, and Gram-space vectors they hand out
are ordered class-major (entry ``c·N + n``), as ViViT's were. The Gram pipeline
underneath is sample-major (``n·C + c``); :func:`to_class_major` converts at the
boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from warnings import warn

import torch
from torch import Tensor
from torch.nn import Module

from vivit._validation import (
    check_grad_mode,
    check_mc_samples,
    check_param_groups,
    check_params,
    check_subsampling,
)
from vivit.directional.gram_space import directional_derivatives
from vivit.directional.results import DirectionalDerivatives
from vivit.engines.backpack import ContributionHook, GramGGN
from vivit.engines.base import BatchInfo
from vivit.errors import InvalidArgumentError, ResultNotReadyError
from vivit.linalg.solvers import check_gram_dtype, gram_eigh, numerical_zero_tolerance
from vivit.sources.collector import GroupCollector, GroupCurvature


def to_class_major(gram_vectors: Tensor, columns_per_sample: int) -> Tensor:
    """Reorder the rows of Gram-space vectors from sample-major to class-major.

    Row ``n·C + c`` (vivit's Gram pipeline) becomes row ``c·N + n`` (ViViT 1.0,
    BackPACK's layout ``[C, N, ...]``).

    Args:
        gram_vectors: Vectors as columns, ``[N·C, K]``, sample-major.
        columns_per_sample: ``C`` (``M`` with Monte-Carlo sampling).

    Returns:
        The same vectors, ``[N·C, K]``, class-major.
    """
    rows, num_vectors = gram_vectors.shape
    num_samples = rows // columns_per_sample
    return (
        gram_vectors.reshape(num_samples, columns_per_sample, num_vectors)
        .transpose(0, 1)
        .reshape(rows, num_vectors)
    )


def criterion_indices(keep: object, num_evals: int) -> Tensor:
    """Turn what a criterion returned into indices of the eigenvalues it keeps.

    Accepts what indexing the eigenvalues accepted in ViViT 1.0: a sequence or
    1-d tensor of integer indices (negative ones count from the end), or a boolean
    mask over all eigenvalues.

    Args:
        keep: The criterion's return value.
        num_evals: Number of eigenvalues the criterion received.

    Returns:
        Indices, ``[K]`` (long).

    Raises:
        ValueError: If ``keep`` is none of these, or an index is out of range.
    """
    try:
        indices = torch.as_tensor(keep)
    except (TypeError, ValueError, RuntimeError):
        indices = None
    if indices is not None and indices.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if indices is not None and indices.dtype == torch.bool:
        if indices.shape == (num_evals,):
            return indices.nonzero().flatten().cpu()
        indices = None
    if (
        indices is None
        or indices.dim() != 1
        or indices.is_floating_point()
        or indices.is_complex()
    ):
        raise InvalidArgumentError(
            'A group\'s "criterion" must return the indices of the eigenvalues to '
            "keep (a list or 1-d tensor of ints, e.g. [evals.numel() - 1] for the "
            f"largest) or a boolean mask over all {num_evals} of them; got {keep!r}."
        )
    indices = indices.to(torch.long).cpu()
    outside = indices[(indices < -num_evals) | (indices >= num_evals)]
    if outside.numel():
        raise InvalidArgumentError(
            f'The "criterion" returned indices {outside.tolist()} outside the '
            f"{num_evals} eigenvalues it received (valid: 0 to {num_evals - 1}, or "
            "negative from the end)."
        )
    return indices


@dataclass(frozen=True)
class Selection:
    """The Gram eigenpairs a group's criterion selected.

    Attributes:
        evals: Selected eigenvalues as computed (possibly numerically zero or
            negative), ``[K]``, in the order the criterion gave.
        gram_evecs: Their Gram eigenvectors, sample-major, ``[N·C, K]``.
        tolerance: The Gram matrix's numerical-zero tolerance; directions with
            eigenvalues at or below it are zero vectors.
    """

    evals: Tensor
    gram_evecs: Tensor
    tolerance: float

    @property
    def resolved(self) -> Tensor:
        """Which selected eigenvalues lie above the tolerance, ``[K]`` (bool)."""
        return self.evals > self.tolerance


def selected_directional_derivatives(
    vt_grads: Tensor,
    selection: Selection,
    batch: BatchInfo,
    grad_samples: Sequence[int] | None = None,
) -> DirectionalDerivatives:
    """``γ``, ``λ`` and ``γ̄`` along every selected direction.

    Along a direction that is a zero vector (eigenvalue at or below the
    tolerance) all derivatives are zero; the eigenvalue is kept as computed.

    Args:
        vt_grads: ``Vᵀ∇ℓ_n`` for the gradient samples, ``[N·C, N_grad]``.
        selection: The selected eigenpairs.
        batch: Batch context of the Gram matrix.
        grad_samples: The gradient samples (``None``: the whole mini-batch).

    Returns:
        The directional derivatives, ``K`` columns.
    """
    resolved = selection.resolved
    part = directional_derivatives(
        vt_grads,
        selection.gram_evecs[:, resolved],
        selection.evals[resolved],
        batch,
        grad_samples,
    )

    def scatter(values: Tensor) -> Tensor:
        full = values.new_zeros(*values.shape[:-1], resolved.numel())
        full[..., resolved] = values
        return full

    return DirectionalDerivatives(
        evals=selection.evals,
        gammas=scatter(part.gammas),
        lambdas=scatter(part.lambdas),
        gamma_bar=scatter(part.gamma_bar),
    )


class GroupComputation:
    """Base class: extension, hook, and results keyed by parameter group.

    Sub-classes set :attr:`required_keys` and the collector options, and implement
    :meth:`compute`.

    Args:
        subsampling: Samples whose curvature is used; ``None`` for all.
        mc_samples: ``0`` for the exact loss Hessian, else ``M`` MC samples.
        verbose: Print what happens during backpropagation.
        gram_dtype: Type of the Gram matrix and its products (``None``: the
            model's); see :class:`vivit.LowRankGGN`.
    """

    required_keys: tuple[str, ...] = ("params",)
    keep_factors = False
    compute_gradients = False

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
        gram_dtype: torch.dtype | None = None,
    ):
        self._subsampling = check_subsampling(subsampling)
        self._mc_samples = check_mc_samples(mc_samples)
        self._verbose = verbose
        check_gram_dtype(gram_dtype)
        self._gram_dtype = gram_dtype
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
            gram_dtype=self._gram_dtype,
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
            gradient_samples=self.gradient_samples(),
            gram_dtype=self._gram_dtype,
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
    ) -> Selection:
        """Decompose the Gram matrix and keep the eigenpairs the criterion selects.

        As in ViViT 1.0: the criterion receives all eigenvalues (ascending) and may
        return any indices; the selected eigenvalues are kept as computed, and a
        ``UserWarning`` is raised if one is smaller in magnitude than
        ``warn_small_eigvals``.

        Args:
            group: Parameter group with a ``"criterion"``.
            curvature: The group's curvature.
            warn_small_eigvals: Warn if a kept eigenvalue is smaller in magnitude.

        Returns:
            The selected eigenpairs and the numerical-zero tolerance.
        """
        evals, evecs = gram_eigh(curvature.gram)
        tolerance = numerical_zero_tolerance(evals, factor_dtype=curvature.factor_dtype)
        keep = criterion_indices(group["criterion"](evals), evals.numel())
        keep = keep.to(evals.device)
        evals, evecs = evals[keep], evecs[:, keep]
        if (evals.abs() < warn_small_eigvals).any():
            warn(
                f"Some selected eigenvalues are smaller than {warn_small_eigvals} in "
                "magnitude. Their transformation to parameter space divides by the "
                "eigenvalue's square root and is numerically unstable; consider a "
                "more restrictive criterion. Directions of eigenvalues at or below "
                f"the numerical-zero tolerance {tolerance:.3g} are zero vectors.",
                stacklevel=2,
            )
        return Selection(evals=evals, gram_evecs=evecs, tolerance=tolerance)
