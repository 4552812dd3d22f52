"""One-call access to the GGN's low-rank structure of a mini-batch or data set."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import (
    check_batch,
    check_chunk_size,
    check_damping,
    check_finite,
    check_generator,
    check_grad_mode,
    check_group_index,
    check_inputs_match,
    check_lr,
    check_max_decrease,
    check_mc_samples,
    check_model,
    check_params,
    check_subsampling,
    param_group_lists,
)
from vivit.directional import gram_space
from vivit.directional.gram_space import (
    Damping,
    damped_newton_step,
)
from vivit.directional.results import DirectionalDerivatives, NewtonStep
from vivit.distributed import (
    SAMPLE_SHAPE,
    ShardExchange,
    ShardLayout,
    local_module,
    request_fingerprint,
    resolve_group,
)
from vivit.engines.base import CurvatureRequest, Engine, EngineOutput
from vivit.engines.choice import check_engine, resolve_engine
from vivit.errors import GramTooLargeError, InvalidArgumentError
from vivit.gram.memory import check_gram_fits, dense_workspace_bytes
from vivit.linalg.group_products import group_gram, num_params
from vivit.linalg.iterative import SolverReport, check_seed, check_tolerance
from vivit.linalg.operator import GGNOperator
from vivit.linalg.solvers import (
    check_gram_dtype,
    gram_eigh,
    gram_to_param,
    numerical_zero_tolerance,
    top_k_indices,
)
from vivit.linalg.top_k import (
    check_solver,
    choose_solver,
    iterative_workspace_bytes,
    leading_eigenpairs,
)
from vivit.losses import check_loss_function
from vivit.memory.budget import FactorBudget
from vivit.sources.batches import (
    BlockResult,
    BlockRun,
    check_progress,
    engine_context,
    is_batch,
    iterate_batches,
    naming_batch,
    num_batches,
    progress_bar,
    run_block,
)
from vivit.sources.blocks import (
    UnionOutput,
    block_requests,
    combine_curvatures,
    merged_blocks,
)
from vivit.sources.chunks import SampleChunk, run_chunk, split_batch
from vivit.sources.collector import GroupCurvature

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class LowRankGGN:
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
    ):
        with ShardExchange(resolve_group(process_group)) as shards:
            check_grad_mode("LowRankGGN")
            self._configure_solver(solver, solver_tol, solver_seed)
            self._construct(
                local_module(model),
                loss_func,
                data,
                shards,
                param_groups=param_groups,
                mc_samples=mc_samples,
                subsampling=subsampling,
                generator=generator,
                gram_dtype=gram_dtype,
                engine=engine,
                progress=progress,
                chunk_size=chunk_size,
            )

    def _construct(
        self,
        model: Module,
        loss_func: Module,
        data: object,
        shards: ShardExchange,
        *,
        param_groups: Sequence[Sequence[Parameter]] | None,
        mc_samples: int,
        subsampling: Sequence[int] | None,
        generator: torch.Generator | None,
        gram_dtype: torch.dtype | None,
        engine: str | Engine,
        progress: bool | None,
        chunk_size: int | None,
    ) -> None:
        """Check the arguments, run the engine on every block, combine them."""
        check_model(model)
        check_loss_function(loss_func)
        single = is_batch(data)
        if single:
            data = check_batch(data)
        elif subsampling is not None:
            raise InvalidArgumentError(
                "subsampling selects samples of one mini-batch; with a data loader, "
                "pass a loader over the samples whose curvature you want."
            )
        param_groups = param_group_lists(param_groups, model)
        names = {id(p): f"parameter {n!r}" for n, p in model.named_parameters()}
        check_params([p for group in param_groups for p in group], names)
        if single:
            check_inputs_match(data[0], list(model.parameters()))
            check_subsampling(subsampling, data[0].shape[0])
        check_gram_dtype(gram_dtype)
        check_mc_samples(mc_samples)
        check_generator(generator)
        check_engine(engine)
        check_progress(progress)
        check_chunk_size(chunk_size)
        request = self._request(
            param_groups, mc_samples, subsampling, generator, gram_dtype
        )
        chosen = resolve_engine(engine, model, loss_func)
        if chunk_size is not None and shards.group is not None:
            raise InvalidArgumentError(
                "chunk_size is not supported with a process group (each rank "
                "exchanges its shard as one block): pass smaller shards, more "
                "ranks, or process_group=False for per-rank computations."
            )
        fingerprint = request_fingerprint(
            loss_func,
            param_groups,
            model if shards.group is not None else None,  # checksums: ranks only
            mc_samples=mc_samples,
            gram_dtype=gram_dtype,
            solver=(self._solver, self._solver_tol, self._solver_seed),
            engine=chosen.name,
            # a loader's is compared after its pass, in the exchange
            **{SAMPLE_SHAPE: tuple(data[1].shape[1:]) if single else None},
        )
        blocks_request = block_requests(
            request, lambda seed: shards.agree(fingerprint, seed)
        )

        def chunk_run(index: int, chunk: SampleChunk) -> BlockRun:
            block_request = dataclasses.replace(
                blocks_request(index), subsampling=chunk.subsampling
            )
            return lambda sink: run_chunk(
                chosen, model, loss_func, chunk, block_request, sink
            )

        budget = (
            None
            if single
            else FactorBudget(
                num_batches(data), model, mc_samples, request.num_grams, chunk_size
            )
        )
        batches = (
            [data]
            if single
            else progress_bar(
                iterate_batches(data, model)
                if budget is None
                else budget.watch(iterate_batches(data, model)),
                num_batches(data),
                progress,
                "LowRankGGN: pass over the data",
            )
        )
        sample_shapes: list[tuple[int, ...]] = []  # the first batch's targets'
        batches = _recording_shape(batches, sample_shapes)
        chunks = (
            (None if single else batch_index, chunk)
            for batch_index, batch in enumerate(batches)
            for chunk in split_batch(batch, chunk_size, request.subsampling)
        )
        # MC: block b of rank r draws from stream r + W·b (docs/math.rst,
        # "Several processes"); in one process from stream b
        runs = (
            (batch_index, chunk_run(shards.rank + shards.world_size * index, chunk))
            for index, (batch_index, chunk) in enumerate(chunks)
        )
        self._run(
            chosen.name,
            runs,
            names,
            budget,
            shards,
            sample_shapes,
            request.subsampling,
        )

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
        if isinstance(loss, Module) or not (isinstance(loss, Tensor) or callable(loss)):
            raise InvalidArgumentError(
                f"loss must be the loss tensor or a function that computes it, got "
                f"{type(loss).__name__}; for a model and a loss module use "
                "LowRankGGN(model, loss_func, (inputs, targets))."
            )
        param_groups = param_group_lists(param_groups)
        check_params([p for group in param_groups for p in group], {})
        check_subsampling(subsampling)
        check_mc_samples(mc_samples)
        check_generator(generator)
        check_gram_dtype(gram_dtype)
        from vivit.engines.backpack import BackpackEngine

        ggn = cls.__new__(cls)
        ggn._configure_solver(solver, solver_tol, solver_seed)
        request = ggn._request(
            param_groups, mc_samples, subsampling, generator, gram_dtype
        )
        request = block_requests(request)(0)  # MC: a batch's stream, as in __init__
        compute_loss = loss if callable(loss) else lambda: loss
        ggn._run(
            BackpackEngine.name,
            [
                (
                    None,
                    lambda sink: BackpackEngine().run_loss(compute_loss, request, sink),
                )
            ],
            {},
        )
        return ggn

    def _configure_solver(
        self, solver: str, solver_tol: float | None, solver_seed: int
    ) -> None:
        check_solver(solver)
        check_tolerance(solver_tol, "solver_tol")
        check_seed(solver_seed, "solver_seed")
        self._solver = solver
        self._solver_tol = solver_tol
        self._solver_seed = solver_seed

    def _request(
        self,
        param_groups: list[list[Parameter]],
        mc_samples: int,
        subsampling: Sequence[int] | None,
        generator: torch.Generator | None,
        gram_dtype: torch.dtype | None,
    ) -> CurvatureRequest:
        """Describe what the engine must compute (the arguments are validated)."""
        self.param_groups = param_groups
        self._gram_dtype = gram_dtype
        return CurvatureRequest(
            param_groups=self.param_groups,
            mc_samples=mc_samples,
            subsampling=check_subsampling(subsampling),
            generator=generator,
            compute_gradients=True,
            # the dense solver needs every Gram: refuse before the backward pass;
            # others form them on demand, checked then (see _formed_gram)
            num_grams=len(self.param_groups) if self._solver == "dense" else 0,
            gram_dtype=gram_dtype,
        )

    def _run(
        self,
        engine: str,
        runs: Iterable[tuple[int | None, BlockRun]],
        names: dict[int, str],
        budget: FactorBudget | None = None,
        shards: ShardExchange | None = None,
        sample_shapes: Sequence[tuple[int, ...]] = (),
        subsampling: Sequence[int] | None = None,
    ) -> None:
        """Run an engine into the group pipeline, block by block of samples.

        Each run computes one block of samples (a mini-batch, a loader's batch or
        a chunk of either, this rank's shard); with a process group (``shards``)
        every rank's block is exchanged. The blocks' curvature, losses and
        gradients are combined into those of the loss on all samples together.
        The random number generators are forked (the caller's state is left as
        it was) and gradients are enabled whatever the caller's context. Each
        run comes with the index of the loader's batch it belongs to (``None``
        for one mini-batch), which an error it raises names. With a ``budget``
        the stored factors are checked against the memory after every block.
        ``sample_shapes`` holds the targets' shape per sample once the first
        block has run (compared across the ranks). This process's blocks are
        merged into one set of factors per parameter (``subsampling`` gives the
        order of their GGN samples, :func:`~vivit.sources.blocks.merged_blocks`); under
        a process group that is the rank's one block in the exchange.
        """
        self.engine = engine
        self._decompositions: dict[int, tuple[Tensor, Tensor]] = {}
        self._leading: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        self._reports: dict[int, SolverReport] = {}
        shards = shards or ShardExchange(None)
        blocks: list[list[GroupCurvature]] = []
        union = UnionOutput()
        with engine_context(self.param_groups):
            for batch, run in runs:
                with nullcontext() if batch is None else naming_batch(batch):
                    block = run_block(run, self.param_groups, self._gram_dtype)
                if budget:
                    budget.admit(block.curvature, batch)
                union.add(block.curvature[0].batch, block.output)
                blocks.append(block.curvature)
                del block  # the list holds the factors (released when merged)
            loss, gradients = union.result()  # refuses a loader without batches
        curvature = merged_blocks(blocks, subsampling)
        if shards.group is not None:
            # this rank's samples as one block; then every rank's, in rank order
            local = BlockResult(curvature, EngineOutput(loss, gradients))
            union = UnionOutput()
            exchanged = shards.exchange([local], self.param_groups, sample_shapes[0])
            for result in exchanged:
                union.add(result.curvature[0].batch, result.output)
            loss, gradients = union.result()
            curvature = combine_curvatures([result.curvature for result in exchanged])
        self.shards = ShardLayout.of_batches(
            union.batches, shards.rank, shards.world_size
        )
        self.communication = shards.report
        self.loss = loss
        self._curvature = curvature
        gradients = iter(gradients)
        self._gradients = [[next(gradients) for _ in g] for g in self.param_groups]
        for group, gradients in zip(self.param_groups, self._gradients, strict=True):
            for param, gradient in zip(group, gradients, strict=True):
                name = names.get(id(param), f"parameter of shape {tuple(param.shape)}")
                check_finite(
                    gradient,
                    f"backpropagated gradient of the {name} (non-finite inputs, or "
                    "an overflow in the backward pass)",
                    batch_axis=False,
                )
        if shards.group is not None:
            self._form_grams_together(shards)

    def _form_grams_together(self, shards: ShardExchange) -> None:
        """Under a process group, form the Gram matrices now, split over the ranks.

        Every rank forms its share of each group's Gram blocks
        (:meth:`~vivit.distributed.ShardExchange.gram`), so no later call needs
        a collective. Skipped for the matrix-free solver and for groups whose
        Gram matrix does not fit on some rank (formed there on demand).
        """
        if self._solver == "matrix_free":
            return
        fits = []
        for group in range(len(self.param_groups)):
            try:
                check_gram_fits(self._size(group), 1, *self._gram_space(group), 0)
                fits.append(True)
            except GramTooLargeError:
                fits.append(False)
        for group, fit in enumerate(shards.all_true(fits)):
            if fit:
                self._set_gram(group, shards.gram(self._group(group).ggn_factors))

    # Gram space ---------------------------------------------------------------
    def _group(self, group: int) -> GroupCurvature:
        check_group_index(group, len(self.param_groups))
        return self._curvature[group]

    def gram(self, group: int = 0) -> Tensor:
        """The Gram matrix ``Vᵀ V`` of a group (formed on the first call).

        Args:
            group: Index of the parameter group.

        Returns:
            ``[N·C, N·C]`` (``N·M`` with MC), rows and columns ordered sample-major:
            entry ``n·C + c`` is output ``c`` of sample ``n`` (of the subsampling).

        Raises:
            GramTooLargeError: If it would not fit into memory.
        """
        return self._formed_gram(group, workspace_bytes=0)

    def _formed_gram(self, group: int, workspace_bytes: int) -> Tensor:
        """The group's Gram matrix, formed from the factors if it does not exist.

        Refuses to form it if it and ``workspace_bytes`` would not fit into memory.
        """
        curvature = self._group(group)
        if curvature.gram is None:
            dtype, device = self._gram_space(group)
            check_gram_fits(self._size(group), 1, dtype, device, workspace_bytes)
            self._set_gram(group, group_gram(curvature.ggn_factors))
        return curvature.gram

    def _set_gram(self, group: int, gram: Tensor) -> None:
        """Keep a group's formed Gram matrix (refused if not finite)."""
        check_finite(
            gram,
            f"Gram matrix of group {group} (backpropagated factors overflowed; "
            "rescale the inputs or use float64)",
            batch_axis=False,
        )
        self._group(group).gram = gram

    def _size(self, group: int) -> int:
        """Side length ``N·C`` of the group's Gram matrix."""
        return self._group(group).ggn_factors[0].num_rows

    def _gram_space(self, group: int) -> tuple[torch.dtype, torch.device]:
        """Type (``gram_dtype``) and device of the group's Gram-space products."""
        dtype = self._group(group).ggn_factors[0].dtype
        return dtype, self.param_groups[group][0].device

    def _gram_eigh(self, group: int) -> tuple[Tensor, Tensor]:
        self._group(group)
        if group not in self._decompositions:
            workspace = dense_workspace_bytes(
                self._size(group), None, *self._gram_space(group)
            )
            self._decompositions[group] = gram_eigh(self._formed_gram(group, workspace))
        return self._decompositions[group]

    def eigvalsh(self, group: int = 0) -> Tensor:
        """All eigenvalues of the Gram matrix: the GGN's non-zero spectrum.

        Args:
            group: Index of the parameter group.

        Returns:
            ``[N·C]`` eigenvalues, ascending (those below the numerical-zero
            tolerance are zeros of the GGN).
        """
        return self._gram_eigh(group)[0]

    def zero_tolerance(self, group: int = 0) -> float:
        """Eigenvalues at or below this value are numerically zero.

        ``N·C · ε_gram · λ_max + ε_model² · tr(G̃)``: follows ``gram_dtype``
        (``docs/math.rst``, "Precision and the numerical zero").

        Args:
            group: Index of the parameter group.

        Returns:
            The tolerance of the group's Gram matrix.
        """
        return numerical_zero_tolerance(
            self.eigvalsh(group), factor_dtype=self._group(group).factor_dtype
        )

    def solver_report(self, group: int = 0) -> SolverReport | None:
        """How the group's latest leading eigenpairs were computed.

        Args:
            group: Index of the parameter group.

        Returns:
            The solver used, its relative residual ``max_k ‖G̃ũ_k − λ_kũ_k‖ /
            λ_max`` and tolerance, iterations and any fallback; ``None`` before the
            first request with ``top_k`` (full decompositions are LAPACK's).
        """
        self._group(group)
        return self._reports.get(group)

    def _resolve_solver(self, solver: str, top_k: int, group: int) -> str:
        """The solver ``"auto"`` stands for (any other name is returned as is)."""
        if solver != "auto":
            return solver
        dtype, device = self._gram_space(group)
        return choose_solver(
            self._size(group),
            top_k,
            num_params=num_params(self._group(group).ggn_factors),
            dtype=dtype,
            device=device,
            gram_formed=self._group(group).gram is not None,
            factors=self._group(group).ggn_factors,
        )

    def _directions(
        self, top_k: int | None, group: int, solver: str | None = None
    ) -> tuple[Tensor, Tensor]:
        """The ``top_k`` leading numerically non-zero eigenpairs of the Gram matrix.

        Uses the full decomposition if it is needed, or exists and the solver is
        ``"auto"``; otherwise computes (and caches per solver) only the leading
        eigenpairs.
        """
        if solver is None:  # the default applies to requests for a few pairs
            solver = "auto" if top_k is None else self._solver
        check_solver(solver, top_k)
        self._group(group)
        size = self._size(group)
        if top_k is None or (solver == "auto" and group in self._decompositions):
            evals, evecs = self._gram_eigh(group)
        else:
            resolved = self._resolve_solver(solver, top_k, group)
            leading = self._leading.get((group, resolved))
            if leading is None or leading[0].numel() < min(top_k, size):
                leading = self._compute_leading(group, top_k, resolved, solver)
                self._leading[(group, resolved)] = leading
            evals, evecs = leading
        curvature = self._group(group)
        # without the Gram matrix, tr(G̃) is bounded by N·C·λ_max
        trace = None if curvature.gram is None else curvature.gram.trace().item()
        keep = top_k_indices(evals, top_k, size, curvature.factor_dtype, trace)
        return evals[keep], evecs[:, keep]

    def _compute_leading(
        self, group: int, top_k: int, solver: str, requested: str
    ) -> tuple[Tensor, Tensor]:
        dtype, device = self._gram_space(group)
        size = self._size(group)
        if solver == "dense":
            workspace = dense_workspace_bytes(size, top_k, dtype, device)
        else:
            workspace = iterative_workspace_bytes(size, top_k, dtype)
        evals, evecs, report = leading_eigenpairs(
            self._group(group).ggn_factors,
            top_k,
            solver,
            lambda: self._formed_gram(group, workspace),
            requested=requested,
            dtype=dtype,
            device=device,
            tol=self._solver_tol,
            seed=self._solver_seed,
        )
        self._reports[group] = report
        return evals, evecs

    def eigh(
        self, top_k: int | None = None, group: int = 0, *, solver: str | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """Leading eigenpairs of the GGN.

        Args:
            top_k: Number of leading eigenpairs; ``None`` keeps every eigenvalue
                above the numerical-zero tolerance. Fewer are returned if fewer
                are non-zero; no eigenvector is formed for a numerically zero one.
            group: Index of the parameter group.
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).

        Returns:
            Eigenvalues ``[K]`` ascending, and eigenvectors as one tensor
            ``[K, *p.shape]`` per parameter of the group (unit norm over the group).
        """
        evals, gram_evecs = self._directions(top_k, group, solver)
        curvature = self._group(group)
        evecs = gram_to_param(curvature.ggn_factors, gram_evecs, evals)
        return evals, curvature.in_param_dtypes(evecs)

    def operator(self, group: int = 0) -> GGNOperator:
        """The group's GGN as a linear operator: ``G·v``, ``G⁺·v``, scipy.

        Products go through the factors of ``V``; ``G`` is never formed. See
        :class:`~vivit.linalg.operator.GGNOperator`.

        Example::

            from scipy.sparse.linalg import eigsh

            op = ggn.operator()
            Gv = op.matvec(v)                   # v: [D] over the group's parameters
            step = op.pinv_matvec(g, top_k=10)  # G⁺ on the top-10 eigenspace
            evals = eigsh(op.to_scipy(), k=3, return_eigenvectors=False)

        Args:
            group: Index of the parameter group.

        Returns:
            The operator, of shape ``(D, D)`` with ``D`` the group's parameters.
        """
        curvature = self._group(group)
        return GGNOperator(
            curvature.ggn_factors,
            self.param_groups[group],
            lambda top_k, solver: self._directions(top_k, group, solver),
        )

    # Gradient and directional derivatives -----------------------------------
    def gradient(self, group: int = 0) -> list[Tensor]:
        """The gradient ``∇L`` of the loss from the same backward pass(es).

        Args:
            group: Index of the parameter group.

        Returns:
            One tensor per parameter of the group, shaped like it (gradient of the
            loss on the whole mini-batch, whatever the curvature subsampling).
        """
        self._group(group)
        return self._gradients[group]

    def _vt_grads(self, group: int, subsampling_grad: Sequence[int] | None) -> Tensor:
        """``Vᵀ∇ℓ_n`` of the gradient samples, ``[N·C, N_grad]``, cached per samples."""
        return self._group(group).gradient_products(subsampling_grad)

    def _directional(
        self,
        top_k: int | None,
        group: int,
        subsampling_grad: Sequence[int] | None,
        solver: str | None,
    ) -> tuple[Tensor, DirectionalDerivatives]:
        evals, gram_evecs = self._directions(top_k, group, solver)
        vt_grads = self._vt_grads(group, subsampling_grad)
        batch = self._group(group).batch
        directional = gram_space.directional_derivatives(
            vt_grads, gram_evecs, evals, batch, subsampling_grad
        )
        return gram_evecs, directional

    def directional_derivatives(
        self,
        top_k: int | None = None,
        group: int = 0,
        subsampling_grad: Sequence[int] | None = None,
        *,
        solver: str | None = None,
    ) -> DirectionalDerivatives:
        """Per-sample first and second derivatives along the leading eigenvectors.

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).

        Returns:
            ``γ [N_grad, K]``, ``λ [N_ggn, K]`` and their per-direction statistics.
        """
        return self._directional(top_k, group, subsampling_grad, solver)[1]

    def newton(
        self,
        top_k: int | None = None,
        group: int = 0,
        damping: float | Damping = 1.0,
        subsampling_grad: Sequence[int] | None = None,
        *,
        lr: float = 1.0,
        max_decrease: float | None = None,
        solver: str | None = None,
    ) -> NewtonStep:
        """The directionally damped Newton step with its ingredients.

        ``Δθ = −Σ_k γ̄_k / (λ_k + δ_k) e_k`` over the leading eigenvectors, with
        ``γ̄_k`` the directional gradient of the loss on the gradient samples. The
        step is one product of ``V`` with a Gram-space vector. A step to which no
        direction contributes is zero and warns (:class:`~vivit.ZeroStepWarning`).

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            damping: A constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs,
                gammas, lambdas) → [K]`` (see :mod:`vivit.optim.damping`).
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).
            lr: Scale of the returned step, ``lr · Δθ``.
            max_decrease: Largest loss decrease the GGN's quadratic model may
                predict for ``lr · Δθ``; the dampings are raised to meet it as
                ``docs/math.rst`` derives ("Trust region of a Newton step").
                ``None``: the dampings as the rule gives them.
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).

        Returns:
            The step, the directional derivatives, ``γ̄`` and the dampings used.

        Raises:
            InvalidArgumentError: If ``lr`` is not a positive finite number,
                ``max_decrease`` not ``None`` or a number ``≥ 0``, or the damping
                invalid.
        """
        check_damping(damping)
        check_lr(lr)
        check_max_decrease(max_decrease)
        gram_evecs, directional = self._directional(
            top_k, group, subsampling_grad, solver
        )
        curvature = self._group(group)
        newton = damped_newton_step(
            curvature.ggn_factors,
            gram_evecs,
            directional,
            damping,
            lr=lr,
            max_decrease=max_decrease,
        )
        return dataclasses.replace(newton, step=curvature.in_param_dtypes(newton.step))

    def newton_step(
        self,
        top_k: int | None = None,
        group: int = 0,
        damping: float | Damping = 1.0,
        subsampling_grad: Sequence[int] | None = None,
        *,
        solver: str | None = None,
    ) -> list[Tensor]:
        """The directionally damped Newton step on the leading eigenspace.

        Args:
            top_k: Number of leading directions (``None``: all non-zero).
            group: Index of the parameter group.
            damping: A constant ``δ ≥ 0`` or a callable ``(evals, gram_evecs,
                gammas, lambdas) → [K]`` (see :mod:`vivit.optim.damping`).
            subsampling_grad: Samples whose gradients give ``γ`` (``None``: all).
            solver: Eigensolver for ``top_k`` pairs (``None``: the constructor's).

        Returns:
            The step (see :meth:`newton`), one tensor per parameter, shaped like it.
        """
        return self.newton(top_k, group, damping, subsampling_grad, solver=solver).step


def _recording_shape(
    batches: Iterable[tuple[Tensor, Tensor]], shapes: list[tuple[int, ...]]
) -> Iterator[tuple[Tensor, Tensor]]:
    """The batches; the first one's targets' shape per sample goes into ``shapes``."""
    for batch in batches:
        if not shapes:
            shapes.append(tuple(batch[1].shape[1:]))
        yield batch
