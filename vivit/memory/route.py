"""Which route a request takes under ``solver="auto"``, and why.

Two routes give the exact GGN's leading eigenpairs (``docs/math.rst``, "Choosing
the route"):

``"gram"``
    An engine backpropagates the ``K`` columns of ``V`` per sample (``K = C``,
    ``C·T`` with sequences of ``T`` positions, ``M·T`` with Monte-Carlo per
    token) and keeps their factors (:mod:`vivit.sources.stored`); a Gram-space
    solver takes the leading eigenpairs. Its backward pass costs about ``K``
    times that of the loss, its factors grow with ``K`` and with the samples,
    and its Gram matrix with their square.
``"implicit"``
    GGN-vector products by JVP and VJP (:mod:`vivit.sources.implicit`): no
    ``V``, about :data:`IMPLICIT_PASSES` passes over the samples for
    :data:`ROUTE_TOP_K` leading eigenpairs, whatever ``K`` is; it holds one
    block's activations and a Krylov basis in parameter space, which does not
    grow with the samples.

This module decides from the two routes' estimates (:mod:`vivit.memory.estimate`),
so that the run (:mod:`vivit.sources.route`, from the data) and the estimate of a
request (:mod:`vivit.memory.request`, from its sizes) take the same decision:

1. :func:`fixed_route`: the solver asked for by name, or the implicit route
   cannot honour the request (:func:`implicit_obstacle`: Monte-Carlo sampling,
   ``gram_dtype``, the BackPACK engine by name; the caller adds
   what its data rules out, e.g. a one-pass iterator): the Gram route.
2. :func:`compare_routes`: the implicit route where the Gram route's factors
   cannot fit into the memory available (its estimate divided by
   :data:`~vivit.memory.estimate.ESTIMATE_FACTOR`, the criterion of
   :func:`~vivit.memory.estimate.check_batch_fits`) or cost more passes over
   the samples (:class:`RouteCosts`), provided the implicit products fit; where
   neither fits, the request is refused (:class:`~vivit.ProductsTooLargeError`,
   with both estimates and the options). Otherwise the Gram route.

For a data loader the samples are all its batches': the Gram route's factors
and Gram matrix those of the whole data set, the implicit route's products a
pass over every batch and the activations of its largest one. The constants are
measured with ``benchmarks/eigenpairs.py`` on one CPU thread; on the problems
measured the choice picks the faster route, within 2× where the two are close
(char-LSTM at N = 8: 1.4×; ``docs/math.rst``, "Choosing the route").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vivit.errors import ProductsTooLargeError
from vivit.gram.memory import format_bytes
from vivit.linalg.top_k import dense_work, iterative_work, solver_block_size
from vivit.linalg.top_k import pass_work as gram_pass_work
from vivit.memory.estimate import (
    ESTIMATE_FACTOR,
    Blocks,
    ImplicitEstimate,
    MemoryEstimate,
    implicit_summary,
    kept_bytes,
)
from vivit.options import CurvatureOptions

#: Leading eigenpairs the choice is made for (the library's usual ``top_k``).
ROUTE_TOP_K = 10
#: Forward+backward passes of the batch that the implicit route's top-10 solve
#: costs (products times passes per product, its first pass and the solver's
#: linear algebra in a small parameter space included): measured 57 to 233 on
#: char-LSTM (N = 2 to 32) and gpt2-2l-64-v128 (N = 1 to 4), 30 to 100 products
#: of 1.0 to 3.7 passes each (``benchmarks/README.md``, "The route's cost model").
IMPLICIT_PASSES = 150.0
#: Passes' worth of multiply-adds that backpropagating one column of ``V`` per
#: sample costs each engine (measured 2.5 for the 3c3d CNN with BackPACK,
#: N = 32 to 128, and 1.7 for the char-LSTM with the func engine's recurrent
#: factor forms, N = 32).
GRAM_PASSES_PER_COLUMN = {"backpack": 2.5, "func": 1.7}
#: Multiply-adds one pass of a batch costs besides its arithmetic (Python,
#: kernel launches): 1.7 ms at 11 GMAC/s, the forward+backward pass of char-LSTM
#: at N = 2 (1.8 ms, against 3.6 ms at N = 32).
PASS_OVERHEAD = 2e7
#: How many times faster the Gram matrix's contractions and the eigensolver run
#: than the passes per multiply-add (measured 33 against 11 GMAC/s on char-LSTM,
#: N = 32, one thread).
GEMM_SPEEDUP = 3.0


@dataclass(frozen=True)
class RouteChoice:
    """The route a request takes, and why.

    Attributes:
        name: ``"gram"`` (factors of ``V``, a Gram-space solver) or
            ``"implicit"`` (GGN-vector products, no ``V``).
        reason: Why, in words (the numbers the choice compared).
        estimate: The Gram route's memory estimate of the samples where the
            choice made one, else ``None``; the Gram route's memory check
            (:func:`~vivit.memory.estimate.check_batch_fits`) takes it rather
            than probing the same batch again.
        forced: The implicit route cannot run on these samples (an obstacle of
            the data or the options), so the Gram route is the only one.
    """

    name: str
    reason: str
    estimate: MemoryEstimate | None = field(default=None, compare=False, repr=False)
    forced: bool = False

    def __str__(self) -> str:
        return f"{self.name} route: {self.reason}"


@dataclass(frozen=True)
class RouteRequest:
    """What :func:`compare_routes` compares: a request's samples and estimates.

    Attributes:
        gram: The Gram route's estimate of all samples (``None``: the model
            could not be probed).
        implicit: Makes the implicit route's estimate for :data:`ROUTE_TOP_K`
            pairs and the largest block with the bytes available (the same the
            choice compares with; ``None``: could not be probed); called only
            where the choice needs it.
        blocks: The samples: a mini-batch's, or a loader's batches.
        num_params: Parameters ``D`` of the largest group.
        data: The samples in words, and what is assumed of them (``""`` for a
            mini-batch); the reason starts with it.
    """

    gram: MemoryEstimate | None
    implicit: Callable[[int], ImplicitEstimate | None]
    blocks: Blocks
    num_params: int
    data: str = ""


def fixed_route(
    options: CurvatureOptions, obstacle: str | None = None
) -> RouteChoice | None:
    """The route the options fix, or ``None`` where ``"auto"`` compares the two.

    Args:
        options: The checked options.
        obstacle: What the data rules out of the implicit route, if anything
            (e.g. a one-pass iterator), and what to do.

    Returns:
        The route asked for by name, the Gram route where the implicit route
        cannot honour the request, or ``None``.
    """
    if options.solver == "implicit":
        return RouteChoice("implicit", "solver='implicit' was asked for")
    if options.solver != "auto":
        return RouteChoice("gram", f"solver={options.solver!r} was asked for")
    obstacle = implicit_obstacle(options) or obstacle
    if obstacle is not None:
        return RouteChoice(
            "gram", f"the implicit route cannot run: {obstacle}", forced=True
        )
    return None


def compare_routes(request: RouteRequest, available: int) -> RouteChoice:
    """Memory first, then passes: the route of a request under ``"auto"``.

    Args:
        request: The request's samples and estimates.
        available: Bytes the request may take (what the process can still
            allocate, :func:`~vivit.gram.memory.available_bytes`).

    Returns:
        The route and the reason (the numbers compared).

    Raises:
        ProductsTooLargeError: If neither route fits (both estimates and the
            options in the message).
    """
    estimate, blocks = request.gram, request.blocks
    if estimate is None:
        return _choice(
            request,
            "gram",
            "the Gram route's memory and columns could not be estimated (the "
            "logger 'vivit' says why); pass solver='implicit' for GGN-vector "
            "products",
        )
    columns = estimate.num_rows // blocks.curvature
    needed = kept_bytes(estimate) / ESTIMATE_FACTOR
    if needed > available:
        return _implicit_if_it_fits(
            request,
            available,
            f"the Gram route's factors of V ({columns} columns per sample, "
            f"{blocks.curvature} samples) need at least {format_bytes(needed)}, "
            f"but {format_bytes(available)} are available",
        )
    costs = RouteCosts.of(
        estimate, blocks.curvature, request.num_params, ROUTE_TOP_K, blocks.batches
    )
    if costs.gram > costs.products:
        return _implicit_if_it_fits(request, available, str(costs))
    return _choice(request, "gram", str(costs))


@dataclass(frozen=True)
class RouteCosts:
    """Both routes' expected work, in passes over the samples.

    A pass over ``N`` samples in ``B`` batches (``B = 1``: a mini-batch) costs
    ``3·F·N + B·``:data:`PASS_OVERHEAD` multiply-adds (``F`` the forward pass's
    per sample, ``MemoryEstimate.sample_work``); the implicit route
    :data:`IMPLICIT_PASSES` of them and its solver's orthogonalization in
    parameter space (:func:`~vivit.linalg.top_k.iterative_work` of
    ``D``-vectors at :data:`GEMM_SPEEDUP`); the Gram route its engine's ``g·K``
    passes' arithmetic (``g`` of :data:`GRAM_PASSES_PER_COLUMN`, one overhead
    per batch), then forming the Gram matrices of all ``N·K`` columns
    (``MemoryEstimate.gram_work``) and the cheaper of the dense and the
    iterative solve (:func:`~vivit.linalg.top_k.dense_work`,
    :func:`~vivit.linalg.top_k.iterative_work`), both at :data:`GEMM_SPEEDUP`
    times the passes' rate.

    Attributes:
        columns: Columns ``K`` of ``V`` per sample.
        engine: The Gram route's backward pass, in passes.
        formation: Forming its Gram matrices, in passes.
        solve: Its eigensolver, in passes.
        implicit: The implicit route's products, in passes.
        basis: Its solver's orthogonalization of a basis in parameter space, in
            passes.
        batches: Batches ``B`` of a pass (``1``: a mini-batch).
    """

    columns: int
    engine: float
    formation: float
    solve: float
    implicit: float
    basis: float
    batches: int = 1

    @classmethod
    def of(
        cls,
        estimate: MemoryEstimate,
        samples: int,
        num_params: int,
        top_k: int,
        batches: int = 1,
    ) -> RouteCosts:
        """The costs of the samples from their Gram route's estimate.

        Args:
            estimate: The Gram route's estimate of all samples
                (:func:`~vivit.memory.estimate.gram_estimate`).
            samples: Curvature samples ``N_S``.
            num_params: Parameters ``D`` of the largest group.
            top_k: Leading eigenpairs.
            batches: Batches ``B`` of a pass (``1``: a mini-batch).

        Returns:
            The costs.
        """
        size = estimate.num_rows
        columns = size // samples
        arithmetic = 3 * estimate.sample_work * samples
        overhead = batches * PASS_OVERHEAD
        pass_work = arithmetic + overhead
        per_column = GRAM_PASSES_PER_COLUMN[estimate.engine]
        width = solver_block_size("iterative", top_k, size)
        solve = min(
            dense_work(size),
            iterative_work(size, width, size, gram_pass_work(size, torch.float32)),
        )
        return cls(
            columns=columns,
            engine=(per_column * columns * arithmetic + overhead) / pass_work,
            formation=estimate.gram_work / GEMM_SPEEDUP / pass_work,
            solve=solve / GEMM_SPEEDUP / pass_work,
            implicit=IMPLICIT_PASSES,
            basis=iterative_work(
                num_params, solver_block_size("implicit", top_k, num_params), 0.0
            )
            / GEMM_SPEEDUP
            / pass_work,
            batches=batches,
        )

    @property
    def gram(self) -> float:
        """The Gram route's passes."""
        return self.engine + self.formation + self.solve

    @property
    def products(self) -> float:
        """The implicit route's passes."""
        return self.implicit + self.basis

    def __str__(self) -> str:
        unit = (
            "passes of the batch"
            if self.batches == 1
            else f"passes over its {self.batches} batches"
        )
        return (
            f"the Gram route costs about {self.gram:.0f} {unit} "
            f"({self.columns} columns of V per sample: backward pass "
            f"{self.engine:.0f}, Gram matrix {self.formation:.0f}, solver "
            f"{self.solve:.0f}), the implicit route about {self.products:.0f} for "
            f"{ROUTE_TOP_K} eigenpairs (products {self.implicit:.0f}, Krylov basis "
            f"{self.basis:.0f})"
        )


def _choice(request: RouteRequest, name: str, reason: str) -> RouteChoice:
    """The route, its reason prefixed with the samples it is for."""
    if request.data:
        reason = f"{request.data}: {reason}"
    return RouteChoice(name, reason, request.gram)


def _implicit_if_it_fits(
    request: RouteRequest, available: int, reason: str
) -> RouteChoice:
    """The implicit route where its products fit, else the Gram route (or neither)."""
    products = request.implicit(available)
    if products is None or products.total <= ESTIMATE_FACTOR * available:
        return _choice(request, "implicit", reason)
    gram = request.gram
    if kept_bytes(gram) <= ESTIMATE_FACTOR * available:
        return _choice(
            request,
            "gram",
            f"{reason}; but {implicit_summary(products)}, more than the "
            f"{format_bytes(available)} available",
        )
    loader = request.blocks.loader_batch is not None
    samples = (
        "a loader over fewer samples, smaller batches (the implicit route holds "
        "one batch's activations)"
        if loader
        else "the curvature of fewer samples (subsampling=[...]) or a smaller batch"
    )
    streaming = (
        ", or keep no factors: vivit.StreamingGGN(model, loss_func, "
        "loader).eigh(top_k=...) holds one batch's"
        if loader
        else ""
    )
    data = f" ({request.data})" if request.data else ""
    raise ProductsTooLargeError(
        f"Neither exact route fits into the {format_bytes(available)} "
        f"available{data}: the Gram route's factors of V need an estimated "
        f"{format_bytes(kept_bytes(gram))} (at least "
        f"{format_bytes(kept_bytes(gram) / ESTIMATE_FACTOR)}), and "
        f"{implicit_summary(products)}. Refused before running. Ask for fewer "
        f"pairs (eigh(top_k=...) with solver='implicit'), use {samples}, bound "
        "the activations with chunk_size=..., or Monte-Carlo sample the loss "
        f"Hessian on the Gram route (mc_samples=1){streaming}."
    )


def implicit_obstacle(options: CurvatureOptions) -> str | None:
    """Why the implicit route cannot honour the options, or ``None`` if it can.

    Args:
        options: The checked options.

    Returns:
        What stands in the way and what to do, or ``None``.
    """
    if options.mc_samples:
        return (
            "solver='implicit' multiplies the exact loss Hessian (diag(p) − ppᵀ "
            "per position, never formed), which costs what a sampled one would: "
            "Monte-Carlo sampling saves nothing there. Drop mc_samples, or use a "
            "Gram route (solver='auto') for the MC estimate."
        )
    if options.gram_dtype is not None:
        return (
            "gram_dtype is the type of the Gram matrix and of the products with V, "
            "which solver='implicit' never forms: its products run in the model's "
            "type (the eigensolver's basis in float64). Drop gram_dtype, or cast "
            "the model (model.double()) for float64 products."
        )
    if options.engine not in ("auto", "func"):
        return (
            f"solver='implicit' runs no engine (its products are torch.func's), got "
            f"engine={options.engine!r}: drop engine, or use a Gram route."
        )
    return None
