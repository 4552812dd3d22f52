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
    ``V``, a few passes per product, about :data:`EXPECTED_PRODUCTS` products
    for :data:`ROUTE_TOP_K` leading eigenpairs, whatever ``K`` is.

``solver="auto"`` runs the implicit route for one mini-batch when the Gram
route's factors cannot fit into the memory available (its estimate divided by
:data:`~vivit.memory.estimate.ESTIMATE_FACTOR`, :func:`~vivit.memory.estimate.
check_batch_fits`'s criterion) or when its columns cost more passes than the
implicit products: ``K · GRAM_PASSES_PER_COLUMN > EXPECTED_PRODUCTS ·
IMPLICIT_PASSES_PER_PRODUCT``. Otherwise, and whenever the implicit route cannot
honour the request (Monte-Carlo sampling, a process group, ``gram_dtype``, the
BackPACK engine by name, a data loader), the Gram route. The choice and its
reason are kept as :class:`RouteChoice` (``LowRankGGN.route``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.nn import Module, Parameter

from vivit._validation import check_batch, check_inputs_match, check_subsampling
from vivit.engines.choice import resolve_engine
from vivit.gram.memory import available_bytes
from vivit.linalg.top_k import EXPECTED_BLOCKS
from vivit.memory.estimate import (
    ESTIMATE_FACTOR,
    MemoryEstimate,
    batch_estimate,
    kept_bytes,
)
from vivit.model_inputs import num_samples
from vivit.options import CurvatureOptions
from vivit.sources.batches import check_batched, is_batch
from vivit.sources.implicit import implicit_obstacle

#: Leading eigenpairs the choice is made for (the library's usual ``top_k``).
ROUTE_TOP_K = 10
#: Products the implicit route's block Krylov solver is expected to take for
#: :data:`ROUTE_TOP_K` pairs (:data:`~vivit.linalg.top_k.EXPECTED_BLOCKS` blocks
#: of ``k`` vectors).
EXPECTED_PRODUCTS = EXPECTED_BLOCKS * ROUTE_TOP_K
#: Forward+backward passes of the batch that one implicit product vector costs,
#: its share of the solver's linear algebra included (measured 1.0 to 3.7 for the
#: JVP and VJP alone on GPT-2 shapes and the char-LSTM; ``benchmarks/README.md``,
#: "The implicit route on language models").
IMPLICIT_PASSES_PER_PRODUCT = 3.0
#: Forward+backward passes of the batch that one column of ``V`` per sample costs
#: the Gram route, its backward pass and Gram matrix included (measured 2.5 for
#: the 3c3d CNN with BackPACK, ``N`` = 32 to 128, and 7 for the char-LSTM with
#: the func engine, whose LSTM weights have explicit columns).
GRAM_PASSES_PER_COLUMN = 4.0


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
    gib = 2**30
    if needed > available:
        return RouteChoice(
            "implicit",
            f"the Gram route's factors of V ({columns} columns per sample) need at "
            f"least {needed / gib:.1f} GiB, but {available / gib:.1f} GiB are "
            "available",
            estimate,
        )
    gram_passes = columns * GRAM_PASSES_PER_COLUMN
    implicit_passes = EXPECTED_PRODUCTS * IMPLICIT_PASSES_PER_PRODUCT
    comparison = (
        f"{columns} columns of V per sample cost the Gram route about "
        f"{gram_passes:.0f} forward+backward passes, {EXPECTED_PRODUCTS} implicit "
        f"products for {ROUTE_TOP_K} eigenpairs about {implicit_passes:.0f}"
    )
    if gram_passes > implicit_passes:
        return RouteChoice("implicit", comparison, estimate)
    return RouteChoice("gram", comparison, estimate)
