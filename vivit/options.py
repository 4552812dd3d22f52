"""Every option of a curvature request, checked once where it enters the library.

A front door (:class:`~vivit.LowRankGGN`, :class:`~vivit.StreamingGGN`,
:class:`~vivit.optim.DampedNewton`) builds one :class:`CurvatureOptions` from its
keyword arguments; building it checks every option, alone and together. The
sources, engines and solvers below receive the checked object and never check
an option again. Checks that need the model or the data (parameter groups,
sample indices against the batch size) run where those are first seen, in the
source (:mod:`vivit.sources.stored`, :mod:`vivit.sources.streamed`).

A new option touches this module, the one place that uses it, its test and its
documentation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vivit._validation import (
    check_chunk_size,
    check_generator,
    check_max_batches,
    check_mc_samples,
    check_progress,
    check_subsampling,
)
from vivit.distributed.group import resolve_group
from vivit.engines.base import Engine, OutputSelector, check_output_selector
from vivit.engines.choice import check_engine
from vivit.errors import InvalidArgumentError
from vivit.linalg.iterative import check_seed, check_tolerance
from vivit.linalg.solvers import check_gram_dtype
from vivit.linalg.top_k import check_solver

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class CurvatureOptions:
    """The options of a curvature request, checked when the object is built.

    The meaning of each option is documented once, at
    :class:`~vivit.LowRankGGN`; :class:`~vivit.StreamingGGN` takes the same names.

    Attributes:
        mc_samples: ``0`` for the exact GGN, ``M > 0`` for Monte-Carlo samples.
        subsampling: Curvature samples of one mini-batch (``None``: all).
        generator: Random generator of the Monte-Carlo samples.
        gram_dtype: Type of the Gram matrix and its products (``None``: the
            model's).
        solver: Default eigensolver for a few leading eigenpairs.
        solver_tol: Relative residual bound of the iterative solvers.
        solver_seed: Seed of the iterative solvers' start block.
        engine: ``"auto"``, ``"backpack"``, ``"func"`` or an engine instance.
        progress: Progress bar of a pass over a data loader.
        process_group: As passed: ``None``, ``False`` or a ``ProcessGroup``.
        chunk_size: Most samples per backward pass (``None``: whole batches).
        output: Selects the output tensor from what the model returns
            (:func:`~vivit.engines.base.select_output`).
        max_batches: Most batches of a data loader a pass reads (``None``: until
            it ends).
        group: The resolved process group (``None``: this process alone).

    Raises:
        VivitError: When built, for the first option that is malformed
            (:class:`~vivit.InvalidArgumentError`,
            :class:`~vivit.InvalidSubsamplingError`), or for options that do not
            go together.
    """

    mc_samples: int = 0
    subsampling: Sequence[int] | None = None
    generator: torch.Generator | None = None
    gram_dtype: torch.dtype | None = None
    solver: str = "auto"
    solver_tol: float | None = None
    solver_seed: int = 0
    engine: str | Engine = "auto"
    progress: bool | None = None
    process_group: ProcessGroup | bool | None = None
    chunk_size: int | None = None
    output: OutputSelector = None
    max_batches: int | None = None
    group: ProcessGroup | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_solver(self.solver)
        check_tolerance(self.solver_tol, "solver_tol")
        check_seed(self.solver_seed, "solver_seed")
        subsampling = check_subsampling(self.subsampling)
        object.__setattr__(
            self, "subsampling", None if subsampling is None else tuple(subsampling)
        )
        check_gram_dtype(self.gram_dtype)
        check_mc_samples(self.mc_samples)
        check_generator(self.generator)
        check_engine(self.engine)
        check_progress(self.progress)
        check_chunk_size(self.chunk_size)
        check_output_selector(self.output)
        check_max_batches(self.max_batches)
        object.__setattr__(self, "group", resolve_group(self.process_group))
        if self.chunk_size is not None and self.group is not None:
            raise InvalidArgumentError(
                "chunk_size is not supported with a process group (each rank "
                "exchanges its shard as one block): pass smaller shards, more "
                "ranks, or process_group=False for per-rank computations."
            )

    def replace(self, **changes: object) -> CurvatureOptions:
        """A copy with some options changed (and checked).

        Args:
            **changes: Options and their new values.

        Returns:
            The new options.
        """
        return dataclasses.replace(self, **changes)
