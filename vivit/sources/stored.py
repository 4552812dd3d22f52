"""Stored factors (:class:`~vivit.LowRankGGN`'s): one pass keeps every part's ``V``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor
from torch.nn import Module, Parameter

from vivit._param_groups import param_group_lists
from vivit._validation import check_finite, check_params
from vivit.directional.gram_space import directional_gradients
from vivit.distributed import ShardExchange, ShardLayout
from vivit.distributed.agreement import run_fingerprint
from vivit.engines.base import BatchInfo, CurvatureRequest, Engine, EngineOutput
from vivit.errors import GramTooLargeError, InvalidArgumentError
from vivit.gram.memory import check_gram_fits
from vivit.linalg.group_products import FactorProducts, group_gram
from vivit.model_inputs import input_tensors
from vivit.options import CurvatureOptions
from vivit.sources.base import CurvatureSource
from vivit.sources.collector import GroupCurvature
from vivit.sources.data import Data, Part, engine_context
from vivit.sources.ownership import CallerMemory, stored_bytes
from vivit.sources.runs import PartResult, curvature_request, run_engine, run_part
from vivit.sources.union import (
    UnionOutput,
    combine_curvatures,
    merged_parts,
    part_requests,
    per_group,
)


class StoredGroup:
    """One group's stored factors (a :class:`~vivit.sources.base.GroupSource`)."""

    solvers = ("dense", "gram_krylov", "factor_krylov")
    keeps_directions = False
    parameter_space = False

    def __init__(self, index: int, curvature: GroupCurvature, gradient: list[Tensor]):
        self.index, self.curvature, self.gradient = index, curvature, gradient
        self.params, self.batch = curvature.params, curvature.batch
        self.factor_dtype = curvature.factor_dtype
        self.factors = factors = curvature.ggn_factors
        self.dtype, self.num_rows = factors[0].dtype, factors[0].num_rows
        self.device = self.params[0].device
        self.products = FactorProducts(factors)

    def formed_gram(self) -> Tensor | None:  # noqa: D102
        return self.curvature.gram

    def form_gram(self, workspace_bytes: int) -> Tensor:  # noqa: D102
        if self.curvature.gram is None:
            check_gram_fits(self.num_rows, 1, self.dtype, self.device, workspace_bytes)
            self.set_gram(group_gram(self.curvature.ggn_factors))
        return self.curvature.gram

    def set_gram(self, gram: Tensor) -> None:
        """Keep the group's formed Gram matrix ``[N·C, N·C]``.

        Raises:
            NonFiniteError: If it has a non-finite entry.
        """
        check_finite(
            gram,
            f"Gram matrix of group {self.index} (backpropagated factors overflowed; "
            "rescale the inputs or use float64)",
            batch_axis=False,
        )
        self.curvature.gram = gram

    def check_solver(self, solver: str) -> None:  # noqa: D102
        pass  # every solver runs on the factors

    def directional_gradients(  # noqa: D102
        self,
        gram_evecs: Tensor,
        evals: Tensor,
        evecs: Callable[[], list[Tensor]],
        samples: Sequence[int] | None,
    ) -> Tensor:
        vt_grads = self.curvature.gradient_products(samples)
        return directional_gradients(vt_grads, gram_evecs, evals)


class StoredFactors(CurvatureSource):
    """The stored factors of every parameter group (a curvature source).

    Built by :meth:`run` (model, loss function, data) or :meth:`from_loss` (a loss).

    Attributes:
        shards: Where each rank's samples sit in the union.
        communication: Bytes and time of the exchange between the ranks.
    """

    def __init__(
        self,
        param_groups: list[list[Parameter]],
        options: CurvatureOptions,
        engine: str,
        names: dict[int, str],
        parts: list[list[GroupCurvature]],
        union: UnionOutput,
        caller_memory: CallerMemory,
        shards: ShardExchange | None = None,
        sample_shape: tuple[int, ...] | None = None,
    ):
        """Merge this process's parts; under a group, combine every rank's."""
        self.param_groups = param_groups
        self.engine = engine
        shards = shards or ShardExchange(None)
        # refuses no batch, or every target ignored (a rank's shard: after the exchange)
        loss, gradients = union.result(part=shards.group is not None)
        curvature = merged_parts(parts, options.subsampling)
        if shards.group is None:  # the exchange rebuilds every part from bytes
            caller_memory.own(curvature)
        else:
            local = PartResult(curvature, EngineOutput(loss, gradients))
            union = UnionOutput()
            exchanged = shards.exchange([local], param_groups, sample_shape)
            for result in exchanged:
                union.add(result.curvature[0].batch, result.output)
            loss, gradients = union.result()
            curvature = combine_curvatures([result.curvature for result in exchanged])
        self.shards = ShardLayout.of_batches(
            union.batches, shards.rank, shards.world_size
        )
        self.communication = shards.report
        self.loss = loss
        self.groups = []
        gradients = per_group(gradients, param_groups)
        for index, (group, part, gradient) in enumerate(
            zip(param_groups, curvature, gradients, strict=True)
        ):
            for param, tensor in zip(group, gradient, strict=True):
                name = names.get(id(param), f"parameter of shape {tuple(param.shape)}")
                check_finite(
                    tensor,
                    f"backpropagated gradient of the {name} (non-finite inputs, or "
                    "an overflow in the backward pass)",
                    batch_axis=False,
                )
            self.groups.append(StoredGroup(index, part, gradient))
        if shards.group is not None and options.solver != "factor_krylov":
            self._form_grams_together(shards)

    def _form_grams_together(self, shards: ShardExchange) -> None:
        """Form now, together, the Gram matrices that fit on every rank."""
        fits = []
        for group in self.groups:
            try:
                check_gram_fits(group.num_rows, 1, group.dtype, group.device, 0)
                fits.append(True)
            except GramTooLargeError:
                fits.append(False)
        for group, fit in zip(self.groups, shards.all_true(fits), strict=True):
            if fit:
                group.set_gram(shards.gram(group.curvature.ggn_factors))

    @classmethod
    def run(
        cls,
        model: Module,
        loss_func: Module,
        data: Data,
        param_groups: list[list[Parameter]],
        names: dict[int, str],
        options: CurvatureOptions,
        shards: ShardExchange,
        engine: Engine,
        plan: object | None = None,
    ) -> StoredFactors:
        """Run the engine on every part of the data, and combine the parts.

        ``names``: the parameters' (by ``id``); ``plan``: samples per pass and a
        loader's memory watched (``None``: neither).
        """
        per_pass = None if plan is None else plan.samples_per_pass
        request = _request(param_groups, options, samples_per_pass=per_pass)
        fingerprint = run_fingerprint(
            model, loss_func, param_groups, options, engine.name, data.sample_shape,
            shards.group is not None, mc_samples=options.mc_samples,
            mc_per=options.mc_per, gram_dtype=options.gram_dtype,
        )  # fmt: skip
        requests = part_requests(request, lambda seed: shards.agree(fingerprint, seed))
        parts: list[list[GroupCurvature]] = []
        caller_memory = CallerMemory()
        model_memory = [*model.parameters(), *model.buffers()]
        watch = None if plan is None or data.single else plan.watch(stored_bytes)

        def visit(part: Part) -> tuple[BatchInfo, EngineOutput]:
            # MC: part p of rank r draws from stream r + W·p (docs/math.rst,
            # "Several processes"); in one process from stream p
            stream = shards.rank + shards.world_size * part.index
            result = run_part(
                lambda sink: run_engine(engine, model, part, requests(stream), sink),
                param_groups,
                options.gram_dtype,
            )
            caller = [*input_tensors(part.inputs), part.targets, *model_memory]
            caller_memory.note(result.curvature, caller)
            if part.batch is not None:  # a loader may refill its tensors next batch
                caller_memory.own(result.curvature)
            parts.append(result.curvature)
            if watch is not None:
                watch(result.curvature, part)
            return result.curvature[0].batch, result.output

        union = data.walk(visit, "")
        return cls(
            param_groups, options, engine.name, names, parts, union, caller_memory,
            shards=shards, sample_shape=data.sample_shape,
        )  # fmt: skip

    @classmethod
    def from_loss(
        cls,
        loss: Tensor | Callable[[], Tensor],
        param_groups: Sequence[Sequence[Parameter]],
        options: CurvatureOptions,
        engine: Engine,
    ) -> StoredFactors:
        """Run an engine with ``run_loss`` (BackPACK's) on a loss or a loss function.

        Raises:
            InvalidArgumentError: If ``loss`` is neither a tensor nor a callable.
        """
        if isinstance(loss, Module) or not (isinstance(loss, Tensor) or callable(loss)):
            raise InvalidArgumentError(
                f"loss must be the loss tensor or a function that computes it, got "
                f"{type(loss).__name__}; for a model and a loss module use "
                "LowRankGGN(model, loss_func, (inputs, targets))."
            )
        param_groups = param_group_lists(param_groups)
        params = [p for group in param_groups for p in group]
        check_params(params, {})
        # MC: a batch's stream, as for a model and data
        request = part_requests(_request(param_groups, options))(0)
        compute_loss = loss if callable(loss) else lambda: loss
        with engine_context(params):
            result = run_part(
                lambda sink: engine.run_loss(compute_loss, request, sink),
                param_groups,
                options.gram_dtype,
            )
        union = UnionOutput()
        union.add(result.curvature[0].batch, result.output)
        # the caller's inputs are unknown: every factor tensor is copied once
        caller_memory = CallerMemory()
        caller_memory.note(result.curvature, None)
        return cls(
            param_groups, options, engine.name, {}, [result.curvature], union,
            caller_memory,
        )  # fmt: skip


def _request(
    param_groups: list[list[Parameter]], options: CurvatureOptions, **fields: object
) -> CurvatureRequest:
    """What the engine must compute."""
    return curvature_request(
        param_groups,
        options,
        **fields,
        subsampling=None if options.subsampling is None else list(options.subsampling),
        compute_gradients=True,
        # the dense solver needs every Gram: refuse before the backward pass;
        # others form them on demand, checked then (StoredGroup.form_gram)
        num_grams=len(param_groups) if options.solver == "dense" else 0,
    )
