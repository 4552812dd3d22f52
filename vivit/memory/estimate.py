"""How much memory a curvature request needs, before the backward pass runs.

:func:`estimate_memory` adds what is alive at the peak of ``LowRankGGN(...)``
followed by ``eigh(top_k)`` (shapes as in ``docs/math.rst``). The samples are
run by the engine in blocks of ``B`` samples (``B = N``, or ``chunk_size``, or a
loader's batch size in :func:`estimate_data_set_memory`):

- **activations**: the forward pass's layer outputs of one block,
  ``B · Σ_layers out`` entries (autograd keeps them for the backward pass), and
  the inputs of Linear layers that the factors of the other blocks keep;
- **factors**: per Linear or convolution weight the columns of ``V`` and the
  per-sample gradients, each as its factors (the backpropagated vectors ``s̃``,
  ``N_S · C · out`` entries, ``C`` → ``M`` with Monte-Carlo sampling, or ``N ·
  out``, and a convolution's unfolded input, ``N · T · P``) or explicitly
  (``N_S · C · numel``, ``N · numel``): ``V`` where that is no larger
  (``GGN_COMPACT_RATIO``), the gradients where it is at most ``1 /
  COMPACT_RATIO`` as large (the engine's rule,
  :func:`~vivit.gram.outer.holds_v_explicitly`); every other parameter keeps
  its columns of ``V`` and per-sample gradients (``(N_S · C + N) · numel``);
  all for every sample;
- the larger of the **backward pass's transient** (at every layer the
  backpropagated ``[C, N_B, *shape]`` quantities at its input and output, ``N_B``
  the block's curvature samples, plus a convolution's unfolded input of the
  block while its factors are formed; in several blocks, or the copies of the
  columns of ``V`` rescaled while the blocks are combined) and the
  **eigensolver's** share: the Gram
  matrices it forms (``(N_S·C)²`` entries each, none for ``"matrix_free"``) and
  its workspace, with the largest intermediate of a convolution in factor form
  (forming the Gram matrix through blocks of ``V``, or ``V``-products), which
  :mod:`vivit.gram.planner` caps at its budget (256 MiB).

``N_S`` is the number of curvature samples (the subsampling), ``N`` the
mini-batch size. ``solver="auto"`` is resolved by
:func:`~vivit.linalg.top_k.choose_solver` on factors of the shapes the request
would hold (on the meta device: no entries), so the estimate is for the solver
the request runs. Entries are counted in the parameters' data type, the iterative
solvers' Krylov bases in float64. The estimate leaves out the model, the data and
the loaded libraries; ``tests/memory/test_memory.py`` checks it against the measured
increase of resident memory within a factor of 1.5.

:func:`largest_batch` searches the largest mini-batch whose estimate fits a budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import (
    check_batch_norms,
    check_chunk_size,
    check_inputs_match,
    check_mc_samples,
    check_model,
    check_params,
    param_group_lists,
)
from vivit.errors import InvalidArgumentError
from vivit.gram import (
    DenseFactors,
    OuterProductFactors,
    ParamFactors,
    SampleBlockFactors,
)
from vivit.gram.memory import dense_workspace_bytes, gram_bytes, itemsize
from vivit.gram.outer import COMPACT_RATIO, GGN_COMPACT_RATIO, holds_v_explicitly
from vivit.gram.planner import budget_entries
from vivit.linalg.top_k import (
    check_solver,
    choose_solver,
    iterative_workspace_bytes,
    solver_block_size,
)
from vivit.memory.probe import (
    OUTER_PRODUCT_LAYERS,
    ProbedLayer,
    check_example_inputs,
    probe,
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory a :class:`~vivit.LowRankGGN` request needs, in bytes.

    Attributes:
        activations: Layer outputs of the forward pass.
        factors: Factors of ``V`` and of the per-sample gradients kept for products.
        backward: Transient backpropagated quantities of the backward pass (in
            blocks: or the rescaled copies of the blocks' columns of ``V`` while
            they are combined, whichever is larger).
        grams: Gram matrices the eigensolver forms.
        solver_workspace: The eigensolver's workspace, or the temporaries of
            forming a Gram matrix where those are larger.
        solver: The solver the estimate is for (``"auto"`` resolved).
        num_rows: Side length ``N·C`` of the Gram matrix.
    """

    activations: int
    factors: int
    backward: int
    grams: int
    solver_workspace: int
    solver: str
    num_rows: int

    @property
    def total(self) -> int:
        """Peak bytes: activations, factors and the larger of the two phases."""
        return (
            self.activations
            + self.factors
            + max(self.backward, self.grams + self.solver_workspace)
        )


def estimate_memory(
    model: Module,
    example_inputs: Tensor,
    batch_size: int,
    *,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
    mc_samples: int = 0,
    num_curvature_samples: int | None = None,
    top_k: int | None = 10,
    solver: str = "auto",
    chunk_size: int | None = None,
) -> MemoryEstimate:
    """Estimate the peak memory of ``LowRankGGN(...)`` followed by ``eigh(top_k)``.

    Runs the model on ``example_inputs`` (one or a few samples, without gradients
    and with the modules' hooks switched off, so BackPACK's stored inputs are left
    alone) to learn the layer shapes; nothing of size ``batch_size`` is allocated.
    The estimate is for the model's parameter data type and device.

    Example::

        estimate = estimate_memory(model, X[:1], batch_size=512, top_k=10)
        print(estimate.total / 2**20, "MiB with the", estimate.solver, "solver")

    Args:
        model: The network (BatchNorm in eval mode).
        example_inputs: A few input samples, ``[n, *input_shape]``.
        batch_size: Mini-batch size ``N`` of the request.
        param_groups: As for :class:`~vivit.LowRankGGN` (``None``: one group).
        mc_samples: As for :class:`~vivit.LowRankGGN`.
        num_curvature_samples: Size of the subsampling (``None``: ``N``).
        top_k: Number of leading eigenpairs asked for (``None``: all).
        solver: As for :class:`~vivit.LowRankGGN`; ``"auto"`` is resolved as the
            request's ``eigh(top_k)`` resolves it: the same cost model, the work
            of the factors the request would hold (their shapes), the memory
            available now; with several groups, the solver of the largest group.
            The factors are the BackPACK engine's (the func engine holds no
            convolution's ``V`` explicitly, so its choice may differ).
        chunk_size: As for :class:`~vivit.LowRankGGN`: the backward pass's
            transient and the activations are those of a chunk (with at most
            ``min(chunk_size, num_curvature_samples)`` curvature samples), the
            kept factors and the Gram matrix those of the whole batch.

    Returns:
        The estimate; ``.total`` is the peak in bytes.

    Raises:
        InvalidArgumentError: For a ``batch_size``, ``top_k``, ``mc_samples``,
            ``solver`` or ``chunk_size`` that a request would refuse, a
            ``num_curvature_samples`` outside ``[1, batch_size]``, or
            ``example_inputs`` without a sample along a batch axis.
        ParamGroupError: For parameter groups a request would refuse, or a model
            without trainable parameters.
        UnsupportedDtypeError: For parameters a request would refuse (16-bit).
        BatchNormTrainingError: For BatchNorm in training mode.
    """
    _check_size(batch_size, "batch_size")
    if num_curvature_samples is not None:
        _check_size(num_curvature_samples, "num_curvature_samples")
        if num_curvature_samples > batch_size:
            raise InvalidArgumentError(
                f"num_curvature_samples={num_curvature_samples} exceeds the "
                f"batch_size={batch_size}: the curvature samples are a subset of "
                "the mini-batch; pass at most batch_size (or None for all)."
            )
    check_chunk_size(chunk_size)
    block = batch_size if chunk_size is None else min(chunk_size, batch_size)
    return _estimate(
        model,
        example_inputs,
        batch_size,
        block,
        model_inputs_kept=False,
        loader_batch=None,
        param_groups=param_groups,
        mc_samples=mc_samples,
        num_curvature_samples=num_curvature_samples,
        top_k=top_k,
        solver=solver,
    )


def estimate_data_set_memory(
    model: Module,
    example_inputs: Tensor,
    num_samples: int,
    batch_size: int,
    *,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
    mc_samples: int = 0,
    top_k: int | None = 10,
    solver: str = "auto",
    chunk_size: int | None = None,
) -> MemoryEstimate:
    """Estimate the peak memory of the GGN of a data set given as a loader.

    ``LowRankGGN(model, loss_func, loader)`` over ``num_samples`` samples that
    the loader yields in batches of ``batch_size`` (each run by the engine on its
    own, every batch in chunks of ``chunk_size``), followed by ``eigh(top_k)``:
    the backward pass's transient and the activations are those of one batch
    (or chunk); the kept factors, the batches' inputs that Linear layers keep,
    and the Gram matrix (side ``num_samples · C``) are those of all samples. The
    loader's own memory (its data set, workers) is left out. Probes the model as
    :func:`estimate_memory` does.

    Example::

        estimate = estimate_data_set_memory(model, X[:1], 10_000, 128, top_k=10)

    Args:
        model: The network (BatchNorm in eval mode).
        example_inputs: A few input samples, ``[n, *input_shape]``.
        num_samples: Samples of the data set (all of them curvature samples).
        batch_size: Samples per batch of the loader.
        param_groups: As for :class:`~vivit.LowRankGGN` (``None``: one group).
        mc_samples: As for :class:`~vivit.LowRankGGN`.
        top_k: Number of leading eigenpairs asked for (``None``: all).
        solver: As for :func:`estimate_memory`.
        chunk_size: As for :class:`~vivit.LowRankGGN` (``None``: whole batches).

    Returns:
        The estimate; ``.total`` is the peak in bytes.

    Raises:
        InvalidArgumentError: For sizes that are not positive integers, options
            that a request would refuse, or ``example_inputs`` without a sample.
        ParamGroupError: As for :func:`estimate_memory`.
        UnsupportedDtypeError: As for :func:`estimate_memory`.
        BatchNormTrainingError: As for :func:`estimate_memory`.
    """
    _check_size(num_samples, "num_samples")
    _check_size(batch_size, "batch_size")
    check_chunk_size(chunk_size)
    block = min(batch_size, num_samples, chunk_size or batch_size)
    return _estimate(
        model,
        example_inputs,
        num_samples,
        block,
        model_inputs_kept=True,
        loader_batch=batch_size,
        param_groups=param_groups,
        mc_samples=mc_samples,
        num_curvature_samples=None,
        top_k=top_k,
        solver=solver,
    )


def _check_size(size: int, name: str) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {size!r}.")


def _estimate(
    model: Module,
    example_inputs: Tensor,
    num_samples: int,
    block: int,
    *,
    model_inputs_kept: bool,
    loader_batch: int | None,
    param_groups: Sequence[Sequence[Parameter]] | None,
    mc_samples: int,
    num_curvature_samples: int | None,
    top_k: int | None,
    solver: str,
) -> MemoryEstimate:
    """The estimate for ``num_samples`` samples run in blocks of ``block``.

    ``model_inputs_kept``: whether the blocks' inputs are tensors of their own
    that the factors of Linear layers keep (a loader's batches), rather than views
    of the caller's inputs (a batch and its chunks). ``loader_batch``: the
    loader's batch size, whose factors stay apart (``None``: one batch, whose
    chunks are merged).
    """
    check_model(model)
    param_groups = param_group_lists(param_groups, model)
    names = {id(p): f"parameter {n!r}" for n, p in model.named_parameters()}
    check_params([p for group in param_groups for p in group], names, allow_meta=True)
    check_solver(solver, top_k)
    check_mc_samples(mc_samples)
    check_example_inputs(example_inputs)
    check_inputs_match(example_inputs, param_groups[0])
    check_batch_norms(model)
    dtype, device = param_groups[0][0].dtype, param_groups[0][0].device
    entry = itemsize(dtype)
    layers, outputs_per_sample, columns = probe(model, example_inputs)
    columns = mc_samples or columns
    curvature = num_samples if num_curvature_samples is None else num_curvature_samples
    block_curvature = min(block, curvature)
    size = curvature * columns

    factors = 0
    backward = 0
    kept_inputs = 0  # per sample: Linear layers' inputs, kept by their factors
    gram_route = product_route = 0  # largest intermediates of Gram, V-products
    rescaled = 0  # entries of V that combining blocks copies (s̃, explicit V)
    budget = budget_entries(dtype)
    for layer in layers:
        # the vectors backpropagated through the layer, and a convolution's
        # unfolded input while its factors are formed
        backward = max(
            backward,
            columns * block_curvature * (layer.inputs + layer.outputs)
            + block * layer.unfolded,
        )
        for name, param in layer.module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if name == "weight" and isinstance(layer.module, OUTER_PRODUCT_LAYERS):
                factors += _weight_factors(
                    layer, param.numel(), columns, curvature, num_samples
                )
                rescaled += _ggn_vectors(layer, param.numel(), columns, curvature)
                if layer.unfolded and not _holds_v(layer, columns, GGN_COMPACT_RATIO):
                    # a convolution in factor form: the Gram through blocks of V,
                    # products through [b, N_S, T, O]; the planner caps both
                    # (and the contraction's copy of the backpropagated vectors)
                    copy = columns * curvature * layer.outputs
                    gram_route = max(
                        gram_route, min(budget, size * param.numel()) + copy
                    )
                    product_route = max(product_route, curvature * layer.outputs)
                if not layer.unfolded and (model_inputs_kept or not layer.is_input):
                    kept_inputs += layer.inputs
            else:
                factors += (columns * curvature + num_samples) * param.numel()
                rescaled += columns * curvature * param.numel()
    if block < num_samples:
        # the blocks are combined: their columns of V rescaled into copies
        backward = max(backward, rescaled)

    group = max(param_groups, key=lambda group: sum(p.numel() for p in group))
    largest_group = sum(p.numel() for p in group)
    if solver == "auto":
        blocks = (
            [curvature] if loader_batch is None else _batches(curvature, loader_batch)
        )
        solver = choose_solver(
            size,
            top_k,
            num_params=largest_group,
            dtype=dtype,
            device=device,
            factors=_shape_factors(layers, group, columns, blocks),
        )
    if solver == "dense":
        workspace = dense_workspace_bytes(size, top_k, dtype, device)
    else:
        products = largest_group if solver == "matrix_free" else None
        workspace = iterative_workspace_bytes(size, top_k, dtype, products)
    if solver == "matrix_free":
        width = solver_block_size("matrix_free", top_k, size)
        grams = 0
        workspace += min(budget, width * product_route) * entry
    else:
        grams = len(param_groups) * size**2 * entry
        workspace = gram_bytes(size, len(param_groups), workspace, dtype) - grams
        # while formed: the group's sum, a parameter's block, the route's blocks
        formation = size**2 + gram_route
        workspace = max(workspace, formation * entry)
    # a block's layer outputs, and the inputs the other blocks' factors keep (in
    # one block, those inputs are among its layer outputs or the caller's inputs)
    activations = block * outputs_per_sample
    if block < num_samples:
        activations += (num_samples - block) * kept_inputs
    return MemoryEstimate(
        activations=activations * entry,
        factors=factors * entry,
        backward=backward * entry,
        grams=grams,
        solver_workspace=workspace,
        solver=solver,
        num_rows=size,
    )


def largest_batch(
    model: Module,
    example_inputs: Tensor,
    budget_bytes: int,
    *,
    max_batch_size: int = 2**20,
    **request,
) -> int:
    """The largest mini-batch whose estimated peak memory fits a budget.

    Args:
        model: The network.
        example_inputs: A few input samples (see :func:`estimate_memory`).
        budget_bytes: Memory available for the request.
        max_batch_size: Upper end of the search.
        **request: Keywords of :func:`estimate_memory` (``top_k``, ``solver``,
            ``mc_samples``, ``param_groups``, ``chunk_size``);
            ``num_curvature_samples`` is not allowed (it would not grow with the
            batch).

    Returns:
        The batch size (``0`` if not even one sample fits).

    Raises:
        ValueError: If the budget is not positive or a keyword is not allowed.
    """
    if not budget_bytes > 0:
        raise InvalidArgumentError(
            f"budget_bytes must be positive, got {budget_bytes!r}."
        )
    if "num_curvature_samples" in request:
        raise InvalidArgumentError(
            "largest_batch searches the mini-batch size; num_curvature_samples "
            "would stay fixed. Leave it out."
        )

    def fits(batch_size: int) -> bool:
        estimate = estimate_memory(model, example_inputs, batch_size, **request)
        return estimate.total <= budget_bytes

    low, high = 0, 1
    while high <= max_batch_size and fits(high):
        low, high = high, 2 * high
    high = min(high, max_batch_size + 1)
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _batches(num_samples: int, batch_size: int) -> list[int]:
    """Samples of the batches of a loader over ``num_samples`` samples."""
    full, rest = divmod(num_samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def _shape_factors(
    layers: Sequence[ProbedLayer],
    group: Sequence[Parameter],
    columns: int,
    blocks: Sequence[int],
) -> list[ParamFactors]:
    """A group's factors of ``V`` as the request holds them, on the meta device.

    The same classes the engine builds (a weight of a Linear or convolution in
    factor form, or explicitly where :meth:`OuterProductFactors.compact
    <vivit.gram.outer.OuterProductFactors.compact>` holds it so, every other
    parameter explicitly; a loader's batches apart), with tensors that have
    shapes but no entries: their ``gram_work`` and ``product_work`` are those of
    the request, so ``"auto"`` chooses the solver it would.

    Args:
        layers: The probed layers.
        group: The group's parameters.
        columns: Columns of ``V`` per sample, ``C`` or ``M``.
        blocks: Curvature samples of each block whose factors stay apart.

    Returns:
        One set of factors per parameter of the group.
    """
    weights = {
        id(layer.module.weight): layer
        for layer in layers
        if isinstance(layer.module, OUTER_PRODUCT_LAYERS)
    }
    result = []
    for param in group:
        layer = weights.get(id(param))
        per_block = {
            samples: _param_shape_factors(param, layer, columns, samples)
            for samples in set(blocks)
        }
        parts = [per_block[samples] for samples in blocks]
        result.append(parts[0] if len(parts) == 1 else SampleBlockFactors(parts))
    return result


def _param_shape_factors(
    param: Parameter, layer: ProbedLayer | None, columns: int, samples: int
) -> ParamFactors:
    """A parameter's factors of ``V`` for ``samples`` samples, on the meta device."""
    meta = {"dtype": param.dtype, "device": "meta"}
    if layer is None:  # explicit columns
        return DenseFactors(torch.empty(samples, columns, *param.shape, **meta))
    groups, positions, inputs, outputs = layer.weight_factor_shape()
    return OuterProductFactors(
        torch.empty(samples, groups, positions, inputs, **meta),
        torch.empty(columns, samples, groups, positions, outputs, **meta),
        param.shape,
    ).compact(GGN_COMPACT_RATIO)


def _holds_v(layer: ProbedLayer, columns: int, ratio: int) -> bool:
    """Whether a weight keeps its columns explicitly: the engine's rule.

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


def _weight_factors(
    layer: ProbedLayer, numel: int, columns: int, curvature: int, num_samples: int
) -> int:
    """Entries kept for a Linear or convolution weight: ``V`` and gradients.

    Each of the two is kept as its factors (unfolded input, shared by both, and
    the vectors at the layer output) or as explicit columns
    (``OuterProductFactors.compact``): ``V`` where that is no larger, the
    gradients where it is at most ``1 / COMPACT_RATIO`` as large.
    A Linear layer's input is its caller's tensor, not a copy (counted with the
    activations).
    """
    grad_compact = _holds_v(layer, 1, COMPACT_RATIO)
    kept = _ggn_vectors(layer, numel, columns, curvature)
    kept += num_samples * (numel if grad_compact else layer.outputs)
    if layer.unfolded and not grad_compact:
        kept += num_samples * layer.unfolded
    elif layer.unfolded and not _holds_v(layer, columns, GGN_COMPACT_RATIO):
        kept += curvature * layer.unfolded
    return kept


def _ggn_vectors(layer: ProbedLayer, numel: int, columns: int, curvature: int) -> int:
    """Entries of a weight's columns of ``V`` besides the inputs (``s̃`` or ``V``)."""
    compact = _holds_v(layer, columns, GGN_COMPACT_RATIO)
    return curvature * columns * (numel if compact else layer.outputs)
