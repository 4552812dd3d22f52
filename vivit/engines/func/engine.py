"""The func engine: curvature factors of any model whose samples are independent.

Recorded calls keep a factor form (``docs/math.rst``, "Layer structure"), other
parameters get explicit columns; samples run in chunks of ``samples_per_pass``, the
vectors go back in passes that fit the memory budget.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_positive_int
from vivit.engines.base import (
    BatchInfo,
    ContributionSink,
    CurvatureRequest,
    Engine,
    EngineOutput,
    ParamContribution,
    model_loss,
    select_output,
)
from vivit.engines.func.capture import SCALE_LAYERS, LayerCall, LayerCapture, count_uses
from vivit.engines.func.functional import (
    FunctionCapture,
    FunctionUse,
    probe_vectors,
    sample_rows,
)
from vivit.engines.func.implicit import PartFunction
from vivit.engines.func.independence import check_layers, check_samples_independent
from vivit.engines.func.vjp import (
    BatchedVJP,
    ExplicitColumns,
    OneHotPerSample,
    VectorStack,
    per_sample_vjp,
)
from vivit.errors import UnsupportedLayerError
from vivit.gram import (
    DenseFactors,
    EmbeddingFactors,
    OuterProductFactors,
    ParamFactors,
    SumFactors,
)
from vivit.model_inputs import (
    ModelInputs,
    call_model,
    map_inputs,
    num_samples,
    take_samples,
)

#: Default memory budget of one chunk, in tensor entries (2**27: 512 MiB float32).
DEFAULT_MEMORY_BUDGET = 2**27
#: At most this many samples per chunk when some parameter has no factor form: the
#: one-hot backward pass does ``B`` times the necessary work.
DENSE_CHUNK = 4

Use = LayerCall | FunctionUse
#: Rows of each function use's output that each sample owns, ``[B, T]``, by ``id``.
Rows = dict[int, Tensor]
#: A part of ``V``: a form and its ``(inputs, vectors)``, or ``None`` and columns.
Part = tuple[str | None, tuple[Tensor, Tensor] | Tensor]


@dataclass
class _Collected:
    """One parameter's factors over the whole batch, each chunk's written into place.

    ``forms``: form to inputs ``[N, G, T, P]`` (indices ``[N, T]``) and vectors
    ``[V, N, G, T, O]`` (``[V, N, T, D]``); ``columns``: ``[N, V, *shape]``.
    """

    forms: dict[str, list[Tensor]] = field(default_factory=dict)
    columns: Tensor | None = None

    def add(self, part: Part, start: int, total: int) -> None:
        """Place a chunk's part (its samples from ``start``)."""
        form, tensors = part
        if form is None:
            self.columns = _place(self.columns, tensors, start, total, dim=0)
            return
        kept = self.forms.get(form, [None, None])
        self.forms[form] = [
            _place(kept[0], tensors[0], start, total, dim=0),
            _place(kept[1], tensors[1], start, total, dim=1),
        ]


class FuncEngine(Engine):
    """Curvature factors from hooks and batched autograd, for any model.

    Args:
        memory_budget: Entries the intermediates of one chunk may hold. Smaller
            values run more, smaller chunks.

    Raises:
        InvalidArgumentError: If the budget is not a positive integer.
    """

    name = "func"

    def __init__(self, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        check_positive_int(memory_budget, "memory_budget", "tensor entries")
        self.memory_budget = memory_budget

    @torch.enable_grad()  # curvature needs the graph, whatever the caller's context
    def run(  # noqa: D102
        self,
        model: Module,
        loss_func: Module,
        data: tuple[ModelInputs, Tensor],
        request: CurvatureRequest,
        sink: ContributionSink,
    ) -> EngineOutput:
        inputs, targets = data
        check_layers(model)
        params = request.params
        forward = _Forward(model, params, request.output)
        output = forward(inputs, measure=True)
        loss, curvature = model_loss(loss_func, output, targets)
        batch = BatchInfo.of(curvature, output, request)
        uses_of, rows_of = forward.uses(output)
        dense = [p for p in params if id(p) not in uses_of]
        total = num_samples(inputs)
        chunk = request.samples_per_pass or total
        if dense:  # the one-hot pass does chunk times the necessary work
            chunk = min(chunk, DENSE_CHUNK)
        dense_entries = sum(p.numel() for p in dense)
        per_pass = self._vectors_per_pass(chunk, forward.width, dense_entries)
        reuse = chunk >= total  # the first pass's graph serves the one chunk
        output_grad, *grads = torch.autograd.grad(
            loss, [output, *params], allow_unused=True, retain_graph=reuse
        )
        gradients = [
            torch.zeros_like(p) if g is None else g.detach()
            for p, g in zip(params, grads, strict=True)
        ]
        check_samples_independent(forward.unrecorded, inputs, output.detach())
        # [V, N, *out]: root columns (zero outside S), then ∂ℓ_n/∂f_n
        mc = (request.mc_samples, request.generator, request.mc_per)
        root = curvature.root(list(batch.ggn_samples), *mc)
        scale = batch.per_sample_gradient_scale
        scaled = output_grad.detach() * scale if request.compute_gradients else None
        vectors = VectorStack(root, batch.ggn_samples, scaled, range(total))
        factor = set(uses_of)
        first = (output, uses_of, rows_of) if reuse else None
        del uses_of, rows_of  # chunks: the whole batch's calls are not kept
        collected = self._collect(
            forward, inputs, dense, vectors, (chunk, per_pass), factor, first
        )
        # free the forward graph before the sink forms Gram blocks
        del vectors, first, output
        loss = loss.detach()
        forward.forget()
        for param in params:  # popped: what the sink does not keep is freed
            entry = collected.pop(id(param))
            sink.add(param, _contribution(param, entry, batch, request))
            del entry
        return EngineOutput(loss=loss, gradients=gradients)

    def _vectors_per_pass(self, samples: int, width: int, dense: int) -> int:
        """Vectors per backward pass of a chunk: as many as the budget holds."""
        return max(1, self.memory_budget // max(samples * width + dense, 1))

    def _collect(
        self,
        forward: _Forward,
        inputs: ModelInputs,
        dense: list[Parameter],
        vectors: VectorStack,
        chunking: tuple[int, int],
        factor: set[int],
        first: tuple[Tensor, dict[int, list[Use]], Rows] | None,
    ) -> dict[int, _Collected]:
        """Every parameter's factors, a chunk of samples at a time.

        ``chunking``: ``(samples per chunk, vectors per pass)``; ``first``: the
        batch's output, uses and rows if one chunk (its graph is reused).
        """
        chunk, per_pass = chunking
        total = num_samples(inputs)
        collected = {id(p): _Collected() for p in forward.params}
        to_layers, to_params = BatchedVJP(), BatchedVJP()
        explicit = ExplicitColumns()
        for start in range(0, total, chunk):
            block = vectors.samples(start, start + chunk)
            samples = take_samples(inputs, slice(start, start + chunk))
            if first is None:
                output = forward(samples)
                uses_of, rows_of = forward.uses(output, factor)
            else:
                output, uses_of, rows_of = first
            calls = _calls(uses_of)
            at_outputs = to_layers(output, [c.output for c in calls], block, per_pass)
            at = {id(c): g for c, g in zip(calls, at_outputs, strict=True)}
            gathered: dict[int, Tensor] = {}  # a weight and its bias share the rows
            for param in forward.params:
                uses = uses_of.get(id(param), [])
                for part in _factors(param, uses, at, rows_of, gathered):
                    collected[id(param)].add(part, start, total)
            del at_outputs, at, gathered
            if dense:
                columns = explicit(
                    partial(
                        forward.per_sample_columns, dense, samples, block, per_pass
                    ),
                    partial(to_params, output, dense, OneHotPerSample(block), per_pass),
                    more_chunks=start + chunk < total,
                )
                for param, cols in zip(dense, columns, strict=True):
                    cols = cols.reshape(output.shape[0], len(vectors), *param.shape)
                    collected[id(param)].add((None, cols), start, total)
                del columns, cols
        return collected


def _factors(
    param: Parameter,
    uses: list[Use],
    at: dict[int, Tensor],
    rows_of: Rows,
    gathered: dict[int, Tensor],
) -> Iterator[Part]:
    """A parameter's parts of ``V``: uses of a form stacked along the positions."""
    forms: dict[str, list[tuple[Tensor, Tensor]]] = {}
    columns = None
    for use in uses:
        form, part = _use_factors(param, use, at[id(use)], rows_of, gathered)
        if form is None:
            columns = part if columns is None else columns + part
        else:
            forms.setdefault(form, []).append(part)
    for form, parts in forms.items():
        axis = 1 if form == "embedding" else 2  # the positions of the inputs
        inputs, vectors = zip(*parts, strict=True)
        yield form, (_cat(inputs, dim=axis), _cat(vectors, dim=axis + 1))
    if columns is not None:
        yield None, columns.reshape(*columns.shape[:2], *param.shape)


def _use_factors(
    param: Parameter,
    use: Use,
    vectors: Tensor,
    rows_of: Rows,
    gathered: dict[int, Tensor],
) -> Part:
    """A parameter's part of ``V`` from one use and the vectors ``[V, *z]`` there."""
    if isinstance(use, LayerCall):
        per_group = use.output_vectors(vectors)  # [V, B, G, T, O]
        if param is use.module.weight and isinstance(use.module, SCALE_LAYERS):
            scaled = (per_group * use.layer_inputs()).sum(3)  # BatchNorm
            return None, scaled.flatten(2).transpose(0, 1)
        if param is use.module.weight:
            return "conv", (use.layer_inputs(), per_group)
        return None, per_group.sum(3).flatten(2).transpose(0, 1)
    rows = rows_of[id(use)]
    if id(use) not in gathered:
        gathered[id(use)] = _gather(use.rows(vectors), rows)
    at_rows = gathered[id(use)]  # [V, B, T, F]
    if param is not use.weight:  # a bias: the vectors summed over the positions
        return None, at_rows.sum(2).transpose(0, 1)
    if use.kind == "embedding":
        indices = _gather(use.input_rows()[:, None], rows)[..., 0]  # [B, T]
        if use.padding is not None:  # the padding row gets no gradient
            at_rows = at_rows * (indices != use.padding)[..., None]
        return "embedding", (indices, at_rows)
    inputs = _gather(use.input_rows(), rows)  # [B, T, P]
    if use.kind == "norm":
        return None, torch.einsum("btf,vbtf->bvf", inputs, at_rows)
    return use.kind, (inputs[:, None], at_rows[:, :, None])


def _gather(tensor: Tensor, rows: Tensor) -> Tensor:
    """``tensor[..., R, F]`` at rows ``[B, T]`` (row ``R``: zeros); a view if it can."""
    count = tensor.shape[-2]
    if rows.numel() == count and torch.equal(
        rows.flatten(), torch.arange(count, device=rows.device)
    ):
        return tensor.reshape(*tensor.shape[:-2], *rows.shape, tensor.shape[-1])
    zero = tensor.new_zeros(*tensor.shape[:-2], 1, tensor.shape[-1])
    return torch.cat([tensor, zero], dim=-2)[..., rows, :]


def _cat(parts: Sequence[Tensor], dim: int) -> Tensor:
    """``torch.cat``, without copying a single contiguous part."""
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


def _place(
    whole: Tensor | None, part: Tensor, start: int, total: int, dim: int
) -> Tensor:
    """A chunk's ``part`` (samples from ``start`` on ``dim``) in the batch's tensor."""
    if part.shape[dim] == total:
        return part.contiguous()
    if whole is None:
        shape = list(part.shape)
        shape[dim] = total
        whole = part.new_empty(shape)
    whole.narrow(dim, start, part.shape[dim]).copy_(part)
    return whole


def _calls(calls_of: dict[int, list[Use]]) -> list[Use]:
    """The distinct recorded calls, in a fixed order."""
    return list({id(c): c for cs in calls_of.values() for c in cs}.values())


def _contribution(
    param: Parameter, entry: _Collected, batch: BatchInfo, request: CurvatureRequest
) -> ParamContribution:
    """A parameter's factors (several forms: their sum); explicit columns copied."""
    columns = batch.columns_per_sample
    ggn: list[ParamFactors] = []
    grad: list[ParamFactors] = []
    for form, (inputs, vectors) in entry.forms.items():
        samples = _samples(batch, inputs.shape[0])
        kind = EmbeddingFactors if form == "embedding" else OuterProductFactors
        extra = {} if form == "embedding" else {"transposed": form == "linear_t"}
        make = partial(kind, param_shape=param.shape, **extra)
        ggn.append(make(inputs[samples], vectors[:columns, samples]))
        grad.append(make(inputs, vectors[columns:]))
    if entry.columns is not None:
        dense = entry.columns  # [N, V, *shape]
        samples = _samples(batch, dense.shape[0])
        ggn.append(DenseFactors(dense[samples, :columns].contiguous()))
        grad.append(DenseFactors(dense[:, columns:].clone()))
    gradients = _summed(grad) if request.compute_gradients else None
    return ParamContribution(ggn=_summed(ggn), grad=gradients, batch=batch)


def _samples(batch: BatchInfo, total: int) -> slice | list[int]:
    """Index of the curvature samples: a view (``slice``) if they are every sample."""
    samples = batch.ggn_samples
    return slice(None) if samples == tuple(range(total)) else list(samples)


def _summed(parts: list[ParamFactors]) -> ParamFactors:
    """One form as it is, several as their sum."""
    return parts[0] if len(parts) == 1 else SumFactors(parts)


class _Forward:
    """The model's forward pass as the engine runs it: factor-form calls recorded."""

    def __init__(self, model: Module, params: list[Parameter], selector):
        self.model = model
        self.params = params
        self.selector = selector
        self.capture = LayerCapture(model, params)
        self.functions = FunctionCapture(params)
        self.width = 1  # entries per sample of the activations (measured once)
        # draws the probe vectors; the caller's generators are left alone
        self.generator = torch.Generator(device=params[0].device).manual_seed(0)

    def __call__(self, inputs: ModelInputs, measure: bool = False) -> Tensor:
        """The selected output of ``inputs``, calls recorded (``measure``: width)."""
        leaves: list[tuple[int, int]] = []  # entries and samples of leaf outputs
        with ExitStack() as stack:
            stack.enter_context(self.capture.recording())
            self.functions.uses = []
            stack.enter_context(self.functions)
            for module in self.model.modules() if measure else ():
                if next(module.children(), None) is None:
                    hook = partial(_count_entries, leaves)
                    stack.callback(module.register_forward_hook(hook).remove)
            output = select_output(call_model(self.model, inputs), self.selector)
        if measure:  # also activations outside leaf modules (attention, addmm)
            calls = {id(u): u for u in self.functions.uses}.values()
            recorded = sum(u.output.numel() for u in calls) // num_samples(inputs)
            per_leaf = (
                sum(n for n, _ in leaves) // max(leaves[-1][1], 1) if leaves else 0
            )
            self.width = max(1, recorded, per_leaf)
        return output

    def per_sample_columns(
        self,
        dense: list[Parameter],
        inputs: ModelInputs,
        vectors: VectorStack,
        per_pass: int,
    ) -> list[Tensor] | None:
        """Columns ``[B, V, *shape]`` of ``dense`` by :func:`per_sample_vjp` or None."""

        def sample_output(values: list[Tensor], x: ModelInputs) -> Tensor:
            one = map_inputs(x, lambda tensor: tensor[None])
            return PartFunction(self.model, dense, one, self.selector)(*values)[0]

        return per_sample_vjp(sample_output, dense, inputs, vectors[:], per_pass)

    def forget(self) -> None:
        """Drop the last pass's records (they hold its graph)."""
        self.capture.calls = []
        self.functions.uses = []

    def uses(
        self, output: Tensor, factor: set[int] | None = None
    ) -> tuple[dict[int, list[Use]], Rows]:
        """The uses of each parameter with a factor form, and each function's rows.

        A form needs every use in ``output``'s graph recorded, unchanged in place,
        with rows of one sample each (probe vectors). ``factor``: for a chunk, the
        parameters with a form over the whole batch, which it must keep exactly.

        Raises:
            UnsupportedLayerError: If a chunk's forms differ from the whole batch's.
        """
        uses_of: dict[int, list[Use]] = {}
        params: dict[int, Parameter] = {}
        for use in [*self.capture.calls, *self.functions.uses]:
            for param in use.params():
                if param.requires_grad:
                    uses_of.setdefault(id(param), []).append(use)
                    params[id(param)] = param
        counted = count_uses(output, list(params.values()))
        uses_of = {
            key: uses
            for key, uses in uses_of.items()
            if counted[key] == len(uses)
            and all(u.unchanged() for u in uses)
            and (factor is None or key in factor)  # lost over the batch: lost
        }
        functions = [c for c in _calls(uses_of) if isinstance(c, FunctionUse)]
        rows_of: Rows = {}
        if functions:
            probes = probe_vectors(output.detach()[None], self.generator)
            at_outputs = BatchedVJP()(
                output, [f.output for f in functions], probes, len(probes)
            )
            for use, at in zip(functions, at_outputs, strict=True):
                rows = sample_rows(use.rows(at), output.shape[0])
                if rows is not None:
                    rows_of[id(use)] = rows
        uses_of = {
            key: uses
            for key, uses in uses_of.items()
            if all(isinstance(u, LayerCall) or id(u) in rows_of for u in uses)
        }
        if factor is not None and set(uses_of) != factor:
            raise UnsupportedLayerError(
                "The model uses its parameters differently for different chunks "
                "of the mini-batch (data-dependent control flow, or rows of a call "
                "that belong to single samples of the batch but not of a chunk); the "
                "func engine needs the same computation for every sample chunk. "
                "Pass a larger memory_budget to process the batch at once."
            )
        return uses_of, rows_of

    def unrecorded(self, inputs: ModelInputs) -> Tensor:
        """The selected output without recording or gradients (checks)."""
        with torch.no_grad():
            return select_output(call_model(self.model, inputs), self.selector)


def _count_entries(leaves: list, module: Module, args: tuple, output) -> None:
    """Forward hook: the entries and samples of a leaf layer's output tensors."""
    for tensor in output if isinstance(output, tuple) else (output,):
        if isinstance(tensor, Tensor) and tensor.dim() > 0:
            leaves.append((tensor.numel(), tensor.shape[0]))
