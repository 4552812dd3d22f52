"""A request's plan, from its data, or from sizes alone (the estimate's).

The route is fixed where the options name it or the implicit route cannot run
(:func:`fixed_route`); otherwise the plan compares the two, from the request
measured on the data's first batch. Under a process group every rank plans
from its own shard and all run the route :func:`agreed_plan` takes.
"""

from __future__ import annotations

from collections.abc import Iterator

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

    Args:
        options: The checked options.
        obstacle: What the data rules out of the implicit route, if anything.

    Returns:
        ``None`` where ``"auto"`` compares the routes.
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
    engine = resolve_engine(options.engine, model, loss_func, options.output)
    iterator = None
    if isinstance(data.source, Iterator):
        iterator = (
            f"an iterator or generator ({type(data.source).__name__}) can be passed "
            "over once, and the implicit route passes over the data in every "
            "product: pass a list of batches or a DataLoader"
        )
    fixed = fixed_route(options, iterator)
    batch = data.peek()
    if batch is None:  # refused as empty by the pass
        empty = ("gram", "the data loader yields no batch", False)
        return Plan(None, Sizes(1, 1, 1, 1), engine, param_groups, empty)
    batches, words = data.batch_sizes()
    curvature = None if options.subsampling is None else len(options.subsampling)
    sizes = Sizes.of(batches, curvature, options.chunk_size)
    measured = profile(
        model,
        loss_func,
        batch,
        param_groups,
        options,
        engine,
        subsampled=curvature is not None,
    )
    return Plan(measured, sizes, engine, param_groups, fixed, words)


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

    The request is measured on ``inputs`` with targets of the loss's shape
    (``loss_func`` ``None``: cross-entropy); ``available`` bytes may be taken
    (``None``: what the device has); ``compare=False`` leaves the route
    undecided (the Gram route's), for estimates of both routes.
    """
    loss_func = CrossEntropyLoss() if loss_func is None else loss_func
    engine = resolve_engine(options.engine, model, loss_func, options.output)
    fixed = fixed_route(options)
    if fixed is None and not compare:
        fixed = ("gram", "not compared", False)
    batch = (inputs, None)  # targets of the loss's shape, made on the copy
    measured = profile(
        model,
        loss_func,
        batch,
        param_groups,
        options,
        engine,
        subsampled=sizes.curvature < sizes.samples,
    )
    return Plan(measured, sizes, engine, param_groups, fixed, available=available)


def asked(options: CurvatureOptions) -> str:
    """What a rank asked for, in words: its route, else its solver."""
    if options.route != "auto":
        return f"route={options.route!r}"
    return f"solver={options.solver!r}"


def agreed_plan(choices: list[tuple[str, Plan]]) -> Plan:
    """The plan every rank of a group runs, from every rank's request and plan.

    Where the ranks chose differently, the implicit route runs (it runs on any
    shard), unless some rank cannot run it.

    Args:
        choices: Every rank's request in words (:func:`asked`) and plan.

    Raises:
        DistributedError: If the ranks asked for different routes or solvers.
    """
    solver, first = choices[0]
    if len(choices) == 1:
        return first
    asked = [
        f"rank {rank} asks for {theirs}, rank 0 for {solver}"
        for rank, (theirs, _) in enumerate(choices)
        if theirs != solver
    ]
    if asked:
        raise DistributedError(
            "; ".join(asked) + ". Every rank must pass the same options."
        )
    names = {plan.route for _, plan in choices}
    reasons = "; ".join(f"rank {r}: {plan}" for r, (_, plan) in enumerate(choices))
    if len({plan.reason for _, plan in choices}) == 1:
        return first
    if len(names) == 1:
        return first.agreed(first.route, f"every rank chose it ({reasons})")
    if any(plan.forced for _, plan in choices):
        return first.agreed(
            "gram",
            "the ranks chose differently, and all run the Gram route, the only "
            f"one some rank can run ({reasons})",
        )
    return first.agreed(
        "implicit",
        "the ranks chose differently, and all run the implicit route, which runs "
        f"on every shard ({reasons})",
    )
