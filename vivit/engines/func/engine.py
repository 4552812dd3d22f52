"""The func engine: curvature factors of any model whose samples are independent.

No ``backpack.extend`` and nothing left on the caller's model: temporary forward
hooks record the inputs and outputs of Linear and convolution layers, and
``torch.autograd.grad`` (vmapped over stacked vectors, ``is_grads_batched``, or in a
loop where that is faster, see :class:`~vivit.engines.func.vjp.BatchedVJP`) pushes
back the columns of the loss-Hessian root ``√R S_n`` (``docs/math.rst``, "The GGN
and its square root") together with the per-sample output gradients ``∂ℓ_n/∂f_n``:

* Linear and convolution weights keep layer inputs and backpropagated vectors
  (:class:`~vivit.gram.OuterProductFactors`), their biases the vectors summed over
  positions; a layer called several times stacks its calls along the positions.
* Every other parameter (normalization layers, embeddings, attention's in-projection,
  LSTM weights, parameters used outside such layers) gets its columns of ``V``
  explicitly (:class:`~vivit.gram.DenseFactors`): autograd sums a batch's
  contributions at a parameter, so each sample's vectors are pushed back in an
  otherwise zero batch (:class:`~vivit.engines.func.columns.OneHotPerSample`).

Cost model. With ``N`` samples, ``V = C + 1`` vectors per sample (``C·T + 1``
for cross-entropy on ``[N, C, *T]``; ``M + 1`` with MC, ``M·T + 1`` per token),
formed a pass's vectors at a time (:mod:`vivit.engines.func.columns`), ``w``
activation entries per sample (measured in the first forward pass) and ``D``
entries of the parameters without a factor form, the engine processes ``B``
samples at a time. ``B`` is the largest chunk whose memory stays below
``memory_budget`` entries, at most :data:`DENSE_CHUNK` if ``D > 0``; vectors are
split further if even one sample does not fit. Per chunk: one vmapped backward
pass of the ``V`` vectors (each holding the chunk's samples) to the recorded
layer outputs, memory ``≈ V·B·w`` entries; and, if ``D > 0``, one of ``B·V``
one-hot vectors to the other parameters, memory ``≈ B·V·(B·w + D)`` and ``B``
times the necessary work. In total: the work of ``V`` backward passes of the
batch (``B·V`` with ``D > 0``), ``N·V`` rows of ``D`` entries for the parameters
without a factor form, and factor forms of ``N·V·(T·O) + N·T·P`` entries per
Linear or convolution weight (``V`` and the per-sample gradients view them; its
bias keeps their sum over the positions; the chunks are written into place).

Forward passes (calls of the model). Two when one chunk holds the batch
(``B = N``): the first computes the loss, the gradient and the factors (its
graph is kept for the backward passes of the vectors); the second, without
gradients, checks that the samples are independent
(:func:`~vivit.engines.func.independence.check_samples_independent`), which one
evaluation cannot show. With ``B < N``, each chunk runs a forward pass of its
own ``B`` samples besides (together one more pass over the batch): the graph of
the whole batch would hold the memory the chunks save, and the one-hot backward
pass through it would do ``N/B`` times the work. User hooks see every call; the
check's runs without gradients.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

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
from vivit.engines.func.capture import LayerCall, LayerCapture
from vivit.engines.func.columns import OneHotPerSample, VectorStack
from vivit.engines.func.independence import check_layers, check_samples_independent
from vivit.engines.func.vjp import BatchedVJP
from vivit.errors import InvalidArgumentError, UnsupportedLayerError
from vivit.gram import DenseFactors, OuterProductFactors
from vivit.gram.memory import check_gram_fits
from vivit.losses import LossCurvature
from vivit.model_inputs import ModelInputs, call_model, num_samples, take_samples

#: Default memory budget of one chunk, in tensor entries (2**27: 512 MiB float32).
DEFAULT_MEMORY_BUDGET = 2**27
#: At most this many samples per chunk when some parameter has no factor form:
#: the one-hot backward pass does ``B`` times the necessary work, so small chunks
#: are faster (transformer block, N=32: 8.1 s with B=32, 0.8 s with B=4).
DENSE_CHUNK = 4


@dataclass
class _Collected:
    """What the chunks leave for one parameter, over the whole batch.

    Each chunk's part is written into place as it arrives (see :func:`_place`),
    so no chunk outlives its own pass; with one chunk, its tensors are kept.
    """

    layer_inputs: Tensor | None = None  # weight: [N, G, T, P]
    vectors: Tensor | None = None  # weight: [V, N, G, T, O]; bias: [V, N, G, O]
    columns: Tensor | None = None  # no factor form: [N, V, *shape]


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
        calls_of = forward.capture.factor_params(output)
        dense = [p for p in params if id(p) not in calls_of]
        chunk, per_pass = self.chunking(
            num_samples(inputs),
            batch.columns_per_sample + request.compute_gradients,
            forward.width.per_sample,
            sum(p.numel() for p in dense),
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
        factor = set(calls_of)
        first = (output, calls_of) if reuse else None
        del calls_of  # chunks: the whole batch's layer calls are not kept
        collected = self._collect(
            forward, inputs, dense, vectors, (chunk, per_pass), factor, first
        )
        # the forward graph (its saved activations, the recorded layer outputs)
        # is not needed while the sink forms Gram blocks: free it first
        del vectors, first, output
        loss = loss.detach()
        forward.capture.calls = []
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

    def chunking(
        self, num_samples: int, num_vectors: int, width: int, dense: int
    ) -> tuple[int, int]:
        """Samples per chunk and vectors per backward pass (see the cost model).

        :mod:`vivit.memory` estimates a request's memory with it.

        Args:
            num_samples: Samples of the batch ``N``.
            num_vectors: Vectors per sample ``V``.
            width: Activation entries per sample ``w``.
            dense: Entries ``D`` of the parameters without a factor form.

        Returns:
            ``B`` and the vectors per backward pass.
        """

        def memory(samples: int) -> int:
            factor = num_vectors * samples * width
            one_hot = samples * num_vectors * (samples * width + dense) if dense else 0
            return max(factor, one_hot)

        samples = min(num_samples, DENSE_CHUNK) if dense else num_samples
        while samples > 1 and memory(samples) > self.memory_budget:
            samples = (samples + 1) // 2
        per_vector = samples * width + dense
        return samples, max(1, self.memory_budget // max(per_vector, 1))

    def _collect(
        self,
        forward: _Forward,
        inputs: Tensor,
        dense: list[Parameter],
        vectors: Tensor,
        chunking: tuple[int, int],
        factor: set[int],
        first: tuple[Tensor, dict[int, list[LayerCall]]] | None,
    ) -> dict[int, _Collected]:
        """Every parameter's factors, ``chunk`` samples at a time.

        ``chunking`` is ``(samples per chunk, vectors per backward pass)``;
        ``factor`` the parameters with a factor form in the first forward pass
        of the whole batch. ``first`` is that pass's output and layer calls when
        one chunk holds the whole batch: its graph is reused, so the batch is
        evaluated once. Otherwise each chunk runs its own forward pass (the graph
        of the whole batch would need the memory the chunks save), which must
        use the layers as the first did.
        """
        chunk, per_pass = chunking
        total = num_samples(inputs)
        collected = {id(p): _Collected() for p in forward.capture.params}
        to_layers, to_params = BatchedVJP(), BatchedVJP()
        for start in range(0, total, chunk):
            if first is not None:
                output, calls_of = first
            else:
                output = forward(take_samples(inputs, slice(start, start + chunk)))
                calls_of = forward.capture.factor_params(output)
            if set(calls_of) != factor:
                raise UnsupportedLayerError(
                    "The model uses its Linear or convolution layers differently for "
                    "different chunks of the mini-batch (data-dependent control "
                    "flow); the func engine needs the same computation for every "
                    "sample chunk. Pass a larger memory_budget to process the batch "
                    "at once."
                )
            block = vectors.samples(start, start + output.shape[0])
            self._factor_chunk(
                to_layers(
                    output, [c.output for c in _calls(calls_of)], block, per_pass
                ),
                calls_of,
                forward.capture.params,
                collected,
                (start, total),
            )
            if dense:
                columns = to_params(output, dense, OneHotPerSample(block), per_pass)
                for param, cols in zip(dense, columns, strict=True):
                    cols = cols.reshape(output.shape[0], len(vectors), *param.shape)
                    entry = collected[id(param)]
                    entry.columns = _place(entry.columns, cols, start, total, dim=0)
                del columns, cols
        return collected

    @staticmethod
    def _factor_chunk(
        at_outputs: list[Tensor],
        calls_of: dict[int, list[LayerCall]],
        params: list[Parameter],
        collected: dict[int, _Collected],
        place: tuple[int, int],
    ) -> None:
        """Keep the factors of the chunk's vectors at the recorded layer outputs.

        ``place`` is the chunk's first sample and the batch's samples. A weight
        and its bias share the vectors of their calls; the bias keeps only their
        sum over the positions.
        """
        start, total = place
        index = {id(c): i for i, c in enumerate(_calls(calls_of))}
        shared: dict[tuple[int, ...], Tensor] = {}
        for param in params:
            uses = calls_of.get(id(param))
            if uses is None:
                continue
            key = tuple(id(c) for c in uses)
            if key not in shared:
                parts = [uses[0].output_vectors(at_outputs[index[id(c)]]) for c in uses]
                shared[key] = _cat(parts, dim=3)
            vectors = shared[key]
            entry = collected[id(param)]
            if param is uses[0].module.weight:
                entry.vectors = _place(entry.vectors, vectors, start, total, dim=1)
                layer_inputs = _cat([c.layer_inputs() for c in uses], dim=2)
                entry.layer_inputs = _place(
                    entry.layer_inputs, layer_inputs, start, total, dim=0
                )
            else:  # bias: summed over the positions
                entry.vectors = _place(
                    entry.vectors, vectors.sum(3), start, total, dim=1
                )


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


def _calls(calls_of: dict[int, list[LayerCall]]) -> list[LayerCall]:
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
    that the columns of all vectors are freed).
    """
    columns = batch.columns_per_sample
    if entry.columns is not None:
        dense = entry.columns  # [N, V, *shape]
        samples = _rows(batch.ggn_samples, dense.shape[0])
        # both parts copied, so that the [N, V, *shape] columns are freed
        ggn = DenseFactors(dense[samples, :columns].contiguous())
        grad = (
            DenseFactors(dense[:, columns:].clone())
            if request.compute_gradients
            else None
        )
        return ParamContribution(ggn=ggn, grad=grad, batch=batch)
    vectors = entry.vectors  # weight: [V, N, G, T, O]; bias: [V, N, G, O]
    samples = _rows(batch.ggn_samples, vectors.shape[1])
    if entry.layer_inputs is not None:  # weight: outer-product factors
        layer_inputs = entry.layer_inputs
        ggn = OuterProductFactors(
            layer_inputs[samples], vectors[:columns, samples], param.shape
        )
        grad = (
            OuterProductFactors(layer_inputs, vectors[columns:], param.shape)
            if request.compute_gradients
            else None
        )
        return ParamContribution(ggn=ggn, grad=grad, batch=batch)
    summed = vectors.flatten(start_dim=2)  # bias: [V, N, G·O]
    ggn = DenseFactors(summed[:columns, samples].transpose(0, 1))
    grad = (
        DenseFactors(summed[columns:].transpose(0, 1))
        if request.compute_gradients
        else None
    )
    return ParamContribution(ggn=ggn, grad=grad, batch=batch)


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
        self.selector = selector
        self.capture = LayerCapture(model, params)
        self.width = _ActivationWidth(model)

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
            if measure:
                stack.enter_context(self.width.measuring())
            return select_output(call_model(self.model, inputs), self.selector)

    def unrecorded(self, inputs: ModelInputs) -> Tensor:
        """The selected output without recording or gradients (checks)."""
        with torch.no_grad():
            return select_output(call_model(self.model, inputs), self.selector)


class _ActivationWidth:
    """Counts tensor entries the leaf layers produce per sample in one forward pass."""

    def __init__(self, model: Module):
        self._model = model
        self._entries = 0
        self._samples = 1

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

    @property
    def per_sample(self) -> int:
        """Entries per sample (at least 1)."""
        return max(1, self._entries // max(self._samples, 1))
