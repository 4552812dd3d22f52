"""The func engine: curvature factors of any model whose samples are independent.

Nothing is left on the caller's model: temporary forward hooks record
convolution and BatchNorm layers, a ``TorchFunctionMode`` the calls of
``F.linear``, ``torch.addmm``, ``F.embedding`` and the normalizations
(:mod:`~vivit.engines.func.functional`; recurrent kernels step by step,
:mod:`~vivit.engines.func.recurrent`), and batched ``torch.autograd.grad``
pushes back the loss-Hessian root's columns, the per-sample output gradients and
probe vectors that tell which sample owns each row (``docs/math.rst``, "Layer
structure"). Weights of recorded calls keep their factor form, biases and
normalization weights columns summed from the vectors; every other parameter
gets explicit columns (:class:`~vivit.engines.func.columns.OneHotPerSample` or
a vmapped pullback, :class:`~vivit.engines.func.vjp.ExplicitColumns`).

A part of the samples runs in chunks of ``request.samples_per_pass`` samples
(the plan's, from :attr:`FuncEngine.memory_budget`; at most :data:`DENSE_CHUNK`
where some parameter has explicit columns, whose one-hot pass does ``B`` times
the necessary work), each a forward pass of its own; the vectors of a chunk go
back in passes that fit the budget. One more forward pass without gradients
checks that the samples are independent
(:func:`~vivit.engines.func.independence.check_samples_independent`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_finite, check_positive_int
from vivit.engines.base import (
    BatchInfo,
    ContributionSink,
    CurvatureRequest,
    Engine,
    EngineOutput,
    ParamContribution,
    select_output,
)
from vivit.engines.func.capture import (
    SCALE_LAYERS,
    LayerCall,
    LayerCapture,
    count_uses,
)
from vivit.engines.func.columns import OneHotPerSample, VectorStack
from vivit.engines.func.functional import (
    FunctionCapture,
    FunctionUse,
    probe_vectors,
    sample_rows,
)
from vivit.engines.func.independence import check_layers, check_samples_independent
from vivit.engines.func.vjp import BatchedVJP, ExplicitColumns, per_sample_vjp
from vivit.errors import InvalidArgumentError, UnsupportedLayerError
from vivit.gram import (
    DenseFactors,
    EmbeddingFactors,
    OuterProductFactors,
    ParamFactors,
    SumFactors,
)
from vivit.gram.memory import check_gram_fits
from vivit.losses import LossCurvature
from vivit.model_inputs import (
    ModelInputs,
    call_model,
    map_inputs,
    num_samples,
    take_samples,
)

#: Default memory budget of one chunk, in tensor entries (2**27: 512 MiB float32).
DEFAULT_MEMORY_BUDGET = 2**27
#: At most this many samples per chunk when some parameter has no factor form:
#: the one-hot backward pass does ``B`` times the necessary work, so small chunks
#: are faster (transformer block, N=32: 8.1 s with B=32, 0.8 s with B=4).
DENSE_CHUNK = 4


Use = LayerCall | FunctionUse
#: Rows of each function use's output that each sample owns, ``[B, T]``.
Rows = dict[int, Tensor]


@dataclass
class _Collected:
    """What the chunks leave for one parameter, over the whole batch.

    Each chunk's part is written into place as it arrives (see :func:`_place`),
    so no chunk outlives its own pass; with one chunk, its tensors are kept.
    ``forms`` maps a factor form (``"conv"``, ``"linear"``, ``"linear_t"``,
    ``"embedding"``) to its inputs ``[N, G, T, P]`` (indices ``[N, T]``) and
    vectors ``[V, N, G, T, O]`` (``[V, N, T, D]``), the uses of that form
    stacked along the positions; ``columns`` are explicit columns
    ``[N, V, *shape]`` (explicit fallback, biases, normalization weights).
    """

    forms: dict[str, list[Tensor]] = field(default_factory=dict)
    columns: Tensor | None = None


class FuncEngine(Engine):
    """Curvature factors from hooks and batched autograd, for any model.

    Args:
        memory_budget: Entries the intermediates of one chunk may hold (see the
            module's cost model). Smaller values run more, smaller chunks.

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
        check_finite(output, "model output")
        loss_curvature = LossCurvature(loss_func, output, targets)  # names bad input
        loss = loss_func(output, targets)
        if loss.numel() != 1:
            raise InvalidArgumentError(
                f"The loss has shape {tuple(loss.shape)}; the GGN is defined for a "
                "scalar loss: use reduction='mean' or 'sum'."
            )
        batch = _batch_info(loss_curvature, output.detach(), request)
        check_gram_fits(
            len(batch.ggn_samples) * batch.columns_per_sample,
            request.grams_formed,
            request.gram_dtype or output.dtype,
            output.device,
        )
        uses_of = forward.factor_uses(output)
        rows_of = forward.resolve_rows(output, uses_of)
        dense = [p for p in params if id(p) not in uses_of]
        chunk = request.samples_per_pass or num_samples(inputs)
        if dense:  # the one-hot pass does chunk times the necessary work
            chunk = min(chunk, DENSE_CHUNK)
        per_pass = self._vectors_per_pass(
            chunk, forward.width.per_sample, sum(p.numel() for p in dense)
        )
        # the graph of the first forward pass serves the chunk of the whole batch
        reuse = chunk >= num_samples(inputs)
        output_grad, *grads = torch.autograd.grad(
            loss, [output, *params], allow_unused=True, retain_graph=reuse
        )
        gradients = [
            torch.zeros_like(p) if g is None else g.detach()
            for p, g in zip(params, grads, strict=True)
        ]
        check_samples_independent(forward.unrecorded, inputs, output.detach())
        vectors = self._vectors(loss_curvature, output_grad, batch, request)
        factor = set(uses_of)
        first = (output, uses_of, rows_of) if reuse else None
        del uses_of, rows_of  # chunks: the whole batch's calls are not kept
        collected = self._collect(
            forward, inputs, dense, vectors, (chunk, per_pass), factor, first
        )
        # the forward graph (its saved activations, the recorded layer outputs)
        # is not needed while the sink forms Gram blocks: free it first
        del vectors, first, output
        loss = loss.detach()
        forward.forget()
        for param in params:
            # popped: what the sink does not keep is freed parameter by parameter
            entry = collected.pop(id(param))
            sink.add(param, _contribution(param, entry, batch, request))
            del entry
        return EngineOutput(loss=loss, gradients=gradients)

    @staticmethod
    def _vectors(
        loss_curvature: LossCurvature,
        output_grad: Tensor,
        batch: BatchInfo,
        request: CurvatureRequest,
    ) -> VectorStack:
        """Vectors to backpropagate, ``[V, N, *out]``: root columns, then ``∂ℓ_n/∂f_n``.

        Samples outside the curvature subsampling get zero root columns. Formed
        a block at a time as the backward passes take them.
        """
        root = loss_curvature.root(
            list(batch.ggn_samples),
            request.mc_samples,
            request.generator,
            request.mc_per,
        )
        gradients = (
            output_grad.detach() * batch.per_sample_gradient_scale
            if request.compute_gradients
            else None
        )
        return VectorStack(
            root, batch.ggn_samples, gradients, range(output_grad.shape[0])
        )

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
        """Every parameter's factors, ``chunk`` samples at a time.

        ``chunking`` is ``(samples per chunk, vectors per backward pass)``;
        ``factor`` the parameters with a factor form in the first forward pass
        of the whole batch. ``first`` is that pass's output, uses and rows when
        one chunk holds the whole batch: its graph is reused, so the batch is
        evaluated once. Otherwise each chunk runs its own forward pass (the graph
        of the whole batch would need the memory the chunks save), which must
        use the parameters as the first did; its rows are read off probe
        vectors pushed back with the chunk's vectors.
        """
        chunk, per_pass = chunking
        total = num_samples(inputs)
        collected = {id(p): _Collected() for p in forward.params}
        to_layers, to_params = BatchedVJP(), BatchedVJP()
        explicit = ExplicitColumns()
        for start in range(0, total, chunk):
            block = vectors.samples(start, start + chunk)
            if first is not None:
                output, uses_of, rows_of = first
            else:
                output = forward(take_samples(inputs, slice(start, start + chunk)))
                # those that lost their form over the whole batch keep it lost
                found = forward.factor_uses(output)
                uses_of = {k: found[k] for k in factor if k in found}
                rows_of = None
            if set(uses_of) != factor:
                raise UnsupportedLayerError(
                    "The model uses its parameters differently for different chunks "
                    "of the mini-batch (data-dependent control flow); the func "
                    "engine needs the same computation for every sample chunk. Pass "
                    "a larger memory_budget to process the batch at once."
                )
            calls = _calls(uses_of)
            if rows_of is None:
                rows_of = _chunk_rows(calls, output, forward.generator)
            at_outputs = to_layers(output, [c.output for c in calls], block, per_pass)
            self._factor_chunk(
                at_outputs,
                calls,
                (uses_of, rows_of),
                forward.params,
                collected,
                (start, total),
            )
            if dense:
                columns = explicit(
                    partial(
                        forward.per_sample_columns,
                        dense,
                        take_samples(inputs, slice(start, start + chunk)),
                        block,
                        per_pass,
                    ),
                    partial(to_params, output, dense, OneHotPerSample(block), per_pass),
                    more_chunks=start + chunk < total,
                )
                for param, cols in zip(dense, columns, strict=True):
                    cols = cols.reshape(output.shape[0], len(vectors), *param.shape)
                    entry = collected[id(param)]
                    entry.columns = _place(entry.columns, cols, start, total, dim=0)
                del columns, cols
        return collected

    @staticmethod
    def _factor_chunk(
        at_outputs: list[Tensor],
        calls: list[Use],
        found: tuple[dict[int, list[Use]], Rows],
        params: list[Parameter],
        collected: dict[int, _Collected],
        place: tuple[int, int],
    ) -> None:
        """Keep the factors of the chunk's vectors at the recorded outputs.

        ``found`` holds the uses of every parameter with a factor form and the
        rows each sample owns of every function's output; ``place`` the chunk's
        first sample and the batch's samples. Uses of one form are stacked along
        the positions (``Σ_u`` of their contributions); explicit parts (biases,
        normalization weights) are summed.
        """
        uses_of, rows_of = found
        start, total = place
        at = {id(c): g for c, g in zip(calls, at_outputs, strict=True)}
        gathered: dict[int, Tensor] = {}  # a weight and its bias share the rows
        for param in params:
            uses = uses_of.get(id(param))
            if uses is None:
                continue
            forms: dict[str, list[tuple[Tensor, Tensor]]] = {}
            columns = None
            for use in uses:
                if isinstance(use, FunctionUse) and id(use) not in gathered:
                    vectors = use.rows(at[id(use)])
                    gathered[id(use)] = _gather(vectors, rows_of[id(use)])
                form, part = _use_factors(param, use, at[id(use)], gathered, rows_of)
                if form is None:
                    columns = part if columns is None else columns + part
                else:
                    forms.setdefault(form, []).append(part)
            entry = collected[id(param)]
            for form, parts in forms.items():
                axis = 1 if form == "embedding" else 2  # the positions of the inputs
                stacked = (
                    _cat([p[0] for p in parts], dim=axis),
                    _cat([p[1] for p in parts], dim=axis + 1),
                )
                kept = entry.forms.get(form, [None, None])
                entry.forms[form] = [
                    _place(kept[0], stacked[0], start, total, dim=0),
                    _place(kept[1], stacked[1], start, total, dim=1),
                ]
            if columns is not None:
                columns = columns.reshape(*columns.shape[:2], *param.shape)
                entry.columns = _place(entry.columns, columns, start, total, dim=0)


def _use_factors(
    param: Parameter,
    use: Use,
    vectors: Tensor,
    gathered: dict[int, Tensor],
    rows_of: Rows,
) -> tuple[str | None, tuple[Tensor, Tensor] | Tensor]:
    """A parameter's part of ``V`` from one use, and the form it has.

    Args:
        param: The parameter.
        use: One of its recorded uses.
        vectors: The chunk's vectors at the use's output, ``[V, *z]``.
        gathered: The vectors at each function's output, each sample's rows
            gathered, ``[V, B, T, F]``.
        rows_of: The rows each sample owns of every function's output.

    Returns:
        The form and ``(inputs, vectors)`` in factor layout, or ``None`` and
        explicit columns ``[B, V, ...]`` (a bias; a normalization weight:
        ``Σ_t x̂[t] ⊙ s̃[t]``).
    """
    if isinstance(use, LayerCall):
        per_group = use.output_vectors(vectors)  # [V, B, G, T, O]
        if param is use.module.weight and isinstance(use.module, SCALE_LAYERS):
            # BatchNorm: a scale of the normalized input x̂, Σ_t s̃[t] ⊙ x̂[t]
            scaled = (per_group * use.layer_inputs()).sum(3)
            return None, scaled.flatten(2).transpose(0, 1)
        if param is use.module.weight:
            return "conv", (use.layer_inputs(), per_group)
        return None, per_group.sum(3).flatten(2).transpose(0, 1)
    at_rows = gathered[id(use)]  # [V, B, T, F]
    rows = rows_of[id(use)]
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
    """``tensor[..., R, F]`` at rows ``[B, T]``; row index ``R`` gives zeros.

    Sample-major rows without padding (``rows`` is ``0, …, R - 1``) are a view.
    """
    count = tensor.shape[-2]
    if rows.numel() == count and torch.equal(
        rows.flatten(), torch.arange(count, device=rows.device)
    ):
        return tensor.reshape(*tensor.shape[:-2], *rows.shape, tensor.shape[-1])
    zero = tensor.new_zeros(*tensor.shape[:-2], 1, tensor.shape[-1])
    return torch.cat([tensor, zero], dim=-2)[..., rows, :]


def _chunk_rows(calls: list[Use], output: Tensor, generator: torch.Generator) -> Rows:
    """The rows of every function's output each sample of a chunk owns.

    Read off the probe vectors (:func:`_probed_rows`), as for the whole batch
    (:meth:`_Forward.resolve_rows`).

    Raises:
        UnsupportedLayerError: If they cannot be read off for a chunk although
            they could for the whole batch.
    """
    functions = [c for c in calls if isinstance(c, FunctionUse)]
    rows_of = {}
    for use, rows in _probed_rows(functions, output, generator):
        if rows is None:
            raise UnsupportedLayerError(
                f"The rows of a {use.kind} call do not belong to single samples "
                "in a chunk of the mini-batch although they did for the whole "
                "batch; pass a larger memory_budget to process it at once."
            )
        rows_of[id(use)] = rows
    return rows_of


def _probed_rows(
    functions: list[FunctionUse], output: Tensor, generator: torch.Generator
) -> list[tuple[FunctionUse, Tensor | None]]:
    """Each function use with the rows each sample owns of its output, or ``None``.

    The probe vectors (:func:`~vivit.engines.func.functional.probe_vectors`) are
    pushed back through the graph of ``output`` in one pass of their own.
    """
    if not functions:
        return []
    probes = probe_vectors(output.detach()[None], generator)
    at_outputs = BatchedVJP()(
        output, [f.output for f in functions], probes, len(probes)
    )
    return [
        (use, sample_rows(use.rows(at), output.shape[0]))
        for use, at in zip(functions, at_outputs, strict=True)
    ]


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    """``torch.cat``, without copying a single contiguous part."""
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


def _place(
    whole: Tensor | None, part: Tensor, start: int, total: int, dim: int
) -> Tensor:
    """A chunk's ``part`` (samples from ``start`` along ``dim``) in the batch's tensor.

    A part of the whole batch is kept as it is (contiguous); otherwise the batch's
    tensor is allocated with the first chunk and each part copied into place, so
    no list of the chunks' parts is kept besides it.
    """
    if part.shape[dim] == total:
        return part.contiguous()
    if whole is None:
        shape = list(part.shape)
        shape[dim] = total
        whole = part.new_empty(shape)
    whole.narrow(dim, start, part.shape[dim]).copy_(part)
    return whole


def _rows(samples: tuple[int, ...], total: int) -> slice | list[int]:
    """Index of the curvature samples: a view (``slice``) if they are every sample."""
    return slice(None) if samples == tuple(range(total)) else list(samples)


def _calls(calls_of: dict[int, list[Use]]) -> list[Use]:
    """The distinct recorded calls, in a fixed order."""
    return list({id(c): c for cs in calls_of.values() for c in cs}.values())


def _batch_info(
    loss_curvature: LossCurvature, output: Tensor, request: CurvatureRequest
) -> BatchInfo:
    batch_size = output.shape[0]
    subsampling = request.subsampling
    samples = tuple(range(batch_size)) if subsampling is None else tuple(subsampling)
    mc_samples = request.mc_samples
    return BatchInfo(
        normalization=loss_curvature.normalization,
        ggn_samples=samples,
        columns_per_sample=loss_curvature.columns_per_sample(
            mc_samples, request.mc_per
        ),
        mc_samples=mc_samples,
    )


def _contribution(
    param: Parameter, entry: _Collected, batch: BatchInfo, request: CurvatureRequest
) -> ParamContribution:
    """Assemble a parameter's factors (views of its collected tensors where it can).

    Without a subsampling, ``V`` and the per-sample gradients view the same
    vectors and inputs (explicit columns: ``V`` and the gradients are copied, so
    that the columns of all vectors are freed). A parameter with several forms
    (a tied embedding table) gets their sum.
    """
    columns = batch.columns_per_sample
    ggn: list[ParamFactors] = []
    grad: list[ParamFactors] = []
    for form, (inputs, vectors) in entry.forms.items():
        samples = _rows(batch.ggn_samples, inputs.shape[0])
        if form == "embedding":
            ggn.append(
                EmbeddingFactors(
                    inputs[samples], vectors[:columns, samples], param.shape
                )
            )
            grad.append(EmbeddingFactors(inputs, vectors[columns:], param.shape))
            continue
        transposed = form == "linear_t"
        ggn.append(
            OuterProductFactors(
                inputs[samples], vectors[:columns, samples], param.shape, transposed
            )
        )
        grad.append(
            OuterProductFactors(inputs, vectors[columns:], param.shape, transposed)
        )
    if entry.columns is not None:
        dense = entry.columns  # [N, V, *shape]
        samples = _rows(batch.ggn_samples, dense.shape[0])
        # both parts copied, so that the [N, V, *shape] columns are freed
        ggn.append(DenseFactors(dense[samples, :columns].contiguous()))
        grad.append(DenseFactors(dense[:, columns:].clone()))
    return ParamContribution(
        ggn=_summed(ggn),
        grad=_summed(grad) if request.compute_gradients else None,
        batch=batch,
    )


def _summed(parts: list[ParamFactors]) -> ParamFactors:
    """One form as it is, several as their sum."""
    return parts[0] if len(parts) == 1 else SumFactors(parts)


class _Forward:
    """The model's forward pass as the engine runs it: factor-form layers recorded.

    Args:
        model: The network.
        params: The requested parameters.
        selector: Picks the output tensor from the model's return value.

    Attributes:
        capture: Records the calls of factor-form layers (the last pass's).
        width: Entries the leaf layers produced per sample (measured once).
    """

    def __init__(self, model: Module, params: list[Parameter], selector):
        self.model = model
        self.params = params
        self.selector = selector
        self.capture = LayerCapture(model, params)
        self.functions = FunctionCapture(params)
        self.width = _ActivationWidth(model)
        # draws the probe vectors; the caller's generators are left alone
        self.generator = torch.Generator(device=params[0].device).manual_seed(0)

    def __call__(self, inputs: ModelInputs, measure: bool = False) -> Tensor:
        """The selected model output of ``inputs``, layer calls recorded.

        Args:
            inputs: A batch of inputs (a tensor or a dict of keyword tensors).
            measure: Also measure the activation width.

        Returns:
            The output tensor the loss is computed from.
        """
        with ExitStack() as stack:
            stack.enter_context(self.capture.recording())
            self.functions.uses = []
            stack.enter_context(self.functions)
            if measure:
                stack.enter_context(self.width.measuring())
            output = select_output(call_model(self.model, inputs), self.selector)
        if measure:  # activations outside leaf modules (attention, addmm)
            calls = {id(u): u for u in self.functions.uses}.values()
            entries = sum(u.output.numel() for u in calls)
            self.width.at_least(entries // num_samples(inputs))
        return output

    def per_sample_columns(
        self,
        dense: list[Parameter],
        inputs: ModelInputs,
        vectors: VectorStack,
        per_pass: int,
    ) -> list[Tensor] | None:
        """Explicit columns of ``dense``, vectorized over the samples.

        Args:
            dense: The parameters without a factor form.
            inputs: The chunk's inputs ``[B, *in]`` (or a dict of them).
            vectors: ``[V, B, *out]`` (formed here).
            per_pass: Vectors per vmapped pullback.

        Returns:
            ``[B, V, *param.shape]`` per parameter, or ``None`` where the model
            cannot run under ``vmap`` (:func:`~vivit.engines.func.vjp.per_sample_vjp`).
        """
        names = {id(p): name for name, p in self.model.named_parameters()}

        def sample_output(values: list[Tensor], x: ModelInputs) -> Tensor:
            replaced = {names[id(p)]: v for p, v in zip(dense, values, strict=True)}
            one = map_inputs(x, lambda tensor: tensor[None])
            args, kwargs = ((), one) if isinstance(one, Mapping) else ((one,), {})
            output = torch.func.functional_call(self.model, replaced, args, kwargs)
            return select_output(output, self.selector)[0]

        return per_sample_vjp(sample_output, dense, inputs, vectors[:], per_pass)

    def forget(self) -> None:
        """Drop the last pass's records (they hold its graph)."""
        self.capture.calls = []
        self.functions.uses = []

    def factor_uses(self, output: Tensor) -> dict[int, list[Use]]:
        """Parameters whose every use in the graph of ``output`` was recorded.

        Args:
            output: The model output of the recorded forward pass.

        Returns:
            Map from ``id(param)`` to its recorded uses (layer calls and function
            uses), for parameters none of whose recorded tensors changed in
            place since.
        """
        uses_of: dict[int, list[Use]] = {}
        params: dict[int, Parameter] = {}
        for call in self.capture.calls:
            for param in (call.module.weight, call.module.bias):
                if param is not None and param.requires_grad:
                    uses_of.setdefault(id(param), []).append(call)
                    params[id(param)] = param
        for use in self.functions.uses:
            for param in use.params():
                if param.requires_grad:
                    uses_of.setdefault(id(param), []).append(use)
                    params[id(param)] = param
        counted = count_uses(output, list(params.values()))
        return {
            key: uses
            for key, uses in uses_of.items()
            if counted[key] == len(uses) and all(u.unchanged() for u in uses)
        }

    def resolve_rows(self, output: Tensor, uses_of: dict[int, list[Use]]) -> Rows:
        """Which rows of every function's output each sample owns.

        Probe vectors (:func:`~vivit.engines.func.functional.probe_vectors`) are
        pushed back through the graph of ``output``; a parameter with a use
        whose rows are not each owned by one sample (a table looked up for
        every sample alike) loses its factor form (removed from ``uses_of``).

        Args:
            output: The model output of the recorded forward pass.
            uses_of: The parameters' uses (:meth:`factor_uses`), changed in place.

        Returns:
            Row index ``[N, T]`` per function use (by ``id``).
        """
        functions = [c for c in _calls(uses_of) if isinstance(c, FunctionUse)]
        rows_of = {
            id(use): rows
            for use, rows in _probed_rows(functions, output, self.generator)
            if rows is not None
        }
        for key in [k for k, uses in uses_of.items() if _unresolved(uses, rows_of)]:
            del uses_of[key]
        return rows_of

    def unrecorded(self, inputs: ModelInputs) -> Tensor:
        """The selected output without recording or gradients (checks)."""
        with torch.no_grad():
            return select_output(call_model(self.model, inputs), self.selector)


def _unresolved(uses: list[Use], rows_of: Rows) -> bool:
    """Whether some function use's rows are not known."""
    return any(isinstance(u, FunctionUse) and id(u) not in rows_of for u in uses)


class _ActivationWidth:
    """Counts tensor entries the leaf layers produce per sample in one forward pass."""

    def __init__(self, model: Module):
        self._model = model
        self._entries = 0
        self._samples = 1
        self._floor = 0

    def measuring(self) -> ExitStack:
        """Context in which the forward pass is measured (hooks removed on exit)."""
        stack = ExitStack()
        for module in self._model.modules():
            if next(module.children(), None) is None:
                stack.callback(module.register_forward_hook(self._count).remove)
        return stack

    def _count(self, module: Module, args: tuple, output) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        for tensor in outputs:
            if isinstance(tensor, Tensor) and tensor.dim() > 0:
                self._entries += tensor.numel()
                self._samples = tensor.shape[0]

    def at_least(self, entries: int) -> None:
        """Count at least ``entries`` per sample (outputs of recorded functions)."""
        self._floor = max(self._floor, entries)

    @property
    def per_sample(self) -> int:
        """Entries per sample (at least 1)."""
        return max(1, self._floor, self._entries // max(self._samples, 1))
