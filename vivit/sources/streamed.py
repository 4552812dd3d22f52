"""Streamed factors: every product recomputes the factors in passes over a loader.

The source of :class:`~vivit.StreamingGGN`. It stores no factors of ``V``: each
product with the Gram matrix recomputes every block's factors
(``docs/math.rst``, "Data sets and processes")::

    G̃ U = concat_b V_bᵀ W,   W = Σ_b' V_b' U_b'

two passes over the loader per product (the first accumulates ``W`` in parameter
space, the second maps it back block by block). A block is a loader's batch, or a
chunk of one (``chunk_size``). Every pass must see the same batches: each batch's
inputs and targets are fingerprinted in the first pass and checked in every later
one (:class:`BatchFingerprints`); every pass starts from the random state at
construction, and a model whose parameters or buffers changed is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import (
    check_batch,
    check_grad_mode,
)
from vivit.engines.base import CurvatureRequest, Engine
from vivit.engines.choice import resolve_engine
from vivit.errors import (
    InvalidArgumentError,
    ModelChangedError,
    NondeterministicDataError,
)
from vivit.gram import ParamFactors
from vivit.linalg.group_products import v_matmul, vt_matmul
from vivit.model_inputs import ModelInputs, input_tensors
from vivit.options import CurvatureOptions
from vivit.sources.base import CurvatureSource
from vivit.sources.batches import (
    BlockResult,
    RandomState,
    check_batched,
    engine_context,
    is_batch,
    iterate_batches,
    naming_batch,
    num_batches,
    progress_bar,
    run_block,
)
from vivit.sources.blocks import UnionOutput, block_requests, block_scale, union_batch
from vivit.sources.chunks import run_chunk, split_batch
from vivit.sources.collector import checked_param_groups


def fingerprint(batch: Sequence[Tensor]) -> str:
    """A digest of tensors: shapes, types and every byte.

    Args:
        batch: The tensors, e.g. ``(inputs, targets)``.

    Returns:
        The hexadecimal BLAKE2b digest.
    """
    digest = hashlib.blake2b(digest_size=16)
    for tensor in batch:
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype};".encode())
        data = tensor.detach().contiguous().cpu().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(model: Module) -> str:
    """A digest of the model's parameters and buffers (:func:`fingerprint`).

    Args:
        model: The model.

    Returns:
        The hexadecimal digest.
    """
    state = model.state_dict()
    return fingerprint([value for value in state.values() if isinstance(value, Tensor)])


class BatchFingerprints:
    """Checks that every pass over a loader yields the same batches.

    The first pass records each batch's :func:`fingerprint`; later passes must
    yield batches with the same fingerprints, and as many.
    """

    def __init__(self) -> None:
        self._first: list[str] = []
        self._pass = 0

    def check(self, batches: Iterable[tuple[ModelInputs, Tensor]]) -> Iterator:
        """The batches of one pass, each checked against the first pass.

        Args:
            batches: The pass's batches.

        Yields:
            The batches, unchanged.

        Raises:
            NondeterministicDataError: If a batch differs from the same batch of
                the first pass, or the pass has another number of batches.
        """
        self._pass += 1
        count = 0
        for index, batch in enumerate(batches):
            inputs, targets = batch
            digest = fingerprint([*input_tensors(inputs), targets])
            if self._pass == 1:
                self._first.append(digest)
            elif index >= len(self._first) or digest != self._first[index]:
                raise NondeterministicDataError(
                    f"Batch {index} of the data loader differs between pass 1 and "
                    f"pass {self._pass}"
                    + (
                        f" (pass 1 had only {len(self._first)} batches)"
                        if index >= len(self._first)
                        else ""
                    )
                    + ": streaming combines every batch of every pass, so the "
                    "loader must yield the same batches in the same order each "
                    "time. Use DataLoader(..., shuffle=False) without random "
                    "transforms (or a fixed list of batches), and do not change "
                    "its tensors in place after construction (normalise or "
                    "augment a copy): a batch changed in place since pass 1 is "
                    "refused, never used."
                )
            count += 1
            yield batch
        if self._pass > 1 and count != len(self._first):
            raise NondeterministicDataError(
                f"The data loader yielded {count} batches in pass {self._pass} but "
                f"{len(self._first)} in pass 1; streaming needs the same batches "
                "in every pass."
            )


class StreamedGroup:
    """One group's products by passes (a :class:`~vivit.sources.base.GroupSource`).

    Its :attr:`products` are the group itself: ``V·u`` and ``Vᵀ·w`` take one pass
    over the data each, ``G̃·U`` two.

    Args:
        source: The streamed source.
        index: Position of the group.
    """

    route = "streaming"
    keeps_directions = True
    parameter_space = False

    def __init__(self, source: StreamedFactors, index: int):
        self._source = source
        self.index = index
        self.params = source.param_groups[index]
        self.gradient = source.gradients[index]
        self.batch = source.union
        self.factor_dtype = source.factor_dtypes[index]
        self.dtype = source.dtypes[index]
        self.device = self.params[0].device
        self.num_rows = source.num_rows
        self.products = self

    def formed_gram(self) -> Tensor | None:  # noqa: D102
        return None

    def form_gram(self, workspace_bytes: int) -> Tensor:  # noqa: D102
        raise InvalidArgumentError(
            "StreamingGGN never forms the Gram matrix (it keeps no factors), so it "
            "computes a few leading eigenpairs: pass top_k (e.g. eigh(top_k=10)), "
            "or build a LowRankGGN over the loader if its factors fit into memory."
        )

    def choose_solver(self, top_k: int) -> str:  # noqa: D102
        return "matrix_free"

    def check_solver(self, solver: str) -> None:  # noqa: D102
        _check_streamable_solver(solver)

    def directional_gradients(  # noqa: D102
        self,
        gram_evecs: Tensor,
        evals: Tensor,
        evecs: Callable[[], list[Tensor]],
        samples: Sequence[int] | None,
    ) -> Tensor:
        if evals.numel() == 0:
            gammas = evals.new_zeros(self.batch.batch_size, 0)
        else:
            directions = evecs()
            blocks: list[Tensor] = []

            def visit(index: int, block: BlockResult) -> None:
                grads = block.curvature[self.index].grad_factors
                blocks.append(vt_matmul(grads, directions))

            self._source.run_pass(visit, "directional gradients", gradients=True)
            gammas = torch.cat(blocks, dim=1).T
        return gammas if samples is None else gammas[list(samples)]

    def v_matmul(self, coefficients: Tensor) -> list[Tensor]:
        """``V u = Σ_b V_b u_b`` for Gram-space rows ``[K, N·C]``: one pass.

        Args:
            coefficients: ``[K, N·C]``.

        Returns:
            One tensor ``[K, *p.shape]`` per parameter.
        """
        bounds = self._source.bounds
        result: list[Tensor] = []

        def visit(index: int, factors: list[ParamFactors]) -> None:
            rows = coefficients[:, bounds[index] : bounds[index + 1]]
            products = v_matmul(factors, rows)
            if not result:
                result.extend(products)
            else:
                for total, product in zip(result, products, strict=True):
                    total.add_(product)

        self._factors_pass(visit, "V·u")
        return result

    def vt_matmul(self, vectors: Sequence[Tensor]) -> Tensor:
        """``Vᵀ W`` (rows ``[K, N·C]``) for parameter-space vectors: one pass.

        Args:
            vectors: One tensor ``[K, *p.shape]`` per parameter.

        Returns:
            ``[K, N·C]``.
        """
        blocks: list[Tensor] = []
        self._factors_pass(
            lambda index, factors: blocks.append(vt_matmul(factors, vectors)), "Vᵀ·w"
        )
        return torch.cat(blocks, dim=1)

    def gram_matmul(self, vectors: Tensor) -> Tensor:
        """``G̃ U = Vᵀ (V U)``: two passes.

        Args:
            vectors: ``U``, ``[N·C, K]``.

        Returns:
            ``[N·C, K]``.
        """
        return self.vt_matmul(self.v_matmul(vectors.T.contiguous())).T

    def _factors_pass(
        self, visit: Callable[[int, list[ParamFactors]], None], what: str
    ) -> None:
        """A pass handing every block's factors of the group (rescaled) to ``visit``."""
        scales = self._source.scales

        def visit_block(index: int, block: BlockResult) -> None:
            factors = block.curvature[self.index].ggn_factors
            visit(index, [f.scaled(scales[index]) for f in factors])

        self._source.run_pass(visit_block, what)


class StreamedFactors(CurvatureSource):
    """Factors recomputed in every pass over a re-iterable loader (a source).

    The construction makes one pass (loss, gradient, each block's
    normalization); every product makes more (:class:`StreamedGroup`).

    Args:
        model: The network.
        loss_func: The loss module.
        data: A re-iterable loader of ``(inputs, targets)`` batches, or one batch.
        param_groups: Lists of parameters (``None``: every trainable one).
        options: The checked options.

    Attributes:
        param_groups: The parameter groups.
        loss: The loss on all samples (detached).
        engine: Name of the engine.
        passes: Passes over the data made so far.

    Raises:
        InvalidArgumentError: For an iterator or generator (passed over once), a
            solver that needs the Gram matrix, a curvature subsampling or a
            process group.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: object,
        param_groups: Sequence[Sequence[Parameter]] | None,
        options: CurvatureOptions,
    ):
        self.param_groups, _ = checked_param_groups(model, loss_func, param_groups)
        if is_batch(data):
            check_batched(data, model)
            data = [check_batch(data)]
        elif isinstance(data, Iterator):
            raise InvalidArgumentError(
                "StreamingGGN passes over the data many times, but an iterator or "
                f"generator ({type(data).__name__}) can be passed over once: pass "
                "a list of batches or a DataLoader."
            )
        _check_streamable(options)
        engine = resolve_engine(options.engine, model, loss_func, options.output)
        self.engine = engine.name
        self.passes = 0
        self._model, self._data, self._options = model, data, options
        self._fingerprints = BatchFingerprints()
        self._runner = _block_runner(
            model, loss_func, engine, self.param_groups, options
        )
        # every pass draws what the first did (Dropout masks in training mode)
        self._random_start = RandomState.capture(self.param_groups)
        self._model_state = model_fingerprint(model)
        self._first_pass()
        self.groups = [StreamedGroup(self, g) for g in range(len(self.param_groups))]

    @property
    def num_rows(self) -> int:
        """Side length ``N·C`` (``N·M`` with MC) of the Gram matrix, all batches."""
        return self.bounds[-1]

    def run_pass(
        self,
        visit: Callable[[int, BlockResult], None],
        description: str,
        gradients: bool = False,
    ) -> None:
        """One pass: runs the engine on every block and hands its result on.

        Args:
            visit: Called with each block's index and result.
            description: What the pass computes (its progress bar's text).
            gradients: Keep the blocks' per-sample-gradient factors.

        Raises:
            GradientContextError: Inside ``torch.inference_mode()`` (every pass
                runs a backward pass).
            ModelChangedError: If the model changed since construction.
            NondeterministicDataError: If the loader yields other batches.
        """
        check_grad_mode("StreamingGGN")
        self._check_model_unchanged()
        self.passes += 1
        max_batches = self._options.max_batches
        batches = self._fingerprints.check(
            iterate_batches(self._data, self._model, max_batches)
        )
        batches = progress_bar(
            batches,
            num_batches(self._data, max_batches),
            self._options.progress,
            f"StreamingGGN: pass {self.passes} ({description})",
        )
        index = 0
        with engine_context(self.param_groups, self._random_start):
            for batch_index, batch in enumerate(batches):
                for chunk in split_batch(batch, self._options.chunk_size):
                    with naming_batch(batch_index):
                        block = run_block(
                            self._runner(index, chunk, gradients),
                            self.param_groups,
                            self._options.gram_dtype,
                            keep_gradient_factors=gradients,
                        )
                    visit(index, block)
                    index += 1

    def _check_model_unchanged(self) -> None:
        """Refuse a pass with other parameter or buffer values than the first.

        Raises:
            ModelChangedError: If the model's state differs from construction.
        """
        if model_fingerprint(self._model) != self._model_state:
            raise ModelChangedError(
                f"The model's parameters or buffers changed since this StreamingGGN "
                f"was built (before pass {self.passes + 1}): its loss, gradient and "
                "normalization belong to the old values, and a pass with the new "
                "ones would mix two models. Build a new StreamingGGN after changing "
                "the model (LowRankGGN keeps the factors of its construction)."
            )

    def _first_pass(self) -> None:
        """Loss, gradient, and each block's rows and scale."""
        union = UnionOutput()
        rows: list[int] = []

        def visit(index: int, block: BlockResult) -> None:
            union.add(block.curvature[0].batch, block.output)
            rows.append(block.curvature[0].ggn_factors[0].num_rows)
            if index == 0:
                self.factor_dtypes = [c.factor_dtype for c in block.curvature]
                self.dtypes = [c.ggn_factors[0].dtype for c in block.curvature]

        self.run_pass(visit, "loss and gradient")
        self.loss, gradients = union.result()
        gradients = iter(gradients)
        self.gradients = [[next(gradients) for _ in g] for g in self.param_groups]
        self.union = union_batch(union.batches)
        self.scales = [
            block_scale(self.union.ggn_reduction_factor, batch.ggn_reduction_factor)
            for batch in union.batches
        ]
        self.bounds = [0]
        for count in rows:
            self.bounds.append(self.bounds[-1] + count)


def _check_streamable_solver(solver: str) -> None:
    """Refuse a solver that needs the Gram matrix, naming what to do instead."""
    if solver == "implicit":
        raise InvalidArgumentError(
            "solver='implicit' is a route of LowRankGGN: build LowRankGGN(model, "
            "loss_func, loader, solver='implicit'), which keeps no factors either "
            "and passes over the loader in every product."
        )
    if solver in ("dense", "iterative"):
        raise InvalidArgumentError(
            f"solver={solver!r} needs the Gram matrix, which StreamingGGN never "
            "forms: use solver='auto' or 'matrix_free' (block Krylov on "
            "products by passes over the data), or LowRankGGN over the loader."
        )


def _check_streamable(options: CurvatureOptions) -> None:
    """Refuse the options a stream over a loader cannot honour, naming them."""
    _check_streamable_solver(options.solver)
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


def _block_runner(
    model: Module,
    loss_func: Module,
    engine: Engine,
    param_groups: list[list[Parameter]],
    options: CurvatureOptions,
) -> Callable:
    """``(index, chunk, gradients) ↦`` the engine run of one block of a pass.

    Block ``b`` draws its Monte-Carlo samples from stream ``b`` in every pass.
    """
    request = CurvatureRequest(
        param_groups=param_groups,
        mc_samples=options.mc_samples,
        mc_per=options.mc_per,
        generator=options.generator,
        compute_gradients=False,
        num_grams=0,
        gram_dtype=options.gram_dtype,
        output=options.output,
    )
    requests = block_requests(request)

    def runner(index: int, chunk, gradients: bool):
        block_request = dataclasses.replace(
            requests(index), compute_gradients=gradients
        )
        return lambda sink: run_chunk(
            engine, model, loss_func, chunk, block_request, sink
        )

    return runner
