"""Every option of a curvature request, checked once where it enters the library.

Checks that need the model or the data run where those are first seen
(:mod:`vivit.sources.stored`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vivit._validation import (
    check_mc_samples,
    check_positive_int,
    check_subsampling,
)
from vivit.distributed.group import resolve_group
from vivit.engines.base import Engine, OutputSelector, check_output_selector
from vivit.engines.choice import check_engine, runs_without_engine
from vivit.errors import InvalidArgumentError
from vivit.linalg.iterative import check_seed, check_tolerance
from vivit.linalg.solvers import check_gram_dtype
from vivit.linalg.top_k import check_solver

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class CurvatureOptions:
    """The options of every front door, checked when the object is built.

    Attributes:
        mc_samples: ``0`` (default): the exact GGN; ``M > 0``: its unbiased
            Monte-Carlo estimate, ``M`` samples per datum ("Cheap approximations").
        mc_per: An MC draw of a sequence output ``[N, C, *T]`` gives ``"token"``
            (default) a column per position, ``"sequence"`` one per sample.
        subsampling: Samples whose curvature is used (default ``None``: all; a
            tuple); not with a data loader.
        generator: Generator of the MC samples (default ``None``: one seed ``s``
            drawn from torch's global one, which it advances: ``docs/guide.rst``,
            "The observer's contract"); a loader's batch ``b`` draws from one
            seeded ``s + b``.
        gram_dtype: Type of the Gram matrix, the products with ``V`` and Gram-space
            results (default ``None``: the parameters'); float64 resolves more.
        route: ``"gram"`` (factors of ``V``), ``"implicit"`` (GGN-vector products)
            or ``"auto"`` (default: by memory and cost).
        solver: Eigensolver for ``top_k`` pairs: ``"auto"`` (default) or, taking
            the Gram route, ``"dense"``, ``"gram_krylov"``, ``"factor_krylov"``.
        solver_tol: Relative residual bound ``‖G̃ũ − λũ‖ ≤ tol·λ_max`` of the
            iterative solvers (default ``None``: ``max(100·ε, 1e-12)``).
        solver_seed: Seed of the iterative solvers' start block (default ``0``).
        engine: What computes the layer factors: ``"auto"`` (default, logged),
            ``"backpack"``, ``"func"`` or an engine instance ("Engines: any model").
        progress: Progress bar of a pass over a loader: ``True``, ``False``, or
            ``None`` (default: on a terminal, after two seconds).
        process_group: ``None`` (default): the default group if initialised;
            ``False``: this process alone; or a group ("Several processes").
        chunk_size: Most samples per backward pass, bounding its memory (default
            ``None``: the whole batch); not with a process group.
        output: What the loss is computed from: default ``None`` (the model's
            tensor), a key or attribute, or a function ("Structured model outputs").
        max_batches: Most batches of a loader a pass reads (default ``None``:
            until it ends).
        group: The resolved process group (``None``: this process); not given.

    Raises:
        VivitError: For the first malformed option
            (:class:`~vivit.InvalidArgumentError`,
            :class:`~vivit.InvalidSubsamplingError`), or options that conflict.
    """

    mc_samples: int = 0
    mc_per: str = "token"
    subsampling: Sequence[int] | None = None
    generator: torch.Generator | None = None
    gram_dtype: torch.dtype | None = None
    route: str = "auto"
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
        if self.route not in ROUTES:
            raise InvalidArgumentError(
                f"route must be one of {ROUTES}, got {self.route!r}."
            )
        check_solver(self.solver)
        check_tolerance(self.solver_tol, "solver_tol")
        check_seed(self.solver_seed, "solver_seed")
        subsampling = check_subsampling(self.subsampling)
        object.__setattr__(
            self, "subsampling", None if subsampling is None else tuple(subsampling)
        )
        check_gram_dtype(self.gram_dtype)
        check_mc_samples(self.mc_samples)
        if not isinstance(self.mc_per, str) or self.mc_per not in MC_PER:
            raise InvalidArgumentError(
                f"mc_per must be one of {MC_PER}, got {self.mc_per!r}: 'token' draws "
                "one column per position of a sequence (N·M·T Gram rows), "
                "'sequence' one per sample (N·M)."
            )
        if not isinstance(self.generator, torch.Generator | None):
            raise InvalidArgumentError(
                "generator must be a torch.Generator or None, got "
                f"{type(self.generator).__name__}: e.g. "
                "torch.Generator().manual_seed(0)."
            )
        check_engine(self.engine)
        if not isinstance(self.progress, bool | None):
            raise InvalidArgumentError(
                "progress must be True, False or None (automatic), got "
                f"{self.progress!r}."
            )
        check_positive_int(
            self.chunk_size,
            "chunk_size",
            "samples per backward pass",
            "the whole batch",
        )
        check_output_selector(self.output)
        check_positive_int(
            self.max_batches,
            "max_batches",
            "the most batches of the data loader a pass reads",
            "until the loader ends",
        )
        object.__setattr__(self, "group", resolve_group(self.process_group))
        obstacle = implicit_obstacle(self)
        if self.route == "implicit" and obstacle is not None:
            raise InvalidArgumentError(obstacle)
        if self.chunk_size is not None and self.group is not None:
            raise InvalidArgumentError(
                "chunk_size is not supported with a process group (each rank "
                "exchanges its shard as one block): pass smaller shards, more "
                "ranks, or process_group=False for per-rank computations."
            )

    def replace(self, **changes: object) -> CurvatureOptions:
        """A copy with the options in ``changes`` changed (and checked).

        Raises:
            InvalidArgumentError: For a name that is not an option, or a value.
        """
        check_option_names(changes)
        return dataclasses.replace(self, **changes)


def derived(options: CurvatureOptions, **changes: object) -> CurvatureOptions:
    """``options`` with valid ``changes``, unchecked (``process_group=False``: none)."""
    copy = object.__new__(CurvatureOptions)
    copy.__dict__.update(options.__dict__, **changes)
    if changes.get("process_group", True) is False:
        copy.__dict__["group"] = None
    return copy


def options_from(arguments: dict[str, object], **fixed: object) -> CurvatureOptions:
    """The checked options among ``arguments`` (``locals()``), ``fixed`` on top."""
    given = {k: v for k, v in arguments.items() if k in OPTION_NAMES}
    return CurvatureOptions(**{**given, **fixed})


def check_option_names(names: Iterable[str], also: str = "") -> None:
    """Refuse ``names`` that are not options (``also``: what else the caller takes).

    Raises:
        InvalidArgumentError: For a name that is not an option (``group`` too).
    """
    unknown = sorted(set(names) - OPTION_NAMES)
    if unknown:
        raise InvalidArgumentError(
            f"Unknown option(s) {unknown}: not options of a curvature request"
            f"{also}; the options are {sorted(OPTION_NAMES)}."
        )


#: The names of the options (``group`` is resolved, not given).
OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(CurvatureOptions) if f.init)

#: The accepted values of ``route``, and of ``mc_per`` (what one MC draw covers).
ROUTES = ("auto", "gram", "implicit")
MC_PER = ("token", "sequence")


def implicit_obstacle(options: CurvatureOptions) -> str | None:
    """Why the implicit route cannot honour the options, or ``None`` if it can."""
    if options.solver != "auto":
        return (
            f"solver={options.solver!r} runs on the Gram route (on the Gram "
            "matrix or the factors of V), which route='implicit' never forms: "
            "drop solver, or use route='gram'."
        )
    if options.mc_samples:
        return (
            "route='implicit' multiplies the exact loss Hessian (diag(p) − ppᵀ "
            "per position, never formed), which costs what a sampled one would: "
            "Monte-Carlo sampling saves nothing there. Drop mc_samples, or use a "
            "Gram route (route='auto' or 'gram') for the MC estimate."
        )
    if options.gram_dtype is not None:
        return (
            "gram_dtype is the type of the Gram matrix and of the products with V, "
            "which route='implicit' never forms: its products run in the model's "
            "type (the eigensolver's basis in float64). Drop gram_dtype, or cast "
            "the model (model.double()) for float64 products."
        )
    if not runs_without_engine(options.engine):
        return (
            f"route='implicit' runs no engine (its products are torch.func's), got "
            f"engine={options.engine!r}: drop engine, or use a Gram route."
        )
    return None


def check_streaming_solver(solver: str) -> None:
    """Refuse a solver that needs the Gram matrix, which a stream never forms."""
    if solver in ("dense", "gram_krylov"):
        raise InvalidArgumentError(
            f"solver={solver!r} needs the Gram matrix, which StreamingGGN never "
            "forms: use solver='auto' or 'factor_krylov' (block Krylov on "
            "products by passes over the data), or LowRankGGN over the loader."
        )


def check_streaming(options: CurvatureOptions) -> None:
    """Refuse a Gram solver, implicit route, subsampling or group (StreamingGGN)."""
    check_streaming_solver(options.solver)
    if options.route == "implicit":
        raise InvalidArgumentError(
            "route='implicit' is a route of LowRankGGN: build LowRankGGN(model, "
            "loss_func, loader, route='implicit'), which keeps no factors either "
            "and passes over the loader in every product."
        )
    if options.subsampling is not None:
        raise InvalidArgumentError(
            "subsampling selects samples of one mini-batch, which StreamingGGN "
            "does not need: pass a loader over the samples whose curvature you "
            "want (or LowRankGGN(..., subsampling=...) for one mini-batch)."
        )
    if options.group is not None:
        raise InvalidArgumentError(
            "StreamingGGN streams over this process's loader alone: a process "
            "group (the union of the ranks' loaders) is not supported. Pass "
            "process_group=False, or use LowRankGGN(..., process_group=...) whose "
            "factors are exchanged between the ranks."
        )
