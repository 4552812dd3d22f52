"""The memory of a request before it runs: its plan's estimate, from sizes alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from torch.nn import Module, Parameter

from vivit._param_groups import param_group_lists
from vivit._validation import (
    check_batch_norms,
    check_inputs,
    check_inputs_match,
    check_model,
    check_params,
    check_positive_int,
    check_subsampling,
)
from vivit.distributed.sharded import local_view
from vivit.errors import InvalidArgumentError
from vivit.gram.memory import available_bytes, resident_bytes
from vivit.linalg.top_k import check_solver
from vivit.memory.plan import MemoryEstimate, Sizes
from vivit.memory.request import fixed_route, sized_plan
from vivit.model_inputs import ModelInputs
from vivit.options import CurvatureOptions, check_option_names


def estimate_memory(
    model: Module,
    example_inputs: ModelInputs,
    batch_size: int,
    *,
    loss_func: Module | None = None,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
    top_k: int | None = 10,
    num_curvature_samples: int | None = None,
    options: CurvatureOptions | None = None,
    **option_values: object,
) -> MemoryEstimate:
    """Estimate the peak memory of ``LowRankGGN(...)`` and ``eigh(top_k)``.

    The request runs on a copy of the model on one and two of the example
    samples; its memory is extrapolated to ``batch_size`` samples and the
    route the request would take (``docs/math.rst``, "Memory of a request").
    For an FSDP2 model it is a collective, as the request is: every rank calls it
    ("Models sharded with FSDP2").

    Example::

        estimate = estimate_memory(model, X[:1], 512, top_k=10)
        print(estimate.total / 2**30, "GiB on the", estimate.route, "route")

    Args:
        model: The network (BatchNorm in eval mode).
        example_inputs: A few input samples, ``[n, *input_shape]`` (or a dict).
        batch_size: Samples ``N`` of the mini-batch.
        loss_func: The loss module (``None``: cross-entropy).
        param_groups: As for :class:`~vivit.LowRankGGN`.
        top_k: Leading eigenpairs (``None``: all, the dense solver).
        num_curvature_samples: Curvature samples of a subsampling not known
            yet (``None``: all, or ``subsampling``'s).
        options: Options built before; those given by name replace them.
        **option_values: Options of :class:`~vivit.options.CurvatureOptions`.

    Returns:
        The estimate; ``.total`` is the peak in bytes, ``.route`` and
        ``.reason`` the route and why.

    Raises:
        VivitError: For an argument or option a request would refuse, or
            :class:`~vivit.ProductsTooLargeError` where neither route fits.
    """
    check_positive_int(batch_size, "batch_size")
    options = request_options(options, option_values)
    curvature = num_curvature_samples
    if curvature is not None and options.subsampling is not None:
        raise InvalidArgumentError(
            "Pass subsampling or num_curvature_samples, not both: "
            "num_curvature_samples stands for a subsampling not known yet."
        )
    if options.subsampling is not None:
        curvature = len(check_subsampling(options.subsampling, batch_size))
    elif curvature is not None:
        check_positive_int(curvature, "num_curvature_samples")
        if curvature > batch_size:
            raise InvalidArgumentError(
                f"num_curvature_samples={curvature} exceeds the "
                f"batch_size={batch_size}: the curvature samples are a subset of "
                "the mini-batch; pass at most batch_size (or None for all)."
            )
    sizes = Sizes.of([batch_size], curvature, options.chunk_size)
    return _estimate(
        model, example_inputs, loss_func, param_groups, options, sizes, top_k
    )


def estimate_data_set_memory(
    model: Module,
    example_inputs: ModelInputs,
    num_samples: int,
    batch_size: int,
    *,
    loss_func: Module | None = None,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
    top_k: int | None = 10,
    options: CurvatureOptions | None = None,
    **option_values: object,
) -> MemoryEstimate:
    """Estimate the peak memory of ``LowRankGGN`` over a loader and ``eigh(top_k)``.

    As :func:`estimate_memory`, for ``num_samples`` samples that a loader yields
    in batches of ``batch_size`` (the loader's own memory left out).

    Raises:
        VivitError: As :func:`estimate_memory`; a ``subsampling`` is refused.
    """
    check_positive_int(num_samples, "num_samples")
    check_positive_int(batch_size, "batch_size")
    options = request_options(options, option_values)
    if options.subsampling is not None:
        raise InvalidArgumentError(
            "subsampling selects samples of one mini-batch; a data loader takes "
            "none: estimate a loader over the samples whose curvature you want."
        )
    full, rest = divmod(num_samples, batch_size)
    batches = [batch_size] * full + ([rest] if rest else [])
    sizes = Sizes.of(batches, None, options.chunk_size)
    return _estimate(
        model, example_inputs, loss_func, param_groups, options, sizes, top_k
    )


def largest_batch(
    model: Module,
    example_inputs: ModelInputs,
    budget_bytes: int | None = None,
    *,
    count_resident: bool = True,
    max_batch_size: int = 2**20,
    **request: object,
) -> int:
    """The largest mini-batch one of the request's routes fits into a budget.

    Args:
        model: The network.
        example_inputs: A few input samples.
        budget_bytes: Memory the process may hold in all (``None``: what it can
            still allocate now).
        count_resident: Whether what the process holds now counts against
            ``budget_bytes``.
        max_batch_size: Upper end of the search.
        **request: Keywords of :func:`estimate_memory` (not
            ``num_curvature_samples`` nor ``subsampling``).

    Returns:
        The batch size (``0`` if not even one sample fits).

    Raises:
        InvalidArgumentError: If the budget is not positive or a keyword is not
            allowed.
    """
    if budget_bytes is not None and not budget_bytes > 0:
        raise InvalidArgumentError(
            f"budget_bytes must be positive, got {budget_bytes!r}."
        )
    for fixed in ("num_curvature_samples", "subsampling"):
        if fixed in request:
            raise InvalidArgumentError(
                f"largest_batch searches the mini-batch size; {fixed} would stay "
                "fixed. Leave it out."
            )
    loss_func = request.pop("loss_func", None)
    groups = request.pop("param_groups", None)
    top_k = request.pop("top_k", 10)
    options = request_options(request.pop("options", None), request)
    groups = _checked_groups(model, example_inputs, groups)
    device = groups[0][0].device
    budget = available_bytes(device)
    if budget_bytes is not None:
        budget = budget_bytes - (resident_bytes(device) if count_resident else 0)
    if budget <= 0:
        return 0
    fixed = fixed_route(options)
    routes = {"gram", "implicit"} if fixed is None else {fixed[0]}
    if top_k is None:  # all pairs: a Gram route's
        routes -= {"implicit"}

    def fits(batch_size: int) -> bool:
        sizes = Sizes.of([batch_size], None, options.chunk_size)
        plan = sized_plan(
            model, example_inputs, loss_func, groups, options, sizes, budget,
            compare=False,
        )  # fmt: skip
        estimates = {
            "gram": lambda: plan.gram_estimate(top_k, options.solver),
            "implicit": lambda: plan.implicit_estimate(top_k, budget),
        }
        return any(
            plan.measured(route) is not None and estimates[route]().total <= budget
            for route in routes
        )

    low, high = 0, 1
    while high <= max_batch_size and fits(high):
        low, high = high, 2 * high
    high = min(high, max_batch_size + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def request_options(
    options: CurvatureOptions | None, values: Mapping[str, object]
) -> CurvatureOptions:
    """The request's options, checked as the run checks them.

    Raises:
        InvalidArgumentError: For an unknown name or ``options`` of another type.
    """
    check_option_names(
        values, " (the estimate also takes param_groups, top_k and loss_func)"
    )
    if options is None:
        return CurvatureOptions(**{"process_group": False, **values})
    if not isinstance(options, CurvatureOptions):
        raise InvalidArgumentError(
            "options must be a vivit.options.CurvatureOptions, got "
            f"{type(options).__name__}."
        )
    return options.replace(**values) if values else options


def _estimate(
    model: Module,
    example_inputs: ModelInputs,
    loss_func: Module | None,
    param_groups: Sequence[Sequence[Parameter]] | None,
    options: CurvatureOptions,
    sizes: Sizes,
    top_k: int | None,
) -> MemoryEstimate:
    check_model(model)  # before the gather reads its modules
    model, placement = local_view(model)  # a collective for FSDP2
    groups = _checked_groups(model, example_inputs, placement.groups(param_groups))
    check_solver(options.solver, top_k)
    plan = sized_plan(model, example_inputs, loss_func, groups, options, sizes)
    if plan.route == "implicit" and top_k is None:
        raise InvalidArgumentError(
            f"This request takes the implicit route ({plan.reason}), which computes "
            "a few leading eigenpairs: pass top_k (e.g. top_k=10), or name a Gram "
            "solver (solver='dense') for all of them."
        )
    if plan.measured(plan.route) is None:
        raise InvalidArgumentError(
            "The request could not run on a copy of the model with these example "
            "inputs (the logger 'vivit' says why, level INFO)."
        )
    if plan.route == "implicit":
        estimate = plan.implicit_estimate(top_k)
    else:
        estimate = plan.gram_estimate(top_k, options.solver)
    return dataclasses.replace(estimate, gathered=placement.gathered)


def _checked_groups(
    model: Module,
    example_inputs: ModelInputs,
    param_groups: Sequence[Sequence[Parameter]] | None,
) -> list[list[Parameter]]:
    """The checks of a request that every estimate makes, as the run makes them."""
    check_model(model)
    groups = param_group_lists(param_groups, model)
    names = {id(p): f"parameter {n!r}" for n, p in model.named_parameters()}
    check_params([p for group in groups for p in group], names, allow_meta=True)
    check_inputs(example_inputs, "example_inputs")
    check_inputs_match(example_inputs, groups[0])
    check_batch_norms(model)
    return groups
