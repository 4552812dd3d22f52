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
- **func** (:mod:`vivit.engines.func`): never explicit for a weight; it
  keeps the vectors ``[V, N, G, T, O]`` and inputs ``[N, G, T, P]`` (its own
  chunks written into place; a Linear layer's input is its caller's tensor,
  counted with the activations, unless the engine ran in several chunks of its
  own) and hands on the per-sample gradients and ``V`` as views of them; only
  with a subsampling ``V`` copies the curvature samples' rows
  (``N_S·C·G·T·O``, ``N_S·G·T·P``). A weight's bias keeps the vectors summed
  over the positions, ``[V, N, G·O]`` (the same rule for ``V``); every other
  parameter ``(N + N_S·C)·numel`` (``V`` and the gradients copied; BatchNorm's
  from the vectors at its output, the others' from a one-hot pass,
  :func:`func_one_hot`). Nothing
  else outlives the chunk it came from.
- ``gram_dtype``: the collector casts each factor to it; only the viewed rows
  are copied (``V·N`` becomes ``N``), and the factors the engine handed on are
  freed (they are part of the run's transient).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.nn import Parameter
from torch.nn.modules.batchnorm import _BatchNorm

from vivit.gram.outer import COMPACT_RATIO, GGN_COMPACT_RATIO, holds_v_explicitly
from vivit.memory.probe import OUTER_PRODUCT_LAYERS, ProbedLayer


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
    """

    kept: int
    ggn: int
    caller_inputs: int = 0


def kind(layer: ProbedLayer | None, name: str) -> str:
    """``"weight"``, ``"bias"`` (of a Linear or convolution layer) or ``"other"``."""
    outer = layer is not None and isinstance(layer.module, OUTER_PRODUCT_LAYERS)
    return name if outer and name in ("weight", "bias") else "other"


def func_one_hot(layer: ProbedLayer | None, name: str) -> bool:
    """Whether the func engine pushes a parameter's vectors back one sample at a time.

    Linear and convolution weights and biases, and BatchNorm's (evaluation mode),
    take their columns from the vectors at the layer output instead
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
) -> ParamEntries:
    """A parameter's entries as the func engine keeps them.

    ``own_chunks``: the engine runs the block in several chunks of its own
    (:meth:`FuncEngine.chunking <vivit.engines.func.FuncEngine.chunking>`), so a
    Linear layer's inputs are copied into place.
    """
    n, n_s, c, v = counts.samples, counts.curvature, counts.columns, counts.vectors
    full = n if counts.cast else v * n  # the gradients: a view of all vectors
    part = kind(layer, name)
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
