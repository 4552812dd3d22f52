"""How much memory each route of a curvature request needs, before it runs.

The Gram route (:func:`gram_estimate`) adds what is alive at the peak of
``LowRankGGN(...)`` followed by ``eigh(top_k)`` when an engine keeps the factors
of ``V``; the implicit route (:func:`implicit_estimate`) what its GGN-vector
products and Krylov basis hold. Which route a request takes is
:mod:`vivit.memory.route`'s decision, and :mod:`vivit.memory.request` gives the
estimate of that route (:func:`~vivit.memory.estimate_memory`,
:func:`~vivit.memory.estimate_data_set_memory`,
:func:`~vivit.memory.largest_batch`). The estimate is the cost model of the run:
it takes the run's checked options, resolves the engine with the run's
:func:`~vivit.engines.choice.resolve_engine`, counts the factor forms that
engine keeps (:mod:`vivit.memory.forms`), splits the samples into the run's
blocks (``chunk_size``, a loader's batches, and the func engine's own chunks
from :meth:`FuncEngine.chunking <vivit.engines.func.FuncEngine.chunking>`),
keeps the factors in ``gram_dtype`` as the collector casts them, and resolves
``solver="auto"`` with the run's :func:`~vivit.linalg.top_k.choose_solver` on
factors of the shapes the request holds. The samples are run in blocks of ``B``
(``B = N``, or ``chunk_size``, or a loader's batch size); the Gram route holds:

- **activations**: the forward pass's layer outputs of one block,
  ``B · Σ_layers out`` entries, and the inputs of Linear layers that the other
  blocks' BackPACK factors keep;
- **factors**: every requested parameter's factors of ``V`` and of the
  per-sample gradients, in the forms its engine keeps (:mod:`vivit.memory.forms`),
  in ``gram_dtype`` where given;
- the larger of the **backward pass's transient** (BackPACK: at every layer the
  backpropagated ``[C, N_B, *shape]`` quantities at its input and output plus a
  convolution's unfolded input of the block; func: its chunk's vectorised
  backward pass where that exceeds the block's factors; in several blocks, or
  the copies of one parameter's factors while the blocks are merged) and the
  **eigensolver's** share: the Gram matrices it forms (``(N_S·C)²`` entries
  each, none for ``"matrix_free"``) and its workspace, with the largest
  intermediate of a convolution in factor form, which :mod:`vivit.gram.planner`
  caps at its budget (256 MiB), or the ``top_k`` eigenvectors in parameter
  space where they are larger (ResNet-18's top 10: 447 MB).

The estimate leaves out the model, the data and the loaded libraries: it is the
growth of the process's memory. ``tests/memory/test_memory.py`` checks it against
the measured peak growth of resident memory within the factor
:data:`ESTIMATE_FACTOR` either way, over both engines, ``gram_dtype``, chunks,
loaders and the three Gram solvers; the implicit route's at most that factor
above it (its basis is counted at capacity, the resident memory grows with the
columns a solve fills; ``docs/math.rst``, "Memory of a request").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.nn import CrossEntropyLoss, Linear, Module, Parameter

from vivit._validation import (
    check_batch_norms,
    check_inputs_match,
    check_model,
    check_params,
    param_group_lists,
)
from vivit.engines.base import Engine
from vivit.engines.choice import resolve_engine
from vivit.engines.func.implicit import pass_width
from vivit.errors import (
    FactorsTooLargeError,
    ProductsTooLargeError,
)
from vivit.gram import (
    DenseFactors,
    EmbeddingFactors,
    OuterProductFactors,
    ParamFactors,
    SampleBlockFactors,
    SumFactors,
)
from vivit.gram.memory import (
    available_bytes,
    dense_workspace_bytes,
    format_bytes,
    gram_bytes,
    itemsize,
)
from vivit.gram.outer import GGN_COMPACT_RATIO
from vivit.gram.planner import budget_entries
from vivit.linalg.iterative import basis_capacity
from vivit.linalg.top_k import (
    check_solver,
    choose_solver,
    fitting_basis_columns,
    gram_work,
    iterative_workspace_bytes,
    solver_block_size,
    v_product_work,
)
from vivit.memory.forms import (
    Counts,
    FormPart,
    backpack_entries,
    func_entries,
    func_one_hot,
    function_forms,
    holds_v,
    kind,
)
from vivit.memory.probe import ProbedLayer, check_example_inputs, probe
from vivit.model_inputs import ModelInputs, num_samples, take_samples
from vivit.options import CurvatureOptions

logger = logging.getLogger("vivit")

#: Measured peak growth of resident memory over the estimate lies within
#: ``[1 / ESTIMATE_FACTOR, ESTIMATE_FACTOR]`` (``docs/math.rst``, "Memory of a
#: request"; checked by ``tests/memory/test_memory.py``).
ESTIMATE_FACTOR = 1.5


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory a :class:`~vivit.LowRankGGN` request needs, in bytes.

    Attributes:
        activations: Layer outputs of the forward pass.
        factors: Factors of ``V`` and of the per-sample gradients kept for
            products (in ``gram_dtype`` where given).
        backward: Transient of the engine's backward pass (in blocks: or the
            copies of one parameter's factors while the blocks are merged,
            whichever is larger).
        grams: Gram matrices the eigensolver forms.
        solver_workspace: The eigensolver's workspace, or the temporaries of
            forming a Gram matrix where those are larger.
        solver: The solver the estimate is for (``"auto"`` resolved).
        num_rows: Side length ``N·C`` of the Gram matrix.
        engine: The engine the estimate is for (``"auto"`` resolved).
        sample_work: Multiply-adds of the model's forward pass per sample in
            the requested parameters' layers (:func:`sample_work`), the unit of
            the route's cost model (:mod:`vivit.memory.route`).
        gram_work: Multiply-adds of forming every group's Gram matrix from the
            factors the request keeps (:func:`~vivit.linalg.top_k.gram_work`).
        reason: Why the request takes the Gram route (the route choice's
            reason, :class:`~vivit.memory.route.RouteChoice`), where a public
            estimate gave it; not compared.
    """

    activations: int
    factors: int
    backward: int
    grams: int
    solver_workspace: int
    solver: str
    num_rows: int
    engine: str = "backpack"
    sample_work: float = 0.0
    gram_work: float = 0.0
    reason: str = field(default="", compare=False)

    #: The route the estimate is for: factors of ``V`` and a Gram-space solver.
    route = "gram"

    @property
    def total(self) -> int:
        """Peak bytes: activations, factors and the larger of the two phases."""
        return (
            self.activations
            + self.factors
            + max(self.backward, self.grams + self.solver_workspace)
        )


@dataclass(frozen=True)
class Blocks:
    """How a request's samples reach the engine, or the implicit products.

    Attributes:
        samples: ``N``, every sample.
        curvature: ``N_S``, the curvature samples.
        block: Samples per engine run or product (a chunk, a loader's batch).
        loader_batch: The loader's batch size (``None``: one mini-batch, its
            chunks views of the caller's inputs).
    """

    samples: int
    curvature: int
    block: int
    loader_batch: int | None

    @classmethod
    def of_batch(
        cls, batch_size: int, curvature: int, chunk_size: int | None
    ) -> Blocks:
        """One mini-batch of ``batch_size`` samples, in chunks of ``chunk_size``.

        Args:
            batch_size: ``N``.
            curvature: ``N_S``.
            chunk_size: Most samples per run (``None``: the whole batch).

        Returns:
            The blocks.
        """
        block = min(chunk_size or batch_size, batch_size)
        return cls(batch_size, curvature, block, loader_batch=None)

    @classmethod
    def of_loader(
        cls, num_samples: int, batch_size: int, chunk_size: int | None
    ) -> Blocks:
        """A loader over ``num_samples`` samples in batches of ``batch_size``.

        Args:
            num_samples: Samples of all batches (all of them curvature samples).
            batch_size: Samples per batch (the last may have fewer).
            chunk_size: Most samples per run (``None``: a batch).

        Returns:
            The blocks.
        """
        batch = min(batch_size, num_samples)
        block = min(chunk_size or batch, batch)
        return cls(num_samples, num_samples, block, loader_batch=batch_size)

    @property
    def batches(self) -> int:
        """Batches of a pass over the samples (``1`` for a mini-batch)."""
        if self.loader_batch is None:
            return 1
        return -(-self.samples // self.loader_batch)

    def counts(self, columns: int, cast: bool) -> tuple[Counts, Counts]:
        """The counts of all samples, and of one block."""
        whole = Counts(self.samples, self.curvature, columns, cast)
        block = Counts(self.block, min(self.block, self.curvature), columns, cast)
        return whole, block


def batch_estimate(
    model: Module,
    loss_func: Module,
    inputs: ModelInputs,
    param_groups: Sequence[Sequence[Parameter]],
    options: CurvatureOptions,
    engine: Engine,
    blocks: Blocks | None = None,
) -> MemoryEstimate | None:
    """The Gram route's estimate of the run's samples, from a one-sample probe.

    Args:
        model: The network.
        loss_func: The loss module.
        inputs: The mini-batch's inputs, ``[N, ...]`` (or a dict of them), or a
            loader's first batch's.
        param_groups: The checked parameter groups.
        options: The checked options (not checked again).
        engine: The engine the run resolved (not resolved twice).
        blocks: The samples of the run (``None``: the mini-batch ``inputs``, in
            chunks of ``chunk_size``; a loader's from
            :meth:`Blocks.of_loader`).

    Returns:
        The estimate (for one leading eigenpair), or ``None`` where the model
        cannot be probed (e.g. a layer called with keyword arguments); the logger
        ``"vivit"`` then says why (level INFO).
    """
    if blocks is None:
        batch_size = num_samples(inputs)
        curvature = (
            batch_size if options.subsampling is None else len(options.subsampling)
        )
        blocks = Blocks.of_batch(batch_size, curvature, options.chunk_size)
    try:
        return gram_estimate(
            model,
            take_samples(inputs, slice(1)),
            blocks,
            loss_func=loss_func,
            options=options,
            param_groups=param_groups,
            top_k=1,
            engine=engine,
        )
    except Exception as error:  # noqa: BLE001 (an estimate must not fail a run)
        logger.info(
            "Cannot estimate the memory of the Gram route (%s: %s); it runs "
            "without the check before its backward pass.",
            type(error).__name__,
            error,
        )
        return None


@dataclass(frozen=True)
class ImplicitEstimate:
    """Memory of one ``eigh(top_k)`` by implicit GGN-vector products, in bytes.

    Answers what a :class:`MemoryEstimate` answers of a request (``total``,
    ``route``, ``reason``, ``solver``, ``engine``), so that the estimate of
    whichever route a request takes reads alike.

    Attributes:
        activations: The forward graph of one block of samples (the VJP's).
        products: The vmapped passes' tangents and cotangents of every
            activation for the vectors of one pass (a confirmation's ``k``, or
            as many as :func:`~vivit.engines.func.implicit.pass_width` allows),
            and the block's parameter-space vectors and images.
        krylov: The iterative solver's workspace in parameter space: the
            float64 Krylov basis and its images, ``m`` columns each, a
            restart's Ritz vectors, the block and its image.
        block_width: Vectors ``b`` per product of the Krylov iteration
            (:func:`~vivit.linalg.top_k.solver_block_size`; confirmations
            multiply ``k``).
        num_params: Side length ``D`` of the operator.
        basis_columns: Columns ``m`` of the basis that will run: the default
            (:func:`~vivit.linalg.iterative.basis_capacity`) or fewer where the
            memory does not allow it
            (:func:`~vivit.linalg.top_k.fitting_basis_columns`).
        default_columns: The default's columns.
        reason: Why the request takes the implicit route (the route choice's
            reason, :class:`~vivit.memory.route.RouteChoice`), where a public
            estimate gave it; not compared.
    """

    activations: int
    products: int
    krylov: int
    block_width: int
    num_params: int
    basis_columns: int
    default_columns: int
    reason: str = field(default="", compare=False)

    #: The route the estimate is for: GGN-vector products, no ``V``.
    route = "implicit"
    #: The eigensolver: block Krylov on ``G`` in parameter space.
    solver = "implicit"
    #: No engine runs (``LowRankGGN.engine`` of the route).
    engine = "implicit"

    @property
    def total(self) -> int:
        """Peak bytes: all three are alive while a product runs."""
        return self.activations + self.products + self.krylov


def implicit_estimate(
    model: Module,
    inputs: ModelInputs,
    param_groups: Sequence[Sequence[Parameter]],
    options: CurvatureOptions,
    top_k: int,
    *,
    block: int | None = None,
    available: int | None = None,
) -> ImplicitEstimate | None:
    """The estimate of ``solver="implicit"``, from a one-sample probe.

    A product of at most ``k = top_k`` vectors (blocks of ``b``,
    :func:`~vivit.linalg.top_k.solver_block_size`; a confirmation multiplies
    the ``k`` Ritz vectors) runs over blocks of ``B`` samples (``chunk_size``,
    else the batch, else a loader's largest batch): the VJP's forward graph,
    ``B·w`` entries with ``w`` the activation entries per sample, and the
    vmapped backward pass's cotangents of them for the vectors of one pass,
    ``p·B·w`` (``p`` of :func:`~vivit.engines.func.implicit.pass_width`, at most
    ``k``; the JVP's tangents are freed layer by layer); the iterative solver's
    workspace in the largest group's parameter space
    (:func:`~vivit.linalg.top_k.iterative_workspace_bytes`: the float64 basis
    and its images, ``m`` columns each, the Ritz vectors a restart keeps, the
    block and its image; ``docs/math.rst``, "Memory of a request"), which does
    not grow with the samples. ``m`` is the basis that will run: the default,
    or the most columns that fit into the memory available besides the products
    (:func:`~vivit.linalg.top_k.fitting_basis_columns`, at least ``k + 2·b``).

    Args:
        model: The network.
        inputs: The mini-batch's inputs, ``[N, ...]`` (or a dict of them), or
            those of a loader's batch (the probe takes one sample).
        param_groups: The checked parameter groups.
        options: The checked options.
        top_k: Leading eigenpairs asked for.
        block: Samples ``B`` of the largest block (``None``: ``inputs`` in
            chunks of ``chunk_size``).
        available: Memory the request may take (``None``: what is available
            on the parameters' device, :func:`~vivit.gram.memory.available_bytes`).

    Returns:
        The estimate, or ``None`` where the model cannot be probed (the logger
        ``"vivit"`` says why, level INFO).
    """
    width = probed_activation_width(model, inputs, param_groups, options)
    if width is None:
        return None
    if block is None:
        block = Blocks.of_batch(num_samples(inputs), 1, options.chunk_size).block
    return products_estimate(width, block, param_groups, top_k, available)


def probed_activation_width(
    model: Module,
    inputs: ModelInputs,
    param_groups: Sequence[Sequence[Parameter]],
    options: CurvatureOptions,
) -> int | None:
    """:func:`activation_width`, or ``None`` where the model cannot be probed.

    Args:
        model: The network.
        inputs: Inputs with at least one sample.
        param_groups: The checked parameter groups.
        options: The checked options.

    Returns:
        ``w``, or ``None`` (the logger ``"vivit"`` says why, level INFO).
    """
    try:
        return activation_width(model, inputs, param_groups, options)
    except Exception as error:  # noqa: BLE001 (an estimate must not fail a run)
        logger.info(
            "Cannot estimate the memory of the implicit products (%s: %s); they "
            "run without the check, one pass per product.",
            type(error).__name__,
            error,
        )
        return None


def activation_width(
    model: Module,
    inputs: ModelInputs,
    param_groups: Sequence[Sequence[Parameter]],
    options: CurvatureOptions,
) -> int:
    """Activation entries ``w`` per sample that a pass of the implicit route holds.

    The leaf layers' outputs or the recorded function calls' outputs (attention,
    ``addmm``), whichever are more, from a forward pass of one sample.

    Args:
        model: The network.
        inputs: Inputs with at least one sample.
        param_groups: The checked parameter groups.
        options: The checked options (their ``output`` selector).

    Returns:
        ``w``.

    Raises:
        Exception: Whatever the probe's forward pass raises.
    """
    one = take_samples(inputs, slice(1))
    _, outputs_per_sample, _ = probe(model, one, options.output)
    params = [p for group in param_groups for p in group]
    _, function_outputs = function_forms(model, one, params, options.output)
    return max(outputs_per_sample, function_outputs)


def products_estimate(
    width_per_sample: int,
    block: int,
    param_groups: Sequence[Sequence[Parameter]],
    top_k: int,
    available: int | None = None,
) -> ImplicitEstimate:
    """The implicit route's memory for blocks of ``block`` samples of ``w`` entries.

    Args:
        width_per_sample: Activation entries ``w`` per sample
            (:func:`activation_width`).
        block: Samples ``B`` of the largest block.
        param_groups: The checked parameter groups.
        top_k: Leading eigenpairs asked for.
        available: Memory the request may take (``None``: what is available).

    Returns:
        The estimate (see :func:`implicit_estimate`).
    """
    size = max(sum(p.numel() for p in group) for group in param_groups)
    width = solver_block_size("implicit", top_k, size)
    dtype, device = param_groups[0][0].dtype, param_groups[0][0].device
    activations = block * width_per_sample * itemsize(dtype)  # one vector's too
    products = pass_width(min(top_k, size), activations) * activations
    # the solver's basis, restart and blocks in D-space (params=0: no
    # V-products besides), its basis cut to what is left
    if available is None:
        available = available_bytes(device)
    budget = available - activations - products
    columns = fitting_basis_columns(size, top_k, dtype, budget, 0, "implicit")
    return ImplicitEstimate(
        activations=activations,
        products=products,
        krylov=iterative_workspace_bytes(size, top_k, dtype, 0, columns, "implicit"),
        block_width=width,
        num_params=size,
        basis_columns=columns,
        default_columns=basis_capacity(width, size, top_k=top_k),
    )


def check_implicit_fits(estimate: ImplicitEstimate, device: torch.device) -> None:
    """Refuse implicit products whose estimate cannot fit, before the first one.

    Args:
        estimate: The request's :func:`implicit_estimate`.
        device: The parameters' device.

    Raises:
        ProductsTooLargeError: If the estimate divided by :data:`ESTIMATE_FACTOR`
            exceeds the available memory (its basis is then cut to its minimum,
            ``k + 2·b`` columns, already).
    """
    available = available_bytes(device)
    if estimate.total <= ESTIMATE_FACTOR * available:
        return
    raise ProductsTooLargeError(
        f"{implicit_summary(estimate)}, but only {format_bytes(available)} are "
        f"available on {device}. Refused before the first product. Ask for fewer "
        "pairs (top_k: the block and the basis shrink with it), use the curvature "
        "of fewer samples (subsampling=[...]) or a smaller batch (a loader's: "
        "smaller batches), bound the products' activations with chunk_size=..., "
        "or use a Gram route with "
        "Monte-Carlo sampling (solver='auto', mc_samples=1), whose memory grows "
        "with N·M rather than with D."
    )


def implicit_summary(estimate: ImplicitEstimate) -> str:
    """The implicit estimate in words, for refusals and route choices.

    Args:
        estimate: An :func:`implicit_estimate`.

    Returns:
        The total and its parts, in GiB.
    """
    return (
        f"solver='implicit' with blocks of {estimate.block_width} vectors over "
        f"D = {estimate.num_params} parameters needs an estimated "
        f"{format_bytes(estimate.total)} (activations "
        f"{format_bytes(estimate.activations)}, products "
        f"{format_bytes(estimate.products)}, Krylov basis "
        f"{format_bytes(estimate.krylov)} for {_basis_columns(estimate)}; at least "
        f"{format_bytes(estimate.total / ESTIMATE_FACTOR)})"
    )


def _basis_columns(estimate: ImplicitEstimate) -> str:
    """The basis' columns in words, and whether memory cut them."""
    if estimate.basis_columns < estimate.default_columns:
        return (
            f"{estimate.basis_columns} columns (cut from "
            f"{estimate.default_columns} by memory)"
        )
    return f"{estimate.basis_columns} columns"


def kept_bytes(estimate: MemoryEstimate) -> int:
    """Bytes the backward pass of a batch holds at its peak (no Gram matrix yet).

    Args:
        estimate: The batch's estimate.

    Returns:
        Its activations, the kept factors and the backward pass's transient.
    """
    return estimate.activations + estimate.factors + estimate.backward


def check_batch_fits(
    model: Module,
    loss_func: Module,
    inputs: ModelInputs,
    param_groups: Sequence[Sequence[Parameter]],
    options: CurvatureOptions,
    engine: Engine,
    estimate: MemoryEstimate | None = None,
) -> None:
    """Refuse one mini-batch whose stored factors cannot fit, before it runs.

    The backward pass of the batch keeps every requested parameter's factors;
    their estimate (activations, factors and the backward pass's transient of
    :func:`estimate_memory`) divided by :data:`ESTIMATE_FACTOR` is a lower bound
    of what the run needs (``docs/math.rst``, "Memory of a request"). If even
    that exceeds the memory the process can still allocate, the run is refused
    before anything large is allocated. The Gram matrix and the eigensolver come
    later and are checked when formed (:class:`~vivit.GramTooLargeError`).

    Args:
        model: The network.
        loss_func: The loss module.
        inputs: The mini-batch's inputs, ``[N, ...]`` (or a dict of them).
        param_groups: The checked parameter groups.
        options: The checked options (not checked again).
        engine: The engine the run resolved (not resolved twice).
        estimate: The batch's :func:`batch_estimate` if the caller has it (the
            route choice's), so the model is not probed twice; ``None``: probed
            here.

    Raises:
        FactorsTooLargeError: If the lower bound exceeds the available memory.
        Where the estimate cannot probe the model (e.g. a layer called with
        keyword arguments), the batch runs unchecked and the logger ``"vivit"``
        says so (level INFO).
    """
    if estimate is None:
        estimate = batch_estimate(
            model, loss_func, inputs, param_groups, options, engine
        )
    if estimate is None:
        return
    batch_size = num_samples(inputs)
    needed = kept_bytes(estimate)
    device = param_groups[0][0].device
    available = available_bytes(device)
    if needed <= ESTIMATE_FACTOR * available:
        return
    raise FactorsTooLargeError(
        f"The backward pass of this mini-batch of {batch_size} samples keeps "
        f"factors of V with {estimate.num_rows} columns (N·C, N·C·T for sequences "
        f"of T positions): estimated {format_bytes(needed)} (factors "
        f"{format_bytes(estimate.factors)}, activations "
        f"{format_bytes(estimate.activations)}, backward pass "
        f"{format_bytes(estimate.backward)}; at least "
        f"{format_bytes(needed / ESTIMATE_FACTOR)}), but only "
        f"{format_bytes(available)} are available on {device}. "
        "Refused before running. Store fewer columns: Monte-Carlo sample the loss "
        "Hessian (mc_samples=1: N·T columns per token, N with mc_per='sequence'), "
        "use the curvature of fewer samples (subsampling=[...]), a smaller batch, "
        "or chunk_size=... (bounds the backward pass, not the kept factors); or "
        "keep no factors at all: solver='implicit' (GGN-vector products) or "
        "vivit.StreamingGGN(model, loss_func, [(X, y)]).eigh(top_k=...), which "
        "recomputes them in every pass. vivit.memory.estimate_memory(...) "
        "estimates a request before running it."
    )


def gram_estimate(
    model: Module,
    example_inputs: ModelInputs,
    blocks: Blocks,
    *,
    loss_func: Module | None,
    options: CurvatureOptions,
    param_groups: Sequence[Sequence[Parameter]] | None,
    top_k: int | None,
    engine: Engine | None = None,
) -> MemoryEstimate:
    """The Gram route's estimate for the request's samples in ``blocks``.

    Args:
        model: The network.
        example_inputs: A few input samples, ``[n, ...]`` (the probe).
        blocks: The request's samples.
        loss_func: The loss module (``None``: one BackPACK supports).
        options: The checked options (``solver`` as the Gram route resolves it).
        param_groups: The parameter groups (``None``: one group).
        top_k: Leading eigenpairs asked for (``None``: all).
        engine: The run's engine where it resolved it already (``None``:
            resolved here).

    Returns:
        The estimate.

    Raises:
        VivitError: For a model, parameters, ``top_k`` or inputs a request
            would refuse (:func:`check_request`).
    """
    param_groups = check_request(model, example_inputs, param_groups)
    check_solver(options.solver, top_k)
    if engine is None:
        engine = resolve_engine(options.engine, model, loss_func, options.output)
    dtype, device = param_groups[0][0].dtype, param_groups[0][0].device
    kept_dtype = options.gram_dtype or dtype
    entry, kept_entry = itemsize(dtype), itemsize(kept_dtype)
    layers, outputs_per_sample, sample_shape = probe(
        model, example_inputs, options.output
    )
    columns = columns_per_sample(sample_shape, loss_func, options)
    whole, block = blocks.counts(columns, cast=kept_dtype != dtype)
    size = blocks.curvature * columns
    func = engine.name == "func"
    requested_params = [p for group in param_groups for p in group]
    requested = {id(p) for p in requested_params}
    params = _probed_params(layers, requested, model)
    entries = backpack_entries
    forms: dict = {}
    if func:
        forms, function_outputs = function_forms(
            model, example_inputs, [p for _, _, p in params], options.output
        )
        # activations outside leaf modules (attention, addmm): as the engine
        outputs_per_sample = max(outputs_per_sample, function_outputs)
        dense = _one_hot_entries(params, forms)
        samples, _ = engine.chunking(
            block.samples, block.vectors, outputs_per_sample, dense
        )
        entries = partial(func_entries, own_chunks=samples < block.samples, forms=forms)
    kept = [entries(layer, name, param, whole) for layer, name, param in params]
    # per sample: Linear inputs the BackPACK factors keep without a copy
    caller_inputs = sum(
        e.caller_inputs
        for (layer, _, _), e in zip(params, kept, strict=True)
        # a parameter no leaf layer owns (layer None) keeps its columns only
        if blocks.loader_batch is not None or layer is None or not layer.is_input
    )
    if func:
        # its chunks' backward passes run while the block's factors are filled
        # (views of the vectors there, except the copies of gathered rows)
        block_entries = [entries(lay, name, p, block) for lay, name, p in params]
        block_kept = sum(e.kept - e.gathered for e in block_entries)
        chunk = _func_transient(
            engine, layers, params, block, (outputs_per_sample, function_outputs), forms
        )
        backward = max(0, chunk * entry - block_kept * kept_entry)
    else:
        backward = _backpack_transient(layers, block) * entry
    if blocks.block < blocks.samples:
        # blocks merged one parameter at a time: rescaled V and the concatenation
        backward = max(backward, max(e.ggn + e.kept for e in kept) * kept_entry)

    gram_route = product_route = 0  # largest intermediates of Gram, V-products
    budget = budget_entries(kept_dtype)
    for (layer, name, param), _ in zip(params, kept, strict=True):
        if (
            kind(layer, name) == "weight"
            and layer.unfolded
            and (func or not holds_v(layer, columns, GGN_COMPACT_RATIO))
        ):
            # a convolution in factor form: the Gram through blocks of V,
            # products through [b, N_S, T, O]; the planner caps both
            # (and the contraction's copy of the backpropagated vectors)
            copy = columns * blocks.curvature * layer.outputs
            gram_route = max(gram_route, min(budget, size * param.numel()) + copy)
            product_route = max(product_route, blocks.curvature * layer.outputs)

    group = max(param_groups, key=lambda group: sum(p.numel() for p in group))
    largest_group = sum(p.numel() for p in group)
    # curvature samples of each block whose factors stay apart
    sizes = (
        [blocks.curvature]
        if blocks.loader_batch is None
        else _batches(blocks.curvature, blocks.loader_batch)
    )
    solver = options.solver
    if solver == "auto":
        solver = choose_solver(
            size,
            top_k,
            num_params=largest_group,
            dtype=kept_dtype,
            device=device,
            factors=_shape_factors(
                layers, group, columns, sizes, kept_dtype, func, forms
            ),
        )
    if solver == "dense":
        workspace = dense_workspace_bytes(size, top_k, kept_dtype, device)
    else:
        products = largest_group if solver == "matrix_free" else None
        workspace = iterative_workspace_bytes(size, top_k, kept_dtype, products)
    if solver == "matrix_free":
        width = solver_block_size("matrix_free", top_k, size)
        grams = 0
        workspace += min(budget, width * product_route) * kept_entry
    else:
        grams = len(param_groups) * size**2 * kept_entry
        workspace = gram_bytes(size, len(param_groups), workspace, kept_dtype) - grams
        # while formed: the group's sum, a parameter's block, the route's blocks
        formation = size**2 + gram_route
        workspace = max(workspace, formation * kept_entry)
    # the eigenvectors V ũ / √λ of the largest group, in the parameters' type,
    # formed after the solve (its workspace freed) while the Gram matrices live
    directions = min(size, size if top_k is None else top_k) * largest_group
    workspace = max(workspace, directions * entry)
    # a block's layer outputs, and the inputs the other blocks' factors keep (in
    # one block, those inputs are among its layer outputs or the caller's inputs)
    activations = blocks.block * outputs_per_sample
    if blocks.block < blocks.samples:
        activations += (blocks.samples - blocks.block) * caller_inputs
    # one block of the caller's inputs: the factors that keep them get a copy
    # (vivit.sources.ownership); blocks of several are concatenated anyway
    owned = 0
    if blocks.block == blocks.samples and blocks.loader_batch is None:
        owned = blocks.samples * sum(
            e.caller_inputs
            for (layer, _, _), e in zip(params, kept, strict=True)
            if layer is not None and layer.is_input
        )
    return MemoryEstimate(
        activations=activations * entry,
        factors=(sum(e.kept for e in kept) + owned) * kept_entry,
        backward=backward,
        grams=grams,
        solver_workspace=workspace,
        solver=solver,
        num_rows=size,
        engine=engine.name,
        sample_work=sample_work(
            _shape_factors(layers, list(requested_params), 1, [1], dtype, func, forms)
        ),
        gram_work=sum(
            gram_work(
                _shape_factors(layers, g, columns, sizes, kept_dtype, func, forms),
                kept_dtype,
            )
            for g in param_groups
        ),
    )


def check_request(
    model: Module,
    example_inputs: ModelInputs,
    param_groups: Sequence[Sequence[Parameter]] | None,
) -> list[list[Parameter]]:
    """The checks of a request that every estimate makes, as the run makes them.

    Args:
        model: The network.
        example_inputs: The probe's samples.
        param_groups: The parameter groups (``None``: one group).

    Returns:
        The parameter groups as lists.

    Raises:
        VivitError: For a model, parameters or inputs a request would refuse
            (BatchNorm in training mode among them).
    """
    check_model(model)
    param_groups = param_group_lists(param_groups, model)
    names = {id(p): f"parameter {n!r}" for n, p in model.named_parameters()}
    check_params([p for group in param_groups for p in group], names, allow_meta=True)
    check_example_inputs(example_inputs)
    check_inputs_match(example_inputs, param_groups[0])
    check_batch_norms(model)
    return param_groups


def sample_work(factors: Sequence[ParamFactors]) -> float:
    """Multiply-adds of the forward pass of one sample through the parameters.

    Half the work of a ``V``-product through the factors of one sample and one
    column (``J_nᵀ s`` and ``J_n v`` each cost a forward pass's multiply-adds in
    the parameters' layers: ``T·P·O`` for a Linear or convolution weight with
    ``T`` positions, ``T·O`` for an embedding, ``numel`` for explicit columns).
    Operations without parameters (attention's ``QKᵀ``, activations) are left
    out: a proxy, calibrated by the route's constants.

    Args:
        factors: Every requested parameter's factors for one sample and column.

    Returns:
        The multiply-adds.
    """
    return v_product_work(factors, 1) / 2


def columns_per_sample(
    sample_shape: tuple[int, ...], loss_func: Module | None, options: CurvatureOptions
) -> int:
    """Columns of ``V`` per sample for a model output of ``sample_shape`` per sample.

    ``C`` (every output entry, ``C·T`` for sequences) exact, ``M`` with Monte
    Carlo, ``M·T`` per token for cross-entropy on sequences (``docs/math.rst``,
    "Losses").
    """
    if not options.mc_samples:
        return math.prod(sample_shape)
    if (
        isinstance(loss_func, CrossEntropyLoss)
        and options.mc_per == "token"
        and len(sample_shape) > 1
    ):
        return options.mc_samples * math.prod(sample_shape[1:])
    return options.mc_samples


def _probed_params(
    layers: Sequence[ProbedLayer], requested: set[int], model: Module
) -> list[tuple[ProbedLayer | None, str, Parameter]]:
    """Every requested parameter once, with the first layer call that owns it.

    Parameters no leaf layer owns (used in a custom forward) come without one.
    """
    params = []
    seen: set[int] = set()
    for layer in layers:
        for name, param in layer.module.named_parameters(recurse=False):
            if id(param) in requested and id(param) not in seen:
                seen.add(id(param))
                params.append((layer, name, param))
    for param in model.parameters():
        if id(param) in requested and id(param) not in seen:
            seen.add(id(param))
            params.append((None, "", param))
    return params


def _backpack_transient(layers: Sequence[ProbedLayer], block: Counts) -> int:
    """Entries of BackPACK's backward pass at its largest layer.

    The backpropagated ``[C, N_B, *shape]`` quantities at the layer's input and
    output, and a convolution's unfolded input of the block.
    """
    return max(
        (
            block.columns * block.curvature * (layer.inputs + layer.outputs)
            + block.samples * layer.unfolded
            for layer in layers
        ),
        default=0,
    )


def _one_hot_entries(
    params: Sequence[tuple[ProbedLayer | None, str, Parameter]], forms: dict
) -> int:
    """Entries ``D`` of the parameters the func engine pushes one-hot batches to."""
    return sum(
        p.numel()
        for layer, name, p in params
        if func_one_hot(layer, name) and id(p) not in forms
    )


def _func_transient(
    engine: Engine,
    layers: Sequence[ProbedLayer],
    params: Sequence[tuple[ProbedLayer | None, str, Parameter]],
    block: Counts,
    widths: tuple[int, int],
    forms: dict,
) -> int:
    """Entries of one of the func engine's own chunks (see its cost model).

    The chunk's forward graph, and the larger of its vectorised backward pass to
    the layer outputs and the recorded function calls' outputs (``widths``: the
    activation entries per sample and those of the calls' outputs, with the
    vectors there) and the one-hot pass to the parameters without a factor form
    (with their columns).
    """
    width, function_outputs = widths
    dense = _one_hot_entries(params, forms)
    vectors = block.vectors
    samples, per_pass = engine.chunking(block.samples, vectors, width, dense)
    at_outputs = function_outputs + sum(
        layer.outputs
        for layer in layers
        if not func_one_hot(layer, "weight") and not isinstance(layer.module, Linear)
    )
    to_layers = (min(vectors, per_pass) * width + vectors * at_outputs) * samples
    one_hot = (
        min(samples * vectors, per_pass) * (samples * width + dense)
        + samples * vectors * dense
        if dense
        else 0
    )
    return samples * width + max(to_layers, one_hot)


def _batches(num_samples: int, batch_size: int) -> list[int]:
    """Samples of the batches of a loader over ``num_samples`` samples."""
    full, rest = divmod(num_samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def _shape_factors(
    layers: Sequence[ProbedLayer],
    group: Sequence[Parameter],
    columns: int,
    blocks: Sequence[int],
    dtype: torch.dtype,
    func: bool,
    forms: Mapping[int, tuple[FormPart, ...]],
) -> list[ParamFactors]:
    """A group's factors of ``V`` as the request holds them, on the meta device.

    The same classes the engine builds (a weight of a Linear or convolution in
    factor form, for BackPACK explicitly where :meth:`OuterProductFactors.compact
    <vivit.gram.outer.OuterProductFactors.compact>` holds it so; every other
    parameter explicitly; a loader's batches apart), with tensors that have
    shapes but no entries: their ``gram_work`` and ``product_work`` are those of
    the request, so ``"auto"`` chooses the solver it would.

    Args:
        layers: The probed layers.
        group: The group's parameters.
        columns: Columns of ``V`` per sample, ``C`` or ``M``.
        blocks: Curvature samples of each block whose factors stay apart.
        dtype: Type of the kept factors (``gram_dtype`` or the parameters').
        func: Whether the func engine builds them (no weight held explicitly).
        forms: The func engine's forms at the function level
            (:func:`~vivit.memory.forms.function_forms`).

    Returns:
        One set of factors per parameter of the group.
    """
    weights = {
        id(layer.module.weight): layer
        for layer in layers
        if kind(layer, "weight") == "weight"
    }
    result = []
    for param in group:
        layer = weights.get(id(param))
        per_block = {
            samples: _function_shape_factors(
                param, forms[id(param)], columns, samples, dtype
            )
            if layer is None and forms.get(id(param))
            else _param_shape_factors(param, layer, columns, samples, dtype, func)
            for samples in set(blocks)
        }
        parts = [per_block[samples] for samples in blocks]
        result.append(parts[0] if len(parts) == 1 else SampleBlockFactors(parts))
    return result


def _param_shape_factors(
    param: Parameter,
    layer: ProbedLayer | None,
    columns: int,
    samples: int,
    dtype: torch.dtype,
    func: bool,
) -> ParamFactors:
    """A parameter's factors of ``V`` for ``samples`` samples, on the meta device."""
    meta = {"dtype": dtype, "device": "meta"}
    if layer is None:  # explicit columns
        return DenseFactors(torch.empty(samples, columns, *param.shape, **meta))
    groups, positions, inputs, outputs = layer.weight_factor_shape()
    factors = OuterProductFactors(
        torch.empty(samples, groups, positions, inputs, **meta),
        torch.empty(columns, samples, groups, positions, outputs, **meta),
        param.shape,
    )
    return factors if func else factors.compact(GGN_COMPACT_RATIO)


def _function_shape_factors(
    param: Parameter,
    parts: tuple[FormPart, ...],
    columns: int,
    samples: int,
    dtype: torch.dtype,
) -> ParamFactors:
    """A parameter's factor forms found at the function level, on the meta device."""
    meta = {"dtype": dtype, "device": "meta"}
    factors: list[ParamFactors] = []
    for part in parts:
        vectors = torch.empty(columns, samples, part.positions, part.outputs, **meta)
        if part.kind == "embedding":
            indices = torch.empty(
                samples, part.positions, dtype=torch.long, device="meta"
            )
            factors.append(EmbeddingFactors(indices, vectors, param.shape))
        else:
            inputs = torch.empty(samples, 1, part.positions, part.inputs, **meta)
            factors.append(
                OuterProductFactors(inputs, vectors[:, :, None], param.shape)
            )
    return factors[0] if len(factors) == 1 else SumFactors(factors)
