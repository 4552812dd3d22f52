"""A request's plan, from its data or from sizes alone (the estimate's).

Under a process group every rank plans from its own shard and all run the plan
:func:`agreed_plan` takes.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor
from torch.nn import CrossEntropyLoss, Module, Parameter

from vivit.engines.choice import resolve_engine
from vivit.errors import DistributedError
from vivit.memory.plan import Plan, Sizes
from vivit.memory.profile import profile
from vivit.model_inputs import ModelInputs
from vivit.options import CurvatureOptions, implicit_obstacle
from vivit.sources.data import Data


def fixed_route(
    options: CurvatureOptions, obstacle: str | None = None
) -> tuple[str, str, bool] | None:
    """The route the options fix, why, and whether the implicit one cannot run.

    ``obstacle``: what the data rules out of the implicit route, if anything.
    ``None``: ``"auto"`` compares the routes.
    """
    if options.route != "auto":
        return options.route, f"route={options.route!r} was asked for", False
    if options.solver != "auto":
        return "gram", f"solver={options.solver!r} was asked for", False
    obstacle = implicit_obstacle(options) or obstacle
    if obstacle is not None:
        return "gram", f"the implicit route cannot run: {obstacle}", True
    return None


def plan_request(
    model: Module,
    loss_func: Module,
    data: Data,
    param_groups: list[list[Parameter]],
    options: CurvatureOptions,
) -> Plan:
    """The plan of a request on its data (measured on its first batch).

    Raises:
        ProductsTooLargeError: If neither route fits, before anything of the
            data's size runs.
    """
    obstacle = None
    if isinstance(data.source, Iterator):
        obstacle = (
            f"an iterator or generator ({type(data.source).__name__}) can be passed "
            "over once, and the implicit route passes over the data in every "
            "product: pass a list of batches or a DataLoader"
        )
    fixed = fixed_route(options, obstacle)
    batch = data.peek()
    if batch is None:  # refused as empty by the pass
        fixed = ("gram", "the data loader yields no batch", False)
        sizes, words = Sizes(1, 1, 1, 1), ""
    else:
        batches, words = data.batch_sizes()
        curvature = None if options.subsampling is None else len(options.subsampling)
        sizes = Sizes.of(batches, curvature, options.chunk_size)
    return _plan(model, loss_func, batch, param_groups, options, sizes, fixed, words)


def sized_plan(
    model: Module,
    inputs: ModelInputs,
    loss_func: Module | None,
    param_groups: list[list[Parameter]],
    options: CurvatureOptions,
    sizes: Sizes,
    available: int | None = None,
    compare: bool = True,
) -> Plan:
    """The plan of a request of ``sizes`` samples like ``inputs`` (an estimate).

    Targets of the loss's shape are made (``loss_func`` ``None``:
    cross-entropy); ``available`` bytes may be taken (``None``: what the device
    has); ``compare=False`` leaves the route the Gram route, for estimates of
    both.
    """
    fixed = fixed_route(options)
    if fixed is None and not compare:
        fixed = ("gram", "not compared", False)
    loss_func = CrossEntropyLoss() if loss_func is None else loss_func
    batch = (inputs, None)
    return _plan(
        model, loss_func, batch, param_groups, options, sizes, fixed, "", available
    )


def _plan(
    model: Module,
    loss_func: Module,
    batch: tuple[ModelInputs, Tensor | None] | None,
    param_groups: list[list[Parameter]],
    options: CurvatureOptions,
    sizes: Sizes,
    fixed: tuple[str, str, bool] | None,
    words: str,
    available: int | None = None,
) -> Plan:
    engine = resolve_engine(options.engine, model, loss_func, options.output)
    subsampled = sizes.curvature < sizes.samples
    measured = batch and profile(
        model, loss_func, batch, param_groups, options, engine, subsampled
    )
    return Plan(measured, sizes, engine, param_groups, fixed, words, available)


def asked(options: CurvatureOptions) -> str:
    """What a rank asked for, in words: its route, else its solver."""
    if options.route != "auto":
        return f"route={options.route!r}"
    return f"solver={options.solver!r}"


def agreed_plan(choices: list[tuple[str, Plan]]) -> Plan:
    """The plan every rank runs, from every rank's request (:func:`asked`) and plan.

    Where the ranks chose differently, the implicit route runs (it runs on any
    shard), unless some rank cannot run it.

    Raises:
        DistributedError: If the ranks asked for different routes or solvers.
    """
    request, first = choices[0]
    differ = [
        f"rank {rank} asks for {theirs}, rank 0 for {request}"
        for rank, (theirs, _) in enumerate(choices)
        if theirs != request
    ]
    if differ:
        message = "; ".join(differ)
        raise DistributedError(f"{message}. Every rank must pass the same options.")
    if len({plan.reason for _, plan in choices}) == 1:
        return first
    reasons = "; ".join(f"rank {r}: {plan}" for r, (_, plan) in enumerate(choices))
    if len({plan.route for _, plan in choices}) == 1:
        return first.agreed(first.route, f"every rank chose it ({reasons})")
    if any(plan.forced for _, plan in choices):
        route, why = "gram", "the Gram route, the only one some rank can run"
    else:
        route, why = "implicit", "the implicit route, which runs on every shard"
    return first.agreed(
        route, f"the ranks chose differently, and all run {why} ({reasons})"
    )
