"""Implicit curvature (``route="implicit"``): ``G v`` in parameter space, no ``V``.

Every product is one pass (JVP, loss Hessian, VJP per part; within a solve from
each part's recorded forward pass, "Linearized products"); block Krylov on ``G``
gives the leading pairs (``docs/math.rst``, "Implicit GGN-vector products").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_grad_mode
from vivit.distributed import ShardExchange, ShardLayout
from vivit.distributed.agreement import run_fingerprint
from vivit.distributed.lockstep import LockStep
from vivit.engines.base import BatchInfo, EngineOutput, select_output
from vivit.engines.func.implicit import PartFunction, check_modes_agree
from vivit.engines.func.independence import check_layers, check_samples_independent
from vivit.engines.func.linearized import LinearizedPart, check_linearization
from vivit.errors import InvalidArgumentError
from vivit.gram.memory import PARTIAL_FRACTION as MANY_PAIRS_FRACTION
from vivit.loss_hessians import LossHessianProducts
from vivit.model_copy import probe_copy_or_model
from vivit.model_inputs import call_model, take_samples
from vivit.options import CurvatureOptions
from vivit.sources.base import CurvatureSource, PassGroup
from vivit.sources.data import Data, Part, fingerprint, weightless
from vivit.sources.union import (
    UnionOutput,
    add_into,
    per_group,
    union_batch,
    unnormalizing_scale,
)

logger = logging.getLogger("vivit")

#: Samples of the first part the construction's checks of the rules run on.
CHECK_SAMPLES = 2

#: So many pairs the implicit route always computes (a basis of ``3·128`` vectors);
#: beyond, at most ``MANY_PAIRS_FRACTION`` (``solver="auto"``'s limit) of the
#: ``min(D, N·C·T)`` non-zero ones: a Gram route's dense solver gives more for less.
FEW_PAIRS = 128


class ImplicitGroup(PassGroup):
    """One group's curvature by implicit products (a ``ParameterGroupSource``).

    It also answers :meth:`ggn_matmul` and :meth:`pinv_matmul` of the operator.
    """

    solvers = ("ggn_krylov",)
    parameter_space = True

    def __init__(self, source: ImplicitFactors, index: int):
        super().__init__(source, index)
        self.factor_dtype = self.dtype = self.params[0].dtype
        self.num_params = sum(p.numel() for p in self.params)

    def form_gram(self, workspace_bytes: int) -> Tensor:  # noqa: D102
        raise InvalidArgumentError(
            "route='implicit' forms neither V nor the Gram matrix, so it computes "
            "a few leading eigenpairs: pass top_k (e.g. eigh(top_k=10)). The Gram "
            "matrix and all eigenvalues (eigvalsh, top_k=None) need a Gram route: "
            "name its solver, LowRankGGN(..., solver='dense') (solver='auto' takes "
            "this route where the Gram route costs more or does not fit; ggn.route "
            "says why)."
        )

    def check_solver(self, solver: str) -> None:  # noqa: D102
        if solver != "auto":
            raise InvalidArgumentError(
                f"solver={solver!r} runs on the Gram matrix or on V, which "
                "route='implicit' never forms: use route='implicit' (or 'auto'), "
                f"or build LowRankGGN(..., solver={solver!r}) for the Gram route."
            )

    def ggn_matmul(self, vectors: Sequence[Tensor]) -> list[Tensor]:
        """``G v`` for ``[K, *p.shape]`` per parameter: one pass (every rank's sum)."""
        return self._source.lockstep.sum(
            self._call("G·v", vectors), lambda: self._shard_products(vectors)
        )

    def _shard_products(self, vectors: Sequence[Tensor]) -> list[Tensor]:
        """``R_S Σ_n J_nᵀ H_n J_n v`` over this process's samples (its shard)."""
        factor = self.batch.ggn_reduction_factor
        result: list[Tensor] = []

        def visit(part: Part, function: PartFunction) -> None:
            pieces = []
            chunks = self._source.hessian_products(part, function, vectors)
            for _, output, _, curvature in chunks:
                mask = part.ggn_mask.to(output.device, output.dtype)
                weights = (factor * mask).reshape(-1, *[1] * (output.dim() - 1))
                pieces.append(function.vjp(curvature.mul_(weights)))
            products = [
                piece[0] if len(piece) == 1 else torch.cat(piece)
                for piece in zip(*pieces, strict=True)
            ]
            add_into(result, products)

        self._source.run_pass(self.index, "G·v", visit)
        return result

    def linearized(self, top_k: int) -> contextlib.AbstractContextManager[None]:
        """Within: products reuse each part's recorded forward pass (a solve's scope).

        ``docs/math.rst``, "Linearized products"; the plan says how many parts'
        recordings fit beside the solve of ``top_k`` pairs.
        """
        return self._source.linearized(top_k)

    def basis_columns(self, top_k: int) -> int | None:
        """Krylov basis columns the memory allows for ``top_k`` pairs (or ``None``).

        Raises:
            InvalidArgumentError: If ``top_k`` is a large part of the spectrum.
            ProductsTooLargeError: If not even the smallest basis fits.
        """
        check_few_pairs(top_k, min(self.num_rows, self.num_params))
        return self._source.check_fits(top_k)

    def flat_ggn_matmul(self, vectors: Tensor) -> Tensor:  # noqa: D102
        return flatten_rows(self.ggn_matmul(self.unflatten(vectors))).T

    def unflatten(self, columns: Tensor) -> list[Tensor]:  # noqa: D102
        parts = columns.T.split([p.numel() for p in self.params], dim=1)
        return [
            part.reshape(-1, *p.shape).contiguous()
            for part, p in zip(parts, self.params, strict=True)
        ]

    def directional_derivatives(self, evecs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """``γ [N, K]``, ``λ [N_ggn, K]`` (subsampling, then rank order): one pass."""
        device = evecs[0].device
        shares = self._source.lockstep.gather(
            self._call("γ, λ", evecs), lambda: self._shard_derivatives(evecs)
        )
        gammas, lambdas = zip(*shares, strict=True)
        return torch.cat(gammas).to(device), torch.cat(lambdas).to(device)

    def _shard_derivatives(self, evecs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """``γ`` and ``λ`` of this process's samples (on the CPU under a group)."""
        gammas, lambdas = [], []

        def visit(part: Part, function: PartFunction) -> None:
            part_gammas, part_lambdas, gradients = [], [], None
            chunks = self._source.hessian_products(part, function, evecs)
            for hessian, _, tangents, curvature in chunks:
                if gradients is None:
                    gradients = hessian.output_gradients()
                part_gammas.append((gradients * tangents).flatten(2).sum(2).T)
                part_lambdas.append((tangents * curvature).flatten(2).sum(2).T)
            gammas.append(torch.cat(part_gammas, 1))
            lambdas.append(torch.cat(part_lambdas, 1))

        self._source.run_pass(self.index, "γ, λ", visit)
        gammas = torch.cat(gammas)
        lambdas = torch.cat(lambdas)[list(self._source.local_batch.ggn_samples)]
        if self._source.lockstep.group is None:
            return gammas, lambdas
        return gammas.cpu(), lambdas.cpu()  # pickled in the round's message

    def _call(self, name: str, vectors: Sequence[Tensor]) -> str | None:
        """The call the ranks compare: name, group and the vectors' digest (a group)."""
        if self._source.lockstep.group is None:
            return None
        return (
            f"{name} of group {self.index} along {vectors[0].shape[0]} vectors "
            f"(digest {fingerprint(vectors)})"
        )

    def pinv_matmul(  # noqa: D102
        self, vectors: Sequence[Tensor], evals: Tensor, directions: Tensor
    ) -> list[Tensor]:
        flat = flatten_rows(vectors).double().T  # in float64
        basis = directions.double()
        result = basis @ ((basis.T @ flat) / evals.double().unsqueeze(1))
        return self.unflatten(result.to(self.dtype))


def check_few_pairs(top_k: int, rank: int) -> None:
    """Refuse a ``top_k`` beyond :data:`FEW_PAIRS` and that fraction of ``rank``."""
    if top_k > max(FEW_PAIRS, MANY_PAIRS_FRACTION * rank):
        raise InvalidArgumentError(
            f"top_k={top_k} asks for a large part of the GGN's at most {rank} "
            "non-zero eigenpairs: route='implicit' finds a few leading pairs by "
            "Krylov iterations (5–10 GGN-vector products per pair and a basis of "
            "about 3·top_k vectors of the parameters' size), which would take far "
            f"longer than a direct solve. Ask for at most "
            f"{max(FEW_PAIRS, int(MANY_PAIRS_FRACTION * rank))} pairs, or use a "
            "Gram route, whose dense solver gives every pair: LowRankGGN(..., "
            "solver='dense') (eigvalsh() and top_k=None for the whole spectrum)."
        )


def flatten_rows(rows: Sequence[Tensor]) -> Tensor:
    """Rows ``[K, *p.shape]``, one tensor per parameter, as one ``[K, D]`` tensor."""
    return torch.cat([r.reshape(r.shape[0], -1) for r in rows], 1)


class ImplicitFactors(CurvatureSource):
    """The curvature of a loss by implicit GGN-vector products (a source).

    The construction makes one pass (loss, gradient, normalization, checks);
    every product makes another. Under a process group each rank passes over its
    shard, and every later product, pass and memory check is a call all ranks
    make together (:class:`~vivit.distributed.lockstep.LockStep`).

    ``data`` is this rank's shard under a process group (``shards``; ``None``:
    local); ``plan`` (:class:`~vivit.memory.plan.Plan`) gives the vectors per
    pass and the Krylov basis that fit (``None``: all in one pass, the default).

    Attributes:
        shards: Where each rank's samples sit in the union.
        communication: Bytes and time of the exchanges between the ranks.
        lockstep: The calls the ranks make together (local in one process).
        union: The batch context of all samples; ``local_batch``: this process's.

    Raises:
        InvalidArgumentError: For an iterator as data.
        DistributedError: Under a process group, if a rank failed or the ranks'
            requests or targets' shapes per sample differ.
    """

    engine = "implicit"

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: Data,
        param_groups: list[list[Parameter]],
        options: CurvatureOptions,
        shards: ShardExchange | None = None,
        plan: object | None = None,
    ):
        shards = shards or ShardExchange(None)
        check_grad_mode("LowRankGGN")
        self.param_groups = param_groups
        check_layers(model)
        data.reread("LowRankGGN (route='implicit')")
        self._data, self._model, self._options, self._plan = data, model, options, plan
        self._basis_columns: dict[int, int | None] = {}
        #: Per (group, part index) within :meth:`linearized`; ``None`` outside.
        self._linearized: dict[tuple[int, int], LinearizedPart] | None = None
        self._hessians: dict[int, LossHessianProducts] = {}  # of the recorded parts
        self._kept_parts: float = 0
        self._unlinearizable: str | None = None  # why products run forward mode
        self.lockstep = LockStep(shards.group, shards.report)
        shape, grouped = data.sample_shape, shards.group is not None
        fingerprint = run_fingerprint(
            model, loss_func, param_groups, options, "implicit", shape, grouped
        )
        shards.agree(fingerprint, None)
        self._first_pass(shards)
        self.groups = [ImplicitGroup(self, g) for g in range(len(self.param_groups))]

    def vector_chunks(self, vectors: Sequence[Tensor]) -> Iterator[list[Tensor]]:
        """The vectors ``[K, *p.shape]`` of a product in the vmapped passes that fit."""
        count = vectors[0].shape[0]
        width = count if self._plan is None else self._plan.pass_width(count)
        for start in range(0, count, width):
            yield [v[start : start + width] for v in vectors]

    def hessian_products(
        self,
        part: Part,
        function: PartFunction | LinearizedPart,
        vectors: Sequence[Tensor],
    ) -> Iterator[tuple[LossHessianProducts, Tensor, Tensor, Tensor]]:
        """Per chunk of the vectors: the loss Hessian, output, ``J v`` and ``H J v``.

        A recorded part's loss Hessian is kept with its recording.
        """
        recorded = isinstance(function, LinearizedPart)
        hessians = self._hessians if recorded else {}
        hessian = hessians.get(part.index)
        for chunk in self.vector_chunks(vectors):
            output, tangents = function.jvp(chunk)
            if hessian is None:  # the output of every chunk's primal pass
                hessian = LossHessianProducts(part.loss_func, output, part.targets)
                hessians[part.index] = hessian
            yield hessian, output, tangents, hessian.hessian_matmul(tangents)

    def check_fits(self, top_k: int) -> int | None:
        """Krylov basis columns that fit for ``top_k`` pairs, the fewest of any rank.

        Raises:
            ProductsTooLargeError: If not even the smallest basis fits (on a
                rank that refuses; ``DistributedError`` on the others).
        """
        if top_k not in self._basis_columns:
            allowed = self.lockstep.gather(
                f"the memory check for top_k={top_k}",
                lambda: None if self._plan is None else self._plan.basis_columns(top_k),
            )
            columns = [c for c in allowed if c is not None]
            self._basis_columns[top_k] = min(columns, default=None)
        return self._basis_columns[top_k]

    @contextlib.contextmanager
    def linearized(self, top_k: int) -> Iterator[None]:
        """Within: the first parts' forward passes recorded once, for every product.

        As many parts as the plan fits beside the solve of ``top_k`` pairs (all
        without a plan); the others run forward mode in every pass. Not where an
        operation's backward has no backward rule (the construction's check).
        """
        if self._unlinearizable is not None or self._linearized is not None:
            yield
            return
        plan = self._plan
        self._kept_parts = math.inf if plan is None else plan.linearized_parts(top_k)
        self._linearized = {}
        try:
            yield
        finally:
            self._linearized, self._hessians = None, {}

    def run_pass(
        self,
        group: int,
        description: str,
        visit: Callable[[Part, PartFunction | LinearizedPart], None],
    ) -> None:
        """One pass: ``visit`` every part and its output as a function of a group.

        Raises:
            ModelChangedError: If the model changed since construction.
            NondeterministicDataError: If the loader yields other batches.
        """
        params, selector = self.param_groups[group], self._options.output
        kept = self._linearized

        def function(part: Part) -> PartFunction | LinearizedPart:
            function = PartFunction(self._model, params, part.inputs, selector)
            if kept is None or part.index >= self._kept_parts:
                return function
            if (group, part.index) not in kept:
                kept[group, part.index] = LinearizedPart(function)
            return kept[group, part.index]

        self._data.walk(lambda part: visit(part, function(part)), description)

    def _first_pass(self, shards: ShardExchange) -> None:
        """Loss, gradient, each part's normalization; samples checked independent."""
        params = [p for group in self.param_groups for p in group]
        selector = self._options.output
        model = self._model

        def visit(part: Part) -> tuple[BatchInfo, EngineOutput]:
            if part.index == 0:  # on a copy: the caller's model runs once here
                copy, copies = probe_copy_or_model(model)
                copied = dict(zip(map(id, model.parameters()), copies, strict=True))
                # the rules of the model's operations: a few samples show them
                inputs = take_samples(part.inputs, slice(0, CHECK_SAMPLES))
                for group in self.param_groups:
                    group = [copied[id(p)] for p in group]
                    function = PartFunction(copy, group, inputs, selector)
                    check_modes_agree(function, group)
                    self._unlinearizable = self._unlinearizable or (
                        check_linearization(function)
                    )
                if self._unlinearizable is not None:
                    logger.info(
                        "route='implicit': every product runs the model's forward "
                        "pass (forward mode), as %s.",
                        self._unlinearizable,
                    )
            output = select_output(call_model(model, part.inputs), selector)
            hessian = LossHessianProducts(part.loss_func, output.detach(), part.targets)
            with torch.no_grad():
                check_samples_independent(
                    lambda x: select_output(call_model(model, x), selector),
                    part.inputs,
                    output.detach(),
                )
            loss = part.loss_func(output, part.targets)
            gradients = torch.autograd.grad(
                loss, params, allow_unused=True, materialize_grads=True
            )
            batch = BatchInfo(
                normalization=hessian.normalization,
                ggn_samples=tuple(part.ggn_mask.nonzero().flatten().tolist()),
                columns_per_sample=output[0].numel(),
                mc_samples=0,
            )
            if part.weightless:
                batch = weightless(batch)
            return batch, EngineOutput(loss.detach(), gradients)

        union = self._data.walk(visit, "loss and gradient")
        sample_shape = self._data.sample_shape
        # a rank's shard may carry no weight: the union's R is checked below
        loss, gradients = union.result(part=shards.group is not None)
        self.local_batch = union_batch(union.batches)
        if self._options.subsampling is not None:  # rows in the subsampling's order
            self.local_batch = dataclasses.replace(
                self.local_batch, ggn_samples=tuple(self._options.subsampling)
            )
        ranks = shards.shard_contexts(self.local_batch, loss.detach(), sample_shape)
        self.union = union_batch([batch for batch, _ in ranks])
        self.loss = loss
        if shards.group is not None:
            self.loss, gradients = self._union_output(ranks, gradients)
        self.num_rows = len(self.union.ggn_samples) * self.union.columns_per_sample
        self.shards = ShardLayout.of_batches(
            [batch for batch, _ in ranks], shards.rank, shards.world_size
        )
        self.communication = shards.report
        self.gradients = per_group(gradients, self.param_groups)

    def _union_output(
        self, ranks: list[tuple[BatchInfo, Tensor]], gradients: list[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """The loss and gradient of every rank's samples: ``Σ_r (R / R_r) ∇L_r``."""
        union = UnionOutput()
        for batch, loss in ranks:
            union.add(batch, EngineOutput(loss, []))
        loss, _ = union.result()
        scale = unnormalizing_scale(self.local_batch)  # a shard of weight 0 adds 0
        total = self.union.reduction_factor()
        summed = self.lockstep.sum(
            "the gradient", lambda: [g.detach() * scale * total for g in gradients]
        )
        return loss, summed
