"""Which route ``solver="auto"`` runs for a mini-batch, and why.

Two routes give the exact GGN's leading eigenpairs (``docs/math.rst``, "Choosing
the route"):

``"gram"``
    An engine backpropagates the ``K`` columns of ``V`` per sample (``K = C``,
    ``C·T`` with sequences of ``T`` positions, ``M·T`` with Monte-Carlo per
    token) and keeps their factors (:mod:`vivit.sources.stored`); a Gram-space
    solver takes the leading eigenpairs. Its backward pass costs about ``K``
    times that of the loss, and its factors grow with ``K``.
``"implicit"``
    GGN-vector products by JVP and VJP (:mod:`vivit.sources.implicit`): no
    ``V``, about :data:`IMPLICIT_PASSES` passes of the batch for
    :data:`ROUTE_TOP_K` leading eigenpairs, whatever ``K`` is.

``solver="auto"`` runs the implicit route for one mini-batch when the Gram
route's factors cannot fit into the memory available (its estimate divided by
:data:`~vivit.memory.estimate.ESTIMATE_FACTOR`, :func:`~vivit.memory.estimate.
check_batch_fits`'s criterion) or when it costs more passes of the batch
(:class:`RouteCosts`: the engine's backward pass, forming the Gram matrix, the
solver, against the implicit route's passes), provided the implicit products
fit (:func:`~vivit.memory.estimate.implicit_estimate`); where neither fits, the
request is refused (:class:`~vivit.ProductsTooLargeError`, with both estimates).
Otherwise, and whenever the implicit route cannot honour the request
(Monte-Carlo sampling, ``gram_dtype``, the BackPACK engine by name, a data
loader), the Gram route. Under a process group each rank chooses from its own
shard and every rank runs the route :func:`agreed_route` decides from all their
choices. The choice and its reason (the numbers compared) are kept as
:class:`RouteChoice` (``LowRankGGN.route``). The constants
are measured with ``benchmarks/eigenpairs.py`` on one CPU thread; on the
problems measured the choice picks the faster route, within 2× where the two
are close (char-LSTM at N = 8: 1.4×; ``docs/math.rst``, "Choosing the route").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import Module, Parameter

from vivit._validation import check_batch, check_inputs_match, check_subsampling
from vivit.engines.choice import resolve_engine
from vivit.errors import DistributedError, ProductsTooLargeError
from vivit.gram.memory import available_bytes, format_bytes
from vivit.linalg.top_k import dense_work, iterative_work, solver_block_size
from vivit.linalg.top_k import pass_work as gram_pass_work
from vivit.memory.estimate import (
    ESTIMATE_FACTOR,
    MemoryEstimate,
    batch_estimate,
    implicit_estimate,
    implicit_summary,
    kept_bytes,
)
from vivit.model_inputs import num_samples
from vivit.options import CurvatureOptions
from vivit.sources.batches import check_batched, is_batch
from vivit.sources.implicit import implicit_obstacle

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
#: Multiply-adds one pass costs besides its arithmetic (Python, kernel launches):
#: 1.7 ms at 11 GMAC/s, the forward+backward pass of char-LSTM at N = 2 (1.8 ms,
#: against 3.6 ms at N = 32).
PASS_OVERHEAD = 2e7
#: How many times faster the Gram matrix's contractions and the eigensolver run
#: than the passes per multiply-add (measured 33 against 11 GMAC/s on char-LSTM,
#: N = 32, one thread).
GEMM_SPEEDUP = 3.0


@dataclass(frozen=True)
class RouteChoice:
    """The route a :class:`~vivit.LowRankGGN` runs, and why.

    Attributes:
        name: ``"gram"`` (factors of ``V``, a Gram-space solver) or
            ``"implicit"`` (GGN-vector products, no ``V``).
        reason: Why, in words (the numbers the choice compared).
        estimate: The Gram route's memory estimate of the mini-batch where the
            choice probed the model for it, else ``None``; the Gram route's
            memory check (:func:`~vivit.memory.estimate.check_batch_fits`) takes
            it rather than probing the same batch again.
    """

    name: str
    reason: str
    estimate: MemoryEstimate | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.name} route: {self.reason}"


def choose_route(
    model: Module,
    loss_func: Module,
    data: object,
    param_groups: list[list[Parameter]],
    options: CurvatureOptions,
) -> RouteChoice:
    """The route of a request (see the module docstring for the rules).

    Runs the model on one sample (the memory estimate's probe) where the rules
    need the Gram route's columns and bytes; nothing of the batch's size.

    Args:
        model: The network.
        loss_func: The loss module.
        data: One mini-batch or an iterable of them.
        param_groups: The checked parameter groups.
        options: The checked options.

    Returns:
        The route and the reason.
    """
    if options.solver == "implicit":
        return RouteChoice("implicit", "solver='implicit' was asked for")
    if options.solver != "auto":
        return RouteChoice("gram", f"solver={options.solver!r} was asked for")
    obstacle = implicit_obstacle(options)
    if obstacle is not None:
        return RouteChoice("gram", f"the implicit route cannot run: {obstacle}")
    if not is_batch(data):
        return RouteChoice(
            "gram",
            "a data loader: the Gram route keeps every batch's factors (pass "
            "solver='implicit' for GGN-vector products summed over its batches)",
        )
    return _compare_routes(model, loss_func, data, param_groups, options)


def _compare_routes(
    model: Module,
    loss_func: Module,
    data: object,
    groups: list[list[Parameter]],
    options: CurvatureOptions,
) -> RouteChoice:
    """Memory first, then passes: the route for one mini-batch."""
    check_batched(data, model)  # the checks of the Gram route, in its order
    inputs = check_batch(data)[0]
    check_inputs_match(inputs, list(model.parameters()))
    check_subsampling(options.subsampling, num_samples(inputs))
    engine = resolve_engine(options.engine, model, loss_func, options.output)
    estimate = batch_estimate(model, loss_func, inputs, groups, options, engine)
    if estimate is None:
        return RouteChoice(
            "gram",
            "the Gram route's memory and columns could not be estimated (the "
            "logger 'vivit' says why); pass solver='implicit' for GGN-vector "
            "products",
        )
    samples = (
        num_samples(inputs) if options.subsampling is None else len(options.subsampling)
    )
    columns = estimate.num_rows // samples
    needed = kept_bytes(estimate) / ESTIMATE_FACTOR
    available = available_bytes(groups[0][0].device)
    if needed > available:
        return _implicit_if_it_fits(
            model,
            inputs,
            groups,
            options,
            estimate,
            f"the Gram route's factors of V ({columns} columns per sample) need at "
            f"least {format_bytes(needed)}, but {format_bytes(available)} are "
            "available",
        )
    size = max(sum(p.numel() for p in group) for group in groups)
    costs = RouteCosts.of(estimate, samples, size, ROUTE_TOP_K)
    if costs.gram > costs.products:
        return _implicit_if_it_fits(
            model, inputs, groups, options, estimate, str(costs)
        )
    return RouteChoice("gram", str(costs), estimate)


@dataclass(frozen=True)
class RouteCosts:
    """Both routes' expected work for one mini-batch, in passes of the batch.

    A pass of ``N`` samples costs ``3·F·N +`` :data:`PASS_OVERHEAD`
    multiply-adds (``F`` the forward pass's per sample, ``MemoryEstimate.
    sample_work``); the implicit route :data:`IMPLICIT_PASSES` of them and its
    solver's orthogonalization in parameter space
    (:func:`~vivit.linalg.top_k.iterative_work` of ``D``-vectors at
    :data:`GEMM_SPEEDUP`); the Gram
    route its engine's ``g·K`` passes' arithmetic (``g`` of
    :data:`GRAM_PASSES_PER_COLUMN`, one overhead), then forming the Gram
    matrices (``MemoryEstimate.gram_work``) and the cheaper of the dense and
    the iterative solve (:func:`~vivit.linalg.top_k.dense_work`,
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
    """

    columns: int
    engine: float
    formation: float
    solve: float
    implicit: float
    basis: float

    @classmethod
    def of(
        cls, estimate: MemoryEstimate, samples: int, num_params: int, top_k: int
    ) -> RouteCosts:
        """The costs of a batch from its Gram route's estimate.

        Args:
            estimate: The Gram route's :func:`~vivit.memory.estimate.batch_estimate`.
            samples: Curvature samples ``N_S``.
            num_params: Parameters ``D`` of the largest group.
            top_k: Leading eigenpairs.

        Returns:
            The costs.
        """
        size = estimate.num_rows
        columns = size // samples
        arithmetic = 3 * estimate.sample_work * samples
        pass_work = arithmetic + PASS_OVERHEAD
        per_column = GRAM_PASSES_PER_COLUMN[estimate.engine]
        width = solver_block_size("iterative", top_k, size)
        solve = min(
            dense_work(size),
            iterative_work(size, width, size, gram_pass_work(size, torch.float32)),
        )
        return cls(
            columns=columns,
            engine=(per_column * columns * arithmetic + PASS_OVERHEAD) / pass_work,
            formation=estimate.gram_work / GEMM_SPEEDUP / pass_work,
            solve=solve / GEMM_SPEEDUP / pass_work,
            implicit=IMPLICIT_PASSES,
            basis=iterative_work(num_params, top_k, 0.0) / GEMM_SPEEDUP / pass_work,
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
        return (
            f"the Gram route costs about {self.gram:.0f} passes of the batch "
            f"({self.columns} columns of V per sample: backward pass "
            f"{self.engine:.0f}, Gram matrix {self.formation:.0f}, solver "
            f"{self.solve:.0f}), the implicit route about {self.products:.0f} for "
            f"{ROUTE_TOP_K} eigenpairs (products {self.implicit:.0f}, Krylov basis "
            f"{self.basis:.0f})"
        )


def _implicit_if_it_fits(
    model: Module,
    inputs: object,
    groups: list[list[Parameter]],
    options: CurvatureOptions,
    estimate: MemoryEstimate,
    reason: str,
) -> RouteChoice:
    """The implicit route where its products fit, else the Gram route (or neither)."""
    products = implicit_estimate(model, inputs, groups, options, ROUTE_TOP_K)
    if products is None:
        return RouteChoice("implicit", reason, estimate)
    available = available_bytes(groups[0][0].device)
    if products.total <= ESTIMATE_FACTOR * available:
        return RouteChoice("implicit", reason, estimate)
    if kept_bytes(estimate) <= ESTIMATE_FACTOR * available:
        return RouteChoice(
            "gram",
            f"{reason}; but {implicit_summary(products)}, more than the "
            f"{format_bytes(available)} available",
            estimate,
        )
    raise ProductsTooLargeError(
        f"Neither exact route fits into the {format_bytes(available)} available: "
        f"the Gram route's factors of V need an estimated "
        f"{format_bytes(kept_bytes(estimate))} (at least "
        f"{format_bytes(kept_bytes(estimate) / ESTIMATE_FACTOR)}), and "
        f"{implicit_summary(products)}. Refused before running. Ask for fewer "
        "pairs (eigh(top_k=...) with solver='implicit'), use the curvature of "
        "fewer samples (subsampling=[...]) or a smaller batch, bound the "
        "activations with chunk_size=..., or Monte-Carlo sample the loss Hessian "
        "on the Gram route (mc_samples=1)."
    )


def agreed_route(choices: list[tuple[str, RouteChoice]]) -> RouteChoice:
    """The route every rank of a process group runs, from every rank's choice.

    Each rank chooses from its own shard (:func:`choose_route`); all must run
    one route. Where they differ (``solver="auto"``), the implicit route runs:
    a rank chose it because the Gram route's factors do not fit there or cost
    more passes, and the implicit route runs on any shard (a loader's too);
    its memory is checked on every rank before the first product.

    Args:
        choices: Every rank's requested solver and choice, in rank order.

    Returns:
        The route, with every rank's reason where they differ (without a
        memory estimate: each rank probed its own shard); in one process its
        choice as it is.

    Raises:
        DistributedError: If the ranks asked for different solvers.
    """
    solver, first = choices[0]
    if len(choices) == 1:  # one process: its own choice (and estimate)
        return first
    asked = [
        f"rank {rank} asks for solver={theirs!r}, rank 0 for {solver!r}"
        for rank, (theirs, _) in enumerate(choices)
        if theirs != solver
    ]
    if asked:
        raise DistributedError(
            "; ".join(asked) + ". Every rank must pass the same options."
        )
    names = {choice.name for _, choice in choices}
    if len({choice.reason for _, choice in choices}) == 1:
        return RouteChoice(first.name, first.reason)
    reasons = "; ".join(
        f"rank {rank}: {choice}" for rank, (_, choice) in enumerate(choices)
    )
    if len(names) == 1:
        return RouteChoice(first.name, f"every rank chose it ({reasons})")
    return RouteChoice(
        "implicit",
        f"the ranks chose differently, and all run the implicit route, which "
        f"runs on every shard ({reasons})",
    )
