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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vivit._validation import (
    check_chunk_size,
    check_generator,
    check_max_batches,
    check_mc_per,
    check_mc_samples,
    check_progress,
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
    """The options of a curvature request, checked when the object is built.

    Every option is documented here, once. The front doors
    (:class:`~vivit.LowRankGGN`, :class:`~vivit.StreamingGGN`,
    :class:`~vivit.optim.DampedNewton`) take the same names and say only what
    differs for them.

    Attributes:
        mc_samples: ``0`` for the exact GGN; ``M > 0`` for its unbiased
            Monte-Carlo estimate with ``M`` samples per datum (``N·M`` instead of
            ``N·C`` Gram rows; for a cross-entropy output ``[N, C, *T]``,
            ``N·C·T`` exact and ``N·M·T`` or ``N·M`` with ``mc_per``).
        mc_per: What one Monte-Carlo draw of a cross-entropy output ``[N, C,
            *T]`` (a sequence of ``T = T₁⋯T_k`` positions) becomes: ``"token"``
            (default) one column per position, ``N·M·T`` Gram rows; ``"sequence"``
            one column per sample over all its positions, ``N·M``. Both are
            unbiased; per token the positions' draws enter as separate columns,
            so the estimate lacks the zero-mean cross terms between positions
            that a column per sequence carries: its variance is never larger
            (``docs/math.rst``, "Monte Carlo on sequences"), and a batch of a
            few sequences still has a Gram matrix of rank up to ``N·M·T``
            instead of ``N·M``. It is still ``C`` times smaller than the exact
            ``N·C·T``. Without extra axes (``[N, C]``) and for ``MSELoss`` and
            ``BCEWithLogitsLoss`` (which draw over all output entries at once)
            both give the same ``N·M`` columns.
        subsampling: Indices of the samples whose curvature is used (``None``:
            all). The GGN is then that of the same loss on those samples alone.
            Not with a data loader (pass a loader over the samples instead).
            Stored as a tuple.
        generator: Random generator that makes MC sampling reproducible. Over a
            data loader, batch ``b`` draws its samples from a generator seeded
            with ``s + b``, ``s`` one draw from ``generator`` (under a process
            group of ``W`` ranks, batch ``b`` of rank ``r`` from ``s + r + W·b``,
            ``s`` rank 0's draw). ``None``: ``s`` is one draw from torch's global
            generator, which it advances, so that every call draws new samples.
        gram_dtype: Floating-point type in which the Gram matrix and every
            product that feeds the eigensolver or the directional derivatives
            (``Vᵀ V``, ``Vᵀ∇ℓ_n``, ``V u``) are accumulated; ``None`` uses the
            model's (its parameters'). ``torch.float64`` for a float32 model
            accumulates the float32 factors in float64: the resolvable spectrum
            then reaches down to float64 rounding (``N·C·ε₆₄·λ_max``) instead of
            ``N·C·ε₃₂·λ_max``, each eigenvalue carrying a relative error of at
            most about ``ε₃₂·√(λ_max/λ)`` from the float32 factors
            (``docs/math.rst``, "Precision and the numerical zero"), for twice
            the memory of the Gram matrix and the kept factors. Gram-space
            results (Gram matrix, eigenvalues, ``γ``, ``λ``) come in
            ``gram_dtype``; parameter-space results (eigenvectors, steps, the
            gradient) in the parameters' dtype.
        route: Where the curvature comes from (:class:`~vivit.LowRankGGN`,
            decided at construction): ``"gram"`` (an engine's factors of ``V``,
            a Gram-space solver), ``"implicit"`` (no ``V``: block Krylov on
            ``G v = Jᵀ H J v`` by a JVP and a VJP through the model), or
            ``"auto"``: the one the plan takes by memory and cost
            (:mod:`vivit.memory.plan`; ``docs/math.rst``, "Choosing the route").
        solver: The Gram route's eigensolver for a few leading eigenpairs
            (``top_k``): ``"auto"`` (by the cost model,
            :mod:`vivit.memory.costs`), ``"dense"`` (LAPACK on the Gram matrix),
            ``"gram_krylov"`` (block Krylov on the Gram matrix) or
            ``"factor_krylov"`` (block Krylov on products with the factors of
            ``V``; the Gram matrix is never formed). A solver by name takes the
            Gram route. Every method that takes ``top_k`` also takes ``solver``
            to override it. Requests for all eigenpairs (``top_k=None``,
            :meth:`~vivit.LowRankGGN.eigvalsh`) decompose the Gram matrix
            densely.
        solver_tol: Relative residual bound ``‖G̃ũ − λũ‖ ≤ tol·λ_max`` of the
            iterative solvers (default ``max(100·ε, 1e-12)`` of the data type);
            a method that takes ``tol`` overrides it per call.
        solver_seed: Seed of the iterative solvers' random start block; the
            results are deterministic for a given seed. A method that takes
            ``seed`` overrides it per call.
        engine: What computes the layer factors (see :doc:`/architecture`):
            ``"backpack"`` (BackPACK's layers, composed by ``nn.Sequential`` or a
            custom forward its converter handles); ``"func"`` (any model whose
            samples are independent: transformers, LSTMs, shared weights,
            GroupNorm); ``"auto"`` picks BackPACK when it supports the model and
            no weight is shared, else func, and logs the choice (logger
            ``"vivit"``, level INFO); or an engine instance (e.g.
            ``vivit.engines.func.FuncEngine(memory_budget=...)``). With
            ``"backpack"``, a layer or function BackPACK cannot backpropagate
            through, or a weight used twice in the forward pass, raises
            :class:`~vivit.UnsupportedLayerError`
            (:class:`~vivit.SharedWeightError`) naming it.
        progress: Progress bar (on stderr) of a pass over a data loader:
            ``True`` always, ``False`` never, ``None`` when stderr is a terminal
            and the pass takes more than two seconds. No bar for one mini-batch.
        process_group: Several processes (``torch.distributed``): each rank
            passes its own shard as ``data`` (one batch, or a loader of any
            number of batches; sizes and numbers may differ across ranks) and
            every rank gets the results of the union of all ranks' samples in
            rank order (rank 0's batches in order, then rank 1's, ...),
            identical on every rank (user guide, "Several processes"). Each
            rank combines its loader's batches into one block before the
            exchange; an empty loader or a malformed batch on one rank raises
            on every rank. ``None`` (default): the default group if
            ``torch.distributed`` is initialised, else this process alone;
            ``False``: this process alone (independent per-rank computations);
            or a ``ProcessGroup``. ``subsampling`` then indexes the rank's own
            batch; a failure on one rank raises on every rank
            (:class:`~vivit.DistributedError` on the others). A
            ``DistributedDataParallel`` model runs as its ``.module``. Not with
            ``chunk_size`` (each rank exchanges its shard as one block). With
            ``route="implicit"`` every rank passes over its own shard in every
            product and the products are summed over the ranks: every call that
            multiplies is then a collective, made by every rank alike
            (``docs/math.rst``, "Implicit products on several processes").
        chunk_size: Most samples per backward pass: the batch (every batch of a
            loader) is split into consecutive chunks of at most this many
            samples, each run by the engine on its own and combined exactly
            (``docs/math.rst``, "Data sets and processes"). Bounds the peak
            memory of the backward pass, which grows with the chunk, not with
            ``N`` (the kept factors and the Gram matrix still grow with ``N``;
            :func:`vivit.memory.estimate_memory` takes ``chunk_size`` too).
            ``None``: the whole batch at once. With Monte-Carlo sampling each
            chunk draws from its own stream (seeded like a loader's batches), so
            chunking changes the draws, not their distribution. Not with a
            process group.
        output: What the loss is computed from when the model returns more than
            a tensor: ``None`` (default; the model must return the output
            tensor), the attribute or key of a structured output (``"logits"``
            of a ``ModelOutput`` or a dict, a named tuple's field), or a
            function of the model's return value (``lambda out: out[0]``;
            :func:`~vivit.engines.base.select_output`). The curvature is that of
            ``loss_func(selected, targets)``. A model that returns anything but
            a tensor without it is refused, naming the type and its fields.
        max_batches: Most batches of a data loader a pass reads (``None``:
            until it ends); the GGN is that of the first ``max_batches`` batches.
            A loader without ``len`` (a generator, a ``DataLoader`` over an
            ``IterableDataset``) cannot say whether it ends; one over an infinite
            stream never does: bound it with ``max_batches``. Without it such a
            pass runs, and its progress bar (``progress=None``: after two
            seconds, terminal or not) says that the loader has no length and how
            to bound it: a finite generator is as valid as a list, so it is not
            refused (user guide, "Data loaders").
        group: The resolved process group (``None``: this process alone); not
            an argument.

    Raises:
        VivitError: When built, for the first option that is malformed
            (:class:`~vivit.InvalidArgumentError`,
            :class:`~vivit.InvalidSubsamplingError`), or for options that do not
            go together.
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
        check_mc_per(self.mc_per)
        check_generator(self.generator)
        check_engine(self.engine)
        check_progress(self.progress)
        check_chunk_size(self.chunk_size)
        check_output_selector(self.output)
        check_max_batches(self.max_batches)
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
        """A copy with some options changed (and checked).

        Args:
            **changes: Options and their new values.

        Returns:
            The new options.

        Raises:
            InvalidArgumentError: For a name that is not an option (``group`` is
                resolved from ``process_group``, not set).
        """
        check_option_names(changes)
        return dataclasses.replace(self, **changes)


def derived(options: CurvatureOptions, **changes: object) -> CurvatureOptions:
    """A copy with options the library derives from checked ones, not checked again.

    Args:
        options: Checked options.
        **changes: Valid values (a subsampling as a tuple; ``process_group``
            ``False``: this process alone).

    Returns:
        The copy.
    """
    copy = object.__new__(CurvatureOptions)
    copy.__dict__.update(options.__dict__, **changes)
    if changes.get("process_group", True) is False:
        copy.__dict__["group"] = None
    return copy


def check_option_names(names: Iterable[str], also: str = "") -> None:
    """Refuse names that are not options of :class:`CurvatureOptions`.

    Args:
        names: The names a caller passed as options.
        also: What else the caller takes, for the message.

    Raises:
        InvalidArgumentError: For a name that is not an option (``group`` is
            resolved from ``process_group``, not set).
    """
    options = {f.name for f in dataclasses.fields(CurvatureOptions) if f.init}
    unknown = sorted(set(names) - options)
    if unknown:
        raise InvalidArgumentError(
            f"Unknown option(s) {unknown}: not options of a curvature request"
            f"{also}; the options are {sorted(options)}."
        )


#: The accepted values of ``route``.
ROUTES = ("auto", "gram", "implicit")


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
    """Refuse the options :class:`~vivit.StreamingGGN` cannot honour, naming them.

    Raises:
        InvalidArgumentError: For a solver that needs the Gram matrix, the
            implicit route, a subsampling or a process group.
    """
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
