"""One-call access to the GGN's low-rank structure of a mini-batch or data set."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_grad_mode
from vivit.distributed import ShardExchange, local_module, resolve_group
from vivit.engines.base import Engine, OutputSelector
from vivit.options import CurvatureOptions
from vivit.results import CurvatureResults
from vivit.sources.collector import GroupCurvature
from vivit.sources.stored import StoredFactors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class LowRankGGN(CurvatureResults):
    """The GGN of a mini-batch through its Gram matrix, from one backward pass.

    Runs the forward and backward pass at construction and keeps, per parameter
    group, the layer factors of ``V``. The Gram matrix ``Vᵀ V`` is formed from them
    when a computation first needs it (never with the matrix-free solver).
    ``model`` and ``loss_func`` are left as they were (whatever hooks an engine
    needs are removed again; hooks the caller installed with ``backpack.extend``
    stay), and so are the ``.grad`` of inputs and parameters.

    An engine computes the factors (see :doc:`/architecture`): ``"backpack"``
    (BackPACK's layers, composed by ``nn.Sequential`` or a custom forward its
    converter handles); ``"func"`` (any model whose samples are independent:
    transformers, LSTMs, shared weights, GroupNorm); ``"auto"`` picks BackPACK when
    it supports the model and no weight is shared, else func, and logs the choice
    (logger ``"vivit"``, level INFO).

    Example::

        ggn = LowRankGGN(model, CrossEntropyLoss(), (X, y))
        evals, evecs = ggn.eigh(top_k=10)

    Args:
        model: The network. BatchNorm and dropout layers must be in eval mode.
            With ``engine="backpack"``, a layer or function BackPACK cannot
            backpropagate through, or a weight used twice in the forward pass,
            raises :class:`~vivit.UnsupportedLayerError`
            (:class:`~vivit.SharedWeightError`) naming it.
        loss_func: A ``torch.nn`` loss module (MSELoss, CrossEntropyLoss,
            BCEWithLogitsLoss) with ``reduction`` ``"mean"`` or ``"sum"``.
        data: ``(inputs, targets)`` of the mini-batch, or an iterable of such
            batches (a ``DataLoader``, a list, a generator): the GGN is then that
            of the loss on all their samples together (for reduction ``"mean"``
            the mean over all samples), from one pass that keeps every batch's
            layer factors; the loss and gradient are those of all samples too
            (``docs/math.rst``, "Data sets and processes"). The memory of the
            stored factors is estimated from the first batch and a loader that
            cannot fit is refused then (:class:`~vivit.FactorsTooLargeError`,
            with the alternatives, among them :class:`~vivit.StreamingGGN`).
        param_groups: Lists of parameters, one GGN block each (block-diagonal
            approximation); ``None`` uses one group with every trainable parameter.
        mc_samples: ``0`` for the exact GGN; ``M > 0`` for its unbiased
            Monte-Carlo estimate with ``M`` samples per datum (``N·M`` instead of
            ``N·C`` Gram rows).
        subsampling: Indices of the samples whose curvature is used (``None``:
            all). The GGN is then that of the same loss on those samples alone.
            Not with a data loader (pass a loader over the samples instead).
        generator: Random generator that makes MC sampling reproducible. Over a
            data loader, batch ``b`` draws its samples from a generator seeded
            with ``s + b``, ``s`` one draw from ``generator`` (under a process
            group of ``W`` ranks, batch ``b`` of rank ``r`` from ``s + r + W·b``,
            ``s`` rank 0's draw). ``None``: ``s`` is one draw from torch's global
            generator, which it advances, so that every call draws new samples.
        gram_dtype: Floating-point type in which the Gram matrix and every
            product that feeds the eigensolver or the directional derivatives
            (``Vᵀ V``, ``Vᵀ∇ℓ_n``, ``V u``) are accumulated; ``None`` uses the
            model's. ``torch.float64`` for a float32 model accumulates the float32
            factors in float64: the resolvable spectrum then reaches down to
            float64 rounding (``N·C·ε₆₄·λ_max``) instead of ``N·C·ε₃₂·λ_max``,
            each eigenvalue carrying a relative error of at most about
            ``ε₃₂·√(λ_max/λ)`` from the float32 factors (``docs/math.rst``,
            "Precision and the numerical zero"), for twice the memory of the
            Gram matrix and the kept factors. Gram-space results
            (Gram matrix, eigenvalues, ``γ``, ``λ``) come in ``gram_dtype``;
            parameter-space results (eigenvectors, steps, the gradient) in the
            parameters' dtype.
        solver: Default eigensolver for a few leading eigenpairs (``top_k``):
            ``"auto"`` (chosen by a cost model, see :mod:`vivit.linalg.top_k`),
            ``"dense"`` (LAPACK on the Gram matrix), ``"iterative"`` (block Krylov
            on the Gram matrix) or ``"matrix_free"`` (block Krylov on products
            with ``V``; the Gram matrix is never formed). Every method that takes
            ``top_k`` also takes ``solver`` to override it. Requests for all
            eigenpairs (``top_k=None``, :meth:`eigvalsh`) always decompose the
            Gram matrix densely.
        solver_tol: Relative residual bound ``‖G̃ũ − λũ‖ ≤ tol·λ_max`` of the
            iterative solvers (default ``max(100·ε, 1e-12)`` of the data type).
        solver_seed: Seed of the iterative solvers' random start block; the
            results are deterministic for a given seed.
        engine: ``"auto"``, ``"backpack"``, ``"func"``, or an engine instance
            (e.g. ``vivit.engines.func.FuncEngine(memory_budget=...)``).
        progress: Progress bar (on stderr) of the pass over a data loader:
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
            on every rank.
            ``None`` (default): the default group if ``torch.distributed`` is
            initialised, else this process alone; ``False``: this process alone
            (independent per-rank computations); or a ``ProcessGroup``.
            ``subsampling`` then indexes the rank's own batch; a failure on one
            rank raises on every rank (:class:`~vivit.DistributedError` on the
            others). The Gram matrices are formed at construction, their blocks
            split over the ranks (not with ``solver="matrix_free"``); nothing
            after the construction communicates. A ``DistributedDataParallel``
            model runs as its ``.module``.
        chunk_size: Most samples per backward pass: the batch (every batch of a
            loader) is split into consecutive chunks of at most this many
            samples, each run by the engine on its own and combined exactly
            (``docs/math.rst``, "Data sets and processes"). Bounds the peak
            memory of the backward pass, which grows with the chunk, not with
            ``N`` (the kept factors and the Gram matrix still grow with ``N``;
            :func:`vivit.memory.estimate_memory` takes ``chunk_size`` too).
            ``None``: the whole batch at once. With Monte-Carlo sampling each
            chunk draws from its own stream (seeded like a loader's batches), so
            chunking changes the draws, not their distribution.
        output: What the loss is computed from when the model returns more than
            a tensor: ``None`` (default; the model must return the output
            tensor), the attribute or key of a structured output (``"logits"``
            of a ``ModelOutput`` or a dict, a named tuple's field), or a
            function of the model's return value (``lambda out: out[0]``). The
            curvature is that of ``loss_func(selected, targets)``. A model that
            returns anything but a tensor without it is refused, naming the
            type and its fields.
        max_batches: Most batches of a data loader the pass reads (``None``:
            until it ends); the GGN is that of the first ``max_batches`` batches.
            A loader without ``len`` (a generator, a ``DataLoader`` over an
            ``IterableDataset``) cannot say whether it ends; one over an infinite
            stream never does: bound it with ``max_batches``. Without it such a
            pass runs, and its progress bar (``progress=None``: after two
            seconds, terminal or not) says that the loader has no length and how
            to bound it: a finite generator is as valid as a list, so it is not
            refused (user guide, "Data loaders").

    Attributes:
        loss: The loss on the mini-batch, or on all samples of a loader
            (detached).
        param_groups: The parameter groups, as lists of parameters.
        engine: Name of the engine that ran (``"backpack"`` or ``"func"``).

        shards: Where each rank's samples sit in the union
            (:class:`~vivit.distributed.ShardLayout`): rows of ``γ``, ``λ`` and
            the Gram matrix that belong to this rank.
        communication: Bytes and time of the exchange between the ranks
            (:class:`~vivit.distributed.ExchangeReport`; zero in one process).

    Raises:
        VivitError: Before the forward pass for malformed arguments (see the
            user guide, "What the library checks"); afterwards for non-finite
            values (:class:`~vivit.NonFiniteError`, naming where they are),
            unsupported loss options or targets, and layers the engine cannot
            handle. Works inside ``torch.no_grad()``; refuses
            ``torch.inference_mode()``. The ``.grad`` of inputs and parameters
            and the random number generators are left as they were.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]],
        *,
        param_groups: Sequence[Sequence[Parameter]] | None = None,
        mc_samples: int = 0,
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        gram_dtype: torch.dtype | None = None,
        solver: str = "auto",
        solver_tol: float | None = None,
        solver_seed: int = 0,
        engine: str | Engine = "auto",
        progress: bool | None = None,
        process_group: ProcessGroup | bool | None = None,
        chunk_size: int | None = None,
        output: OutputSelector = None,
        max_batches: int | None = None,
    ):
        group = resolve_group(process_group)
        with ShardExchange(group) as shards:  # a failure raises on every rank
            check_grad_mode("LowRankGGN")
            options = CurvatureOptions(
                mc_samples=mc_samples,
                subsampling=subsampling,
                generator=generator,
                gram_dtype=gram_dtype,
                solver=solver,
                solver_tol=solver_tol,
                solver_seed=solver_seed,
                engine=engine,
                progress=progress,
                process_group=False if group is None else group,
                chunk_size=chunk_size,
                output=output,
                max_batches=max_batches,
            )
            source = StoredFactors.run(
                local_module(model), loss_func, data, param_groups, options, shards
            )
        self._init(source, options)

    @classmethod
    def from_options(
        cls,
        model: Module,
        loss_func: Module,
        data: tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]],
        param_groups: Sequence[Sequence[Parameter]] | None,
        options: CurvatureOptions,
    ) -> LowRankGGN:
        """Build from options checked before (e.g. once for many mini-batches).

        :class:`~vivit.optim.DampedNewton` checks its options once and builds one
        of these per step.

        Args:
            model: As for the constructor.
            loss_func: As for the constructor.
            data: As for the constructor.
            param_groups: As for the constructor.
            options: The checked options.

        Returns:
            The low-rank GGN.
        """
        with ShardExchange(options.group) as shards:
            check_grad_mode("LowRankGGN")
            source = StoredFactors.run(
                local_module(model), loss_func, data, param_groups, options, shards
            )
        ggn = cls.__new__(cls)
        ggn._init(source, options)
        return ggn

    def _group(self, group: int) -> GroupCurvature:
        """The stored curvature of a group: its factors and batch context."""
        return self._source.group(group).curvature

    def _init(self, source: StoredFactors, options: CurvatureOptions) -> None:
        super().__init__(source, options)
        self.shards = source.shards
        self.communication = source.communication

    @classmethod
    def from_loss(
        cls,
        loss: Tensor | Callable[[], Tensor],
        param_groups: Sequence[Sequence[Parameter]],
        *,
        mc_samples: int = 0,
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        gram_dtype: torch.dtype | None = None,
        solver: str = "auto",
        solver_tol: float | None = None,
        solver_seed: int = 0,
    ) -> LowRankGGN:
        """Build from a loss computed by BackPACK-extended model and loss modules.

        For use where the forward pass happens elsewhere (e.g. an optimizer's
        closure); always uses the BackPACK engine, whose backward pass starts from
        the loss. The caller must have extended the model and the loss function
        with ``backpack.extend``. Engines that need the model (func) take the
        constructor's ``(model, loss_func, data)`` instead.

        Args:
            loss: The mini-batch loss, or a function that computes it.
            param_groups: Lists of parameters, one GGN block each.
            mc_samples: As for the constructor.
            subsampling: As for the constructor.
            generator: As for the constructor.
            gram_dtype: As for the constructor.
            solver: As for the constructor.
            solver_tol: As for the constructor.
            solver_seed: As for the constructor.

        Returns:
            The low-rank GGN of that loss.

        Raises:
            InvalidArgumentError: If ``loss`` is neither a tensor nor a callable.
            GradientContextError: If the loss was computed without gradients.
        """
        check_grad_mode("LowRankGGN.from_loss")
        options = CurvatureOptions(
            mc_samples=mc_samples,
            subsampling=subsampling,
            generator=generator,
            gram_dtype=gram_dtype,
            solver=solver,
            solver_tol=solver_tol,
            solver_seed=solver_seed,
            engine="backpack",
            process_group=False,
        )
        return cls._from_loss(loss, param_groups, options)

    @classmethod
    def _from_loss(
        cls,
        loss: Tensor | Callable[[], Tensor],
        param_groups: Sequence[Sequence[Parameter]],
        options: CurvatureOptions,
    ) -> LowRankGGN:
        """:meth:`from_loss` with options checked before (by ``DampedNewton``).

        Args:
            loss: As for :meth:`from_loss`.
            param_groups: As for :meth:`from_loss`.
            options: The checked options (the engine is BackPACK's).

        Returns:
            The low-rank GGN of that loss.
        """
        from vivit.engines.backpack import BackpackEngine

        source = StoredFactors.from_loss(loss, param_groups, options, BackpackEngine())
        ggn = cls.__new__(cls)
        ggn._init(source, options)
        return ggn
