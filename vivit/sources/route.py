"""Which route ``solver="auto"`` runs for the data of a request, and why.

The decision is :mod:`vivit.memory.route`'s, the one the estimate of a request
takes too (:func:`vivit.memory.estimate_memory`); this module gives it what the
data tells before anything of its size runs (``docs/math.rst``, "Choosing the
route"):

- a mini-batch: its samples, the curvature samples and the chunks; the model
  runs on one sample (the estimates' probe);
- a data loader: what is known without a pass over it. Its first batch is the
  probe and gives the batch size ``b``; ``len(loader)`` (at most
  ``max_batches``) the batches ``B``; every batch is taken to hold ``b``
  samples, ``N = B·b`` in all (an upper bound where only the last batch is
  smaller, as a ``DataLoader``'s). A loader without a length is judged on its
  first batch alone: more batches add to the Gram route's memory and cost and
  not to the implicit route's per batch, so where that batch runs the implicit
  route so would the loader; the Gram route's memory is checked again while its
  pass runs (:class:`~vivit.memory.budget.FactorBudget`). An iterator or
  generator, which can be passed over once, keeps the Gram route (the implicit
  route passes over the data in every product).

Under a process group each rank chooses from its own shard and every rank runs
the route :func:`agreed_route` decides from all their choices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import closing

from torch.nn import Module, Parameter

from vivit._validation import check_batch, check_inputs_match, check_subsampling
from vivit.engines.choice import resolve_engine
from vivit.errors import DistributedError
from vivit.gram.memory import available_bytes
from vivit.memory.estimate import Blocks, batch_estimate, implicit_estimate
from vivit.memory.route import (
    ROUTE_TOP_K,
    RouteChoice,
    RouteRequest,
    compare_routes,
    fixed_route,
)
from vivit.model_inputs import ModelInputs, num_samples
from vivit.options import CurvatureOptions
from vivit.sources.data import check_batched, is_batch, iterate_batches, num_batches


def choose_route(
    model: Module,
    loss_func: Module,
    data: object,
    param_groups: list[list[Parameter]],
    options: CurvatureOptions,
) -> RouteChoice:
    """The route of a request (see :mod:`vivit.memory.route` for the rules).

    Runs the model on one sample (the memory estimate's probe) where the rules
    need the routes' estimates; reads a loader's first batch for it.

    Args:
        model: The network.
        loss_func: The loss module.
        data: One mini-batch or an iterable of them.
        param_groups: The checked parameter groups.
        options: The checked options.

    Returns:
        The route and the reason.

    Raises:
        ProductsTooLargeError: If neither route fits, before anything of the
            data's size runs.
    """
    single = is_batch(data)
    fixed = fixed_route(options, None if single else _loader_obstacle(data, options))
    if fixed is not None:
        return fixed
    if single:
        request = _batch_request(model, loss_func, data, param_groups, options)
    else:
        request = _loader_request(model, loss_func, data, param_groups, options)
        if request is None:  # refused as empty by the Gram route
            return RouteChoice("gram", "the data loader yields no batch")
    return compare_routes(request, available_bytes(param_groups[0][0].device))


def _loader_obstacle(data: object, options: CurvatureOptions) -> str | None:
    """What rules the implicit route out for a loader before reading it."""
    if isinstance(data, Iterator):
        return (
            f"an iterator or generator ({type(data).__name__}) can be passed over "
            "once, and the implicit route passes over the data in every product: "
            "pass a list of batches or a DataLoader"
        )
    if options.subsampling is not None:
        return "subsampling selects samples of one mini-batch, not of a loader"
    return None


def _batch_request(
    model: Module,
    loss_func: Module,
    data: object,
    groups: list[list[Parameter]],
    options: CurvatureOptions,
) -> RouteRequest:
    """The estimates of one mini-batch, after the Gram route's checks."""
    check_batched(data, model)  # the checks of the Gram route, in its order
    inputs = check_batch(data)[0]
    check_inputs_match(inputs, list(model.parameters()))
    samples = num_samples(inputs)
    check_subsampling(options.subsampling, samples)
    curvature = samples if options.subsampling is None else len(options.subsampling)
    blocks = Blocks.of_batch(samples, curvature, options.chunk_size)
    return _request(model, loss_func, inputs, groups, options, blocks)


def _loader_request(
    model: Module,
    loss_func: Module,
    data: object,
    groups: list[list[Parameter]],
    options: CurvatureOptions,
) -> RouteRequest | None:
    """The estimates of a loader (``None``: empty).

    A list of batches is judged on its batches' sizes, another loader on its
    first batch and its length.
    """
    if isinstance(data, Sequence):  # every batch at hand: their true sizes
        batches = list(iterate_batches(data, model, options.max_batches))
        if not batches:
            return None
        sizes = [num_samples(inputs) for inputs, _ in batches]
        blocks = Blocks.of_loader(sum(sizes), max(sizes), options.chunk_size)
        words = (
            f"a list of {len(sizes)} batches of {sum(sizes)} samples (the largest "
            f"{max(sizes)})"
        )
        return _request(model, loss_func, batches[0][0], groups, options, blocks, words)
    with closing(iterate_batches(data, model, 1)) as batches:
        first = next(batches, None)
    if first is None:
        return None
    inputs = first[0]
    size = num_samples(inputs)
    count = num_batches(data, options.max_batches)
    if count is None:
        blocks = Blocks.of_loader(size, size, options.chunk_size)
        words = (
            f"a data loader without len(), judged on its first batch of {size} "
            "samples (more batches add to the Gram route's memory and cost only; "
            "its memory is checked again while its pass runs)"
        )
    else:
        blocks = Blocks.of_loader(count * size, size, options.chunk_size)
        words = (
            f"a data loader of about {count * size} samples ({count} batches of "
            f"the first batch's {size})"
        )
    return _request(model, loss_func, inputs, groups, options, blocks, words)


def _request(
    model: Module,
    loss_func: Module,
    inputs: ModelInputs,
    groups: list[list[Parameter]],
    options: CurvatureOptions,
    blocks: Blocks,
    words: str = "",
) -> RouteRequest:
    """Both routes' estimates of the samples, probed on ``inputs``' first one."""
    engine = resolve_engine(options.engine, model, loss_func, options.output)
    return RouteRequest(
        gram=batch_estimate(model, loss_func, inputs, groups, options, engine, blocks),
        implicit=lambda available: implicit_estimate(
            model,
            inputs,
            groups,
            options,
            ROUTE_TOP_K,
            block=blocks.block,
            available=available,
        ),
        blocks=blocks,
        num_params=max(sum(p.numel() for p in group) for group in groups),
        data=words,
    )


def agreed_route(choices: list[tuple[str, RouteChoice]]) -> RouteChoice:
    """The route every rank of a process group runs, from every rank's choice.

    Each rank chooses from its own shard (:func:`choose_route`); all must run
    one route. Where they differ (``solver="auto"``), the implicit route runs:
    a rank chose it because the Gram route's factors do not fit there or cost
    more passes, and the implicit route runs on any shard its options and data
    allow (a loader's too); its memory is checked on every rank before the
    first product. Where some rank cannot run it (a one-pass iterator as its
    shard: ``RouteChoice.forced``), every rank runs the Gram route, whose
    memory each rank checks as it runs.

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
    if any(choice.forced for _, choice in choices):
        return RouteChoice(
            "gram",
            f"the ranks chose differently, and all run the Gram route, the only "
            f"one some rank can run ({reasons})",
        )
    return RouteChoice(
        "implicit",
        f"the ranks chose differently, and all run the implicit route, which "
        f"runs on every shard ({reasons})",
    )
