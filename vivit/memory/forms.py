"""Entries each engine keeps per parameter: the factor forms the run builds.

:mod:`vivit.memory.estimate` sums these over the probed layers. Counts are tensor
entries; ``N`` samples, ``N_S`` curvature samples, ``C`` columns per sample
(``M`` with Monte-Carlo sampling), ``V = C + 1`` vectors per sample, and per
Linear or convolution weight ``G`` groups, ``T`` positions, ``P`` inputs and
``O`` outputs per group (``docs/math.rst``, "Memory of a request").

- **BackPACK** (:mod:`vivit.engines.backpack`): a weight keeps ``V`` and the
  per-sample gradients each as factors (``s̃``: ``N_S·C·G·T·O`` and
  ``N·G·T·O``, a convolution's unfolded input ``N·G·T·P`` shared by both) or
  explicitly (``N_S·C·numel``, ``N·numel``), as
  :meth:`~vivit.gram.OuterProductFactors.compact` decides; a Linear layer's
  input is its caller's tensor (counted with the activations) unless the
  factors are cast to ``gram_dtype``; every other parameter keeps its columns,
  ``(N_S·C + N)·numel``.
- **func** (:mod:`vivit.engines.func`): never explicit for a weight; a
  parameter that no Linear or convolution layer owns but that goes only
  through functions the engine recognizes (:func:`function_forms`: attention's
  projections, a Conv1D's ``addmm``, an embedding table, also tied) keeps, per
  form, vectors ``[V, N, T, O]`` and inputs ``[N, T, P]`` (indices ``[N, T]``)
  like a Linear weight; biases and normalization weights explicit columns
  (from the vectors, not from one-hot batches; BatchNorm's too,
  :func:`func_one_hot`); it
  keeps the vectors ``[V, N, G, T, O]`` and inputs ``[N, G, T, P]`` (its own
  chunks written into place; a Linear layer's input is its caller's tensor,
  counted with the activations, unless the engine ran in several chunks of its
  own) and hands on the per-sample gradients and ``V`` as views of them; only
  with a subsampling ``V`` copies the curvature samples' rows
  (``N_S·C·G·T·O``, ``N_S·G·T·P``). A weight's bias keeps the vectors summed
  over the positions, ``[V, N, G·O]`` (the same rule for ``V``); every other
  parameter ``(N + N_S·C)·numel`` (``V`` and the gradients copied). Nothing
  else outlives the chunk it came from.
- ``gram_dtype``: the collector casts each factor to it; only the viewed rows
  are copied (``V·N`` becomes ``N``), and the factors the engine handed on are
  freed (they are part of the run's transient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.modules.batchnorm import _BatchNorm
from torch.random import fork_rng

from vivit.engines.base import OutputSelector, select_output
from vivit.engines.func.capture import count_uses
from vivit.engines.func.functional import (
    FunctionCapture,
    probe_vectors,
    sample_rows,
)
from vivit.engines.func.vjp import BatchedVJP
from vivit.gram.outer import COMPACT_RATIO, GGN_COMPACT_RATIO, holds_v_explicitly
from vivit.memory.probe import OUTER_PRODUCT_LAYERS, ProbedLayer
from vivit.model_inputs import ModelInputs, call_model, input_tensors, num_samples


@dataclass(frozen=True)
class Counts:
    """Sample counts of a request (or of one block of it).

    Attributes:
        samples: ``N``, samples whose per-sample gradients are kept.
        curvature: ``N_S``, samples whose columns of ``V`` are kept.
        columns: ``C`` or ``M``, columns of ``V`` per sample.
        cast: Whether the factors are cast to another type (``gram_dtype``).
    """

    samples: int
    curvature: int
    columns: int
    cast: bool

    @property
    def vectors(self) -> int:
        """``V = C + 1``: vectors backpropagated per sample (with the gradient)."""
        return self.columns + 1


@dataclass(frozen=True)
class ParamEntries:
    """What a parameter's factors take, in entries.

    Attributes:
        kept: Kept after the run (``V`` and per-sample gradients).
        ggn: Those of ``V`` alone (rescaled and copied when blocks are merged).
        caller_inputs: A Linear layer's input that the factors keep without a
            copy (per sample; counted with the activations).
        gathered: Those of ``kept`` that the func engine copied out of the
            vectors at a call's output (alive with them while a chunk runs).
    """

    kept: int
    ggn: int
    caller_inputs: int = 0
    gathered: int = 0


@dataclass(frozen=True)
class FormPart:
    """One factor form of a parameter found at the function level, per sample.

    Attributes:
        kind: ``"outer"`` (``F.linear``, ``addmm``) or ``"embedding"``.
        positions: Rows per sample over the uses of this form ``T``.
        inputs: Input entries per row ``P`` (``1``: an index).
        outputs: Output entries per row ``O``.
        gathered: Whether its vectors are a copy of those at the calls' outputs
            (rows not sample-major, as in ``[T, N, D]``) rather than a view.
    """

    kind: str
    positions: int
    inputs: int
    outputs: int
    gathered: bool


def function_forms(
    model: Module,
    example_inputs: ModelInputs,
    params: list[Parameter],
    selector: OutputSelector = None,
) -> tuple[dict[int, tuple[FormPart, ...]], int]:
    """The forms the func engine finds at the function level, from example inputs.

    One forward pass of the example samples with gradients (the graph decides,
    as in the engine, whether every use of a parameter was recorded), the
    caller's random numbers left as they were. Only parameters that no Linear
    or convolution layer owns matter here; which sample owns a row is taken to
    be the engine's finding (a table looked up for every sample alike is
    counted with a factor form).

    Args:
        model: The network.
        example_inputs: A few input samples (or a dict of them).
        params: The requested parameters.
        selector: Picks the output tensor from the model's return value.

    Returns:
        Map from ``id(param)`` to its factor forms (empty: explicit columns
        computed from the vectors, a bias or normalization weight), and the
        entries per sample of the recorded calls' outputs (where the vectors
        are pushed back to).
    """
    capture = FunctionCapture(params)
    num = num_samples(example_inputs)
    device = input_tensors(example_inputs)[0].device
    devices = [device] if device.type == "cuda" else []
    with fork_rng(devices=devices), torch.enable_grad():
        with capture:
            output = select_output(call_model(model, example_inputs), selector)
        uses_of: dict[int, list] = {}
        for use in capture.uses:
            for param in use.params():
                uses_of.setdefault(id(param), []).append(use)
        if not uses_of:
            return {}, 0
        calls = list({id(u): u for us in uses_of.values() for u in us}.values())
        counted = count_uses(output, [p for p in params if id(p) in uses_of])
        generator = torch.Generator(device=output.device).manual_seed(0)
        probes = probe_vectors(output.detach()[None], generator)
        at_outputs = BatchedVJP()(
            output, [u.output for u in calls], probes, len(probes)
        )
    rows_of = {
        id(u): sample_rows(u.rows(at), num)
        for u, at in zip(calls, at_outputs, strict=True)
    }
    forms: dict[int, tuple[FormPart, ...]] = {}
    for param in params:
        uses = uses_of.get(id(param), [])
        if (
            not uses
            or counted[id(param)] != len(uses)
            or any(rows_of[id(u)] is None for u in uses)
        ):
            continue
        parts: dict[str, list] = {}
        for use in uses:
            if param is not use.weight or use.kind == "norm":
                continue
            rows = rows_of[id(use)]
            kind = "embedding" if use.kind == "embedding" else "outer"
            size = 1 if kind == "embedding" else use.input_rows().shape[1]
            entry = parts.setdefault(
                kind, [0, size, use.rows(use.output).shape[1], False]
            )
            entry[0] += rows.shape[1]
            entry[3] |= not _sample_major(rows)
        forms[id(param)] = tuple(FormPart(k, *v) for k, v in parts.items())
    return forms, sum(u.output.numel() // num for u in calls)


def _sample_major(rows: Tensor) -> bool:
    """Whether a use's rows ``[N, T]`` are ``0, …, N·T - 1`` (its vectors a view)."""
    return torch.equal(rows.flatten(), torch.arange(rows.numel(), device=rows.device))


def kind(layer: ProbedLayer | None, name: str) -> str:
    """``"weight"``, ``"bias"`` (of a Linear or convolution layer) or ``"other"``."""
    outer = layer is not None and isinstance(layer.module, OUTER_PRODUCT_LAYERS)
    return name if outer and name in ("weight", "bias") else "other"


def func_one_hot(layer: ProbedLayer | None, name: str) -> bool:
    """Whether the func engine's module hooks give a parameter no factor form.

    All parameters without a Linear or convolution layer, but BatchNorm's weight
    and bias, whose columns come from the vectors at the layer output
    (:mod:`vivit.engines.func.capture`).
    """
    scale = layer is not None and isinstance(layer.module, _BatchNorm)
    return kind(layer, name) == "other" and not (scale and name in ("weight", "bias"))


def backpack_entries(
    layer: ProbedLayer, name: str, param: Parameter, counts: Counts
) -> ParamEntries:
    """A parameter's entries as the BackPACK engine keeps them."""
    numel = param.numel()
    n, n_s, c = counts.samples, counts.curvature, counts.columns
    if kind(layer, name) != "weight":
        return ParamEntries(kept=(n_s * c + n) * numel, ggn=n_s * c * numel)
    v_explicit = holds_v(layer, c, GGN_COMPACT_RATIO)
    grad_explicit = holds_v(layer, 1, COMPACT_RATIO)
    ggn = n_s * c * (numel if v_explicit else layer.outputs)
    kept = ggn + n * (numel if grad_explicit else layer.outputs)
    # the inputs: a convolution's unfolded copy, or a Linear layer's own
    # (the caller's tensor, copied only where cast)
    rows = n if not grad_explicit else (0 if v_explicit else n_s)
    caller = 0
    if layer.unfolded:
        kept += rows * layer.unfolded
    elif counts.cast:
        kept += (n * (not grad_explicit) + n_s * (not v_explicit)) * layer.inputs
    elif rows:
        caller = layer.inputs
    return ParamEntries(kept=kept, ggn=ggn, caller_inputs=caller)


def func_entries(
    layer: ProbedLayer | None,
    name: str,
    param: Parameter,
    counts: Counts,
    *,
    own_chunks: bool = False,
    forms: dict[int, tuple[FormPart, ...]] | None = None,
) -> ParamEntries:
    """A parameter's entries as the func engine keeps them.

    ``own_chunks``: the engine runs the block in several chunks of its own
    (:meth:`FuncEngine.chunking <vivit.engines.func.FuncEngine.chunking>`), so a
    Linear layer's inputs are copied into place. ``forms``: the parameters'
    forms at the function level (:func:`function_forms`).
    """
    n, n_s, c, v = counts.samples, counts.curvature, counts.columns, counts.vectors
    full = n if counts.cast else v * n  # the gradients: a view of all vectors
    part = kind(layer, name)
    found = (forms or {}).get(id(param), ())
    if part == "other" and found:  # per form: vectors and inputs, copied rows
        rows = n_s if counts.cast or n_s < n else 0
        vectors = sum(f.positions * f.outputs for f in found)
        inputs = sum(f.positions * f.inputs for f in found)
        gathered = sum(f.positions * f.outputs for f in found if f.gathered)
        return ParamEntries(
            kept=(full + rows * c) * vectors + (rows + n) * inputs,
            ggn=n_s * c * vectors,
            gathered=full * gathered,
        )
    if part == "other":  # V and the gradients copied out of all vectors' columns
        numel = param.numel()
        return ParamEntries(kept=(n + n_s * c) * numel, ggn=n_s * c * numel)
    # V: a view of the vectors, unless cast or subsampled (then its rows copied)
    rows = n_s if counts.cast or n_s < n else 0
    groups, positions, inputs, outputs = layer.weight_factor_shape()
    if part == "bias":
        per = groups * outputs
        return ParamEntries(kept=(full + rows * c) * per, ggn=n_s * c * per)
    vectors = groups * positions * outputs
    layer_inputs = groups * positions * inputs
    # the gradients' inputs: the caller's tensor for a Linear layer in one chunk
    copied = counts.cast or bool(layer.unfolded) or own_chunks
    return ParamEntries(
        kept=(full + rows * c) * vectors + (rows + n * copied) * layer_inputs,
        ggn=n_s * c * vectors,
        caller_inputs=0 if copied else layer.inputs,
    )


def holds_v(layer: ProbedLayer, columns: int, ratio: int) -> bool:
    """Whether a weight keeps its columns explicitly: the BackPACK engine's rule.

    Args:
        layer: The probed Linear or convolution layer.
        columns: Columns per sample (``C`` or ``M`` of ``V``, ``1`` of the
            per-sample gradients).
        ratio: ``GGN_COMPACT_RATIO`` for ``V``, ``COMPACT_RATIO`` for gradients.

    Returns:
        What :meth:`OuterProductFactors.compact
        <vivit.gram.outer.OuterProductFactors.compact>` decides for them
        (:func:`~vivit.gram.outer.holds_v_explicitly`).
    """
    groups, positions, in_features, out_features = layer.weight_factor_shape()
    return holds_v_explicitly(
        columns=columns,
        groups=groups,
        positions=positions,
        in_features=in_features,
        out_features=out_features,
        ratio=ratio,
    )
