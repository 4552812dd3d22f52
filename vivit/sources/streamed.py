"""Streamed factors: every product recomputes the factors in passes over a loader.

The source of :class:`~vivit.StreamingGGN`: no factors of ``V`` are kept, and
``G̃ U = Vᵀ (V U)`` takes two passes (``docs/math.rst``, "Data sets and processes").
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_grad_mode
from vivit.engines.base import BatchInfo, EngineOutput
from vivit.engines.choice import resolve_engine
from vivit.errors import InvalidArgumentError
from vivit.gram import ParamFactors
from vivit.linalg.group_products import v_matmul, vt_matmul
from vivit.options import CurvatureOptions, check_streaming_solver
from vivit.sources.base import CurvatureSource
from vivit.sources.collector import checked_param_groups
from vivit.sources.data import Data, Part
from vivit.sources.runs import PartResult, curvature_request, run_engine, run_part
from vivit.sources.union import (
    UnionOutput,
    part_requests,
    part_scales,
    per_group,
    union_batch,
)


class StreamedGroup:
    """One group's products by passes (a :class:`~vivit.sources.base.GroupSource`).

    Its :attr:`products` are the group itself: ``V·u`` and ``Vᵀ·w`` one pass each.

    Args:
        source: The streamed source.
        index: Position of the group.
    """

    solvers = ("factor_krylov",)
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

    def check_solver(self, solver: str) -> None:  # noqa: D102
        check_streaming_solver(solver)

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

            def visit(index: int, block: PartResult) -> None:
                grads = block.curvature[self.index].grad_factors
                blocks.append(vt_matmul(grads, directions))

            self._source.run_pass(visit, "directional gradients", gradients=True)
            gammas = torch.cat(blocks, dim=1).T
        return gammas if samples is None else gammas[list(samples)]

    def v_matmul(self, coefficients: Tensor) -> list[Tensor]:
        """``V u = Σ_b V_b u_b`` of rows ``[K, N·C]``: ``[K, *p.shape]`` per param."""
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
        """``Vᵀ W`` ``[K, N·C]`` of vectors ``[K, *p.shape]``, one per parameter."""
        blocks: list[Tensor] = []
        self._factors_pass(
            lambda index, factors: blocks.append(vt_matmul(factors, vectors)), "Vᵀ·w"
        )
        return torch.cat(blocks, dim=1)

    def gram_matmul(self, vectors: Tensor) -> Tensor:
        """``G̃ U = Vᵀ (V U)`` of ``U`` ``[N·C, K]``: two passes."""
        return self.vt_matmul(self.v_matmul(vectors.T.contiguous())).T

    def _factors_pass(
        self, visit: Callable[[int, list[ParamFactors]], None], what: str
    ) -> None:
        """A pass handing every block's factors of the group (rescaled) to ``visit``."""
        scales = self._source.scales

        def visit_part(index: int, block: PartResult) -> None:
            factors = block.curvature[self.index].ggn_factors
            visit(index, [f.scaled(scales[index]) for f in factors])

        self._source.run_pass(visit_part, what)


class StreamedFactors(CurvatureSource):
    """Factors recomputed in every pass over a re-iterable loader (a source).

    The construction makes one pass (loss, gradient, each part's normalization);
    every product makes more.

    Args:
        model: The network.
        loss_func: The loss module.
        data: A re-iterable loader of ``(inputs, targets)`` batches, or one batch.
        param_groups: Lists of parameters (``None``: every trainable one).
        options: The checked options.

    Raises:
        InvalidArgumentError: For an iterator or generator (passed over once).
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
        self._data = Data(model, loss_func, data, options)
        self._data.reread("StreamingGGN")
        engine = resolve_engine(options.engine, model, loss_func, options.output)
        self.engine = engine.name
        self._options = options
        request = curvature_request(
            self.param_groups, options, compute_gradients=False, num_grams=0
        )
        # part p draws its Monte-Carlo samples from stream p in every pass
        requests = part_requests(request)

        def run(part: Part, gradients: bool) -> PartResult:
            part_request = dataclasses.replace(
                requests(part.index), compute_gradients=gradients
            )
            return run_part(
                lambda sink: run_engine(engine, model, part, part_request, sink),
                self.param_groups,
                options.gram_dtype,
                keep_gradient_factors=gradients,
            )

        self._run = run
        self._first_pass()
        self.groups = [StreamedGroup(self, g) for g in range(len(self.param_groups))]

    @property
    def passes(self) -> int:
        """Passes over the data made so far."""
        return self._data.passes

    @property
    def num_rows(self) -> int:
        """Side length ``N·C`` (``N·M`` with MC) of the Gram matrix, all batches."""
        return self.bounds[-1]

    def run_pass(
        self,
        visit: Callable[[int, PartResult], None],
        description: str,
        gradients: bool = False,
    ) -> UnionOutput:
        """One pass: the engine on every part, its index and result to ``visit``.

        Args:
            visit: Called with each part's index and result.
            description: What the pass computes (its progress bar's text).
            gradients: Keep the parts' per-sample-gradient factors.

        Raises:
            GradientContextError: Inside ``torch.inference_mode()``.
            ModelChangedError: If the model changed since construction.
            NondeterministicDataError: If the loader yields other batches.
        """
        check_grad_mode("StreamingGGN")

        def visit_part(part: Part) -> tuple[BatchInfo, EngineOutput]:
            result = self._run(part, gradients)
            visit(part.index, result)
            return result.curvature[0].batch, result.output

        return self._data.walk(visit_part, description)

    def _first_pass(self) -> None:
        """Loss, gradient, and each part's rows and scale."""
        rows: list[int] = []

        def visit(index: int, part: PartResult) -> None:
            rows.append(part.curvature[0].ggn_factors[0].num_rows)
            if index == 0:
                self.factor_dtypes = [c.factor_dtype for c in part.curvature]
                self.dtypes = [c.ggn_factors[0].dtype for c in part.curvature]

        union = self.run_pass(visit, "loss and gradient")
        self.loss, gradients = union.result()
        self.gradients = per_group(gradients, self.param_groups)
        self.union = union_batch(union.batches)
        self.scales = part_scales(self.union, union.batches)
        self.bounds = [0, *itertools.accumulate(rows)]
