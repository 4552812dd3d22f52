"""What the results layer (:mod:`vivit.results`) asks of a source of curvature.

Each source answers per parameter group, its own way; shapes follow ``docs/math.rst``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor
from torch.nn import Parameter

from vivit._validation import check_group_index
from vivit.engines.base import BatchInfo
from vivit.linalg.group_products import VProducts


class GroupSource(Protocol):
    """One parameter group's curvature, as a source answers it.

    Attributes:
        batch: Batch context of the Gram matrix ``[num_rows, num_rows]``.
        factor_dtype: Type the engine computed the factors in (the model's);
            ``dtype``: of the Gram-space products (``gram_dtype`` or the factors').
        keeps_directions: Whether parameter-space eigenvectors are worth keeping
            between calls (each product is a pass over the data).
        parameter_space: Whether the eigenpairs are computed on ``G`` in parameter
            space (a :class:`ParameterGroupSource`: "Gram eigenvectors" are flat
            columns ``[D, K]``).
    """

    index: int
    params: list[Parameter]
    gradient: list[Tensor]
    batch: BatchInfo
    factor_dtype: torch.dtype
    dtype: torch.dtype
    device: torch.device
    num_rows: int
    products: VProducts
    solvers: tuple[str, ...]
    keeps_directions: bool
    parameter_space: bool

    def formed_gram(self) -> Tensor | None:
        """The Gram matrix if it was formed, else ``None``."""

    def form_gram(self, workspace_bytes: int) -> Tensor:
        """The Gram matrix ``[N·C, N·C]``, formed if needed.

        Args:
            workspace_bytes: Memory the caller needs beside it (its eigensolver).

        Raises:
            GramTooLargeError: If it and the workspace would not fit.
            InvalidArgumentError: If the source cannot form it.
        """

    def check_solver(self, solver: str) -> None:
        """Refuse a solver this source cannot run, naming what to do instead."""

    def directional_gradients(
        self,
        gram_evecs: Tensor,
        evals: Tensor,
        evecs: Callable[[], list[Tensor]],
        samples: Sequence[int] | None,
    ) -> Tensor:
        """``γ_nk = e_kᵀ∇ℓ_n`` of the gradient samples, ``[N_grad, K]``.

        Args:
            gram_evecs: Gram eigenvectors of the directions, ``[N·C, K]``.
            evals: Their eigenvalues (numerically non-zero), ``[K]``.
            evecs: Returns the directions in parameter space, ``[K, *p.shape]``
                per parameter (called only by sources that need them).
            samples: Gradient samples (checked; ``None``: all).
        """


class ParameterGroupSource(GroupSource, Protocol):
    """A group whose products are ``G v`` in parameter space (no ``V``, no Gram).

    ``num_rows`` counts its curvature samples' output entries; ``num_params`` is
    ``D``; :meth:`form_gram` refuses.
    """

    num_params: int

    def basis_columns(self, top_k: int) -> int | None:
        """Krylov basis columns the memory allows for ``top_k`` pairs (or ``None``).

        Raises:
            ProductsTooLargeError: If not even the smallest basis fits.
        """

    def flat_ggn_matmul(self, vectors: Tensor) -> Tensor:
        """``G V`` for flat columns ``[D, K]``: ``[D, K]``."""

    def unflatten(self, columns: Tensor) -> list[Tensor]:
        """Flat columns ``[D, K]`` as one tensor ``[K, *p.shape]`` per parameter."""

    def directional_derivatives(self, evecs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """``γ [N, K]`` of every sample and ``λ [N_ggn, K]`` along ``evecs``."""


class CurvatureSource:
    """The curvature of a loss on a set of samples: a :class:`GroupSource` per group.

    ``loss``: on all samples (detached); ``engine``: the engine's name.
    """

    param_groups: list[list[Parameter]]
    loss: Tensor
    engine: str
    groups: list[GroupSource]

    @property
    def passes(self) -> int:
        """Passes over this process's data made so far (sources that pass again)."""
        return self._data.passes

    def group(self, index: int) -> GroupSource:
        """The curvature of group ``index``.

        Raises:
            GroupIndexError: If there is no such group.
        """
        check_group_index(index, len(self.param_groups))
        return self.groups[index]


class PassGroup:
    """A group whose every product is a pass over the data (no Gram matrix kept)."""

    keeps_directions = True

    def __init__(self, source: CurvatureSource, index: int):
        self._source, self.index = source, index
        self.params = source.param_groups[index]
        self.gradient = source.gradients[index]
        self.batch = source.union
        self.device = self.params[0].device
        self.num_rows = source.num_rows
        self.products = self

    def formed_gram(self) -> Tensor | None:  # noqa: D102
        return None
