"""The estimate of a request: the route it takes, and that route's memory.

:func:`estimate_memory` (a mini-batch) and :func:`estimate_data_set_memory` (a
data loader) take the route decision the run takes
(:func:`~vivit.memory.route.fixed_route`, then
:func:`~vivit.memory.route.compare_routes` under ``solver="auto"``, from the
same estimates of both routes) and return the estimate of that route, with the
reason: a :class:`~vivit.memory.estimate.MemoryEstimate` for the Gram route, an
:class:`~vivit.memory.estimate.ImplicitEstimate` for the implicit route; both
answer ``total``, ``route``, ``reason``, ``solver`` and ``engine``.
:func:`largest_batch` searches the largest mini-batch that some exact route the
request may take fits into a budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_positive_int, check_subsampling
from vivit.errors import InvalidArgumentError
from vivit.gram.memory import available_bytes, resident_bytes
from vivit.linalg.top_k import check_solver
from vivit.memory.estimate import (
    Blocks,
    ImplicitEstimate,
    MemoryEstimate,
    activation_width,
    check_request,
    gram_estimate,
    products_estimate,
)
from vivit.memory.route import ROUTE_TOP_K, RouteRequest, compare_routes, fixed_route
from vivit.model_inputs import ModelInputs
from vivit.options import CurvatureOptions, check_option_names

#: The estimate of whichever route a request takes.
RequestEstimate = MemoryEstimate | ImplicitEstimate


def estimate_memory(
    model: Module,
    example_inputs: Tensor,
    batch_size: int,
    *,
    loss_func: Module | None = None,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
    top_k: int | None = 10,
    num_curvature_samples: int | None = None,
    options: CurvatureOptions | None = None,
    **option_values: object,
) -> RequestEstimate:
    """Estimate the peak memory of ``LowRankGGN(...)`` followed by ``eigh(top_k)``.

    Runs the model on ``example_inputs`` (one or a few samples, without gradients
    and with the modules' hooks switched off, so BackPACK's stored inputs are left
    alone) to learn the layer shapes; nothing of size ``batch_size`` is allocated.
    The estimate is for the model's parameter data type and device, and is the
    growth of the process's memory (what it holds already is not counted).

    It is the estimate of the route the request takes: under ``solver="auto"``
    the route ``LowRankGGN`` would choose for a batch of ``batch_size`` samples
    with the memory available now (the same decision,
    :mod:`vivit.memory.route`), else the one asked for (``solver="implicit"``:
    the implicit route; any other solver: the Gram route). ``.route`` and
    ``.reason`` say which and why, as ``LowRankGGN.route`` does.

    Example::

        estimate = estimate_memory(
            model, X[:1], batch_size=512, loss_func=loss_func, top_k=10,
            gram_dtype=torch.float64, chunk_size=64,
        )
        print(estimate.total / 2**20, "MiB:", estimate.route, estimate.reason)

    Args:
        model: The network (BatchNorm in eval mode).
        example_inputs: A few input samples, ``[n, *input_shape]``.
        batch_size: Mini-batch size ``N`` of the request.
        loss_func: The request's loss module; ``engine="auto"`` is resolved with
            it as the run resolves it (``None``: a loss BackPACK supports).
        param_groups: As for :class:`~vivit.LowRankGGN` (``None``: one group).
        top_k: Number of leading eigenpairs asked for (``None``: all, which only
            a Gram route computes).
        num_curvature_samples: Size of a subsampling whose indices are not
            known yet (``None``: that of ``subsampling``, or ``N``).
        options: The request's options as one object (e.g. a
            :class:`~vivit.optim.DampedNewton`'s); keywords replace its fields.
        **option_values: The options of :class:`~vivit.LowRankGGN` by their
            names (``mc_samples``, ``subsampling``, ``gram_dtype``, ``solver``,
            ``engine``, ``chunk_size``, ...), checked as the run checks them
            (:class:`~vivit.options.CurvatureOptions`). On the Gram route
            ``solver="auto"`` is also resolved as the request's ``eigh(top_k)``
            resolves it (with several groups, for the largest group);
            ``chunk_size`` bounds the backward pass's transient and the
            activations to those of a chunk, while the kept factors and the Gram
            matrix are those of the whole batch.

    Returns:
        The Gram route's :class:`~vivit.memory.estimate.MemoryEstimate` or the
        implicit route's :class:`~vivit.memory.estimate.ImplicitEstimate`;
        ``.total`` is the peak in bytes, ``.route`` and ``.reason`` the route
        and why.

    Raises:
        InvalidArgumentError: For a ``batch_size``, ``top_k`` or option that a
            request would refuse, an unknown option, a ``num_curvature_samples``
            outside ``[1, batch_size]``, ``example_inputs`` without a sample
            along a batch axis, or ``top_k=None`` where the request takes the
            implicit route.
        ParamGroupError: For parameter groups a request would refuse, or a model
            without trainable parameters.
        UnsupportedDtypeError: For parameters a request would refuse (16-bit).
        BatchNormTrainingError: For BatchNorm in training mode.
        ProductsTooLargeError: Where the request would be refused because
            neither route fits (``solver="auto"``).
    """
    check_positive_int(batch_size, "batch_size")
    options = request_options(options, option_values)
    curvature = _curvature_samples(num_curvature_samples, options, batch_size)
    request = _Request.of(
        model,
        example_inputs,
        options,
        loss_func=loss_func,
        param_groups=param_groups,
        top_k=top_k,
    )
    return request.estimate(Blocks.of_batch(batch_size, curvature, options.chunk_size))


def estimate_data_set_memory(
    model: Module,
    example_inputs: Tensor,
    num_samples: int,
    batch_size: int,
    *,
    loss_func: Module | None = None,
    param_groups: Sequence[Sequence[Parameter]] | None = None,
    top_k: int | None = 10,
    options: CurvatureOptions | None = None,
    **option_values: object,
) -> RequestEstimate:
    """Estimate the peak memory of the GGN of a data set given as a loader.

    ``LowRankGGN(model, loss_func, loader)`` over ``num_samples`` samples that
    the loader yields in batches of ``batch_size``, followed by ``eigh(top_k)``,
    on the route the request takes (as :func:`estimate_memory`; under
    ``solver="auto"`` the route ``LowRankGGN`` chooses for such a loader). The
    Gram route runs every batch through the engine on its own (in chunks of
    ``chunk_size``): the backward pass's transient and the activations are those
    of one batch (or chunk); the kept factors, the batches' inputs that Linear
    layers keep, and the Gram matrix (side ``num_samples · C``) are those of all
    samples. The implicit route holds one batch's (or chunk's) activations and
    tangents and its Krylov basis, whatever ``num_samples`` is. The loader's own
    memory (its data set, workers) is left out. Probes the model as
    :func:`estimate_memory` does.

    Example::

        estimate = estimate_data_set_memory(model, X[:1], 10_000, 128, top_k=10)

    Args:
        model: The network (BatchNorm in eval mode).
        example_inputs: A few input samples, ``[n, *input_shape]``.
        num_samples: Samples of the data set (all of them curvature samples).
        batch_size: Samples per batch of the loader.
        loss_func: As for :func:`estimate_memory`.
        param_groups: As for :class:`~vivit.LowRankGGN` (``None``: one group).
        top_k: As for :func:`estimate_memory`.
        options: As for :func:`estimate_memory`.
        **option_values: As for :func:`estimate_memory` (not ``subsampling``,
            which a loader does not take).

    Returns:
        As for :func:`estimate_memory`.

    Raises:
        InvalidArgumentError: For sizes that are not positive integers, options
            that a request would refuse, ``example_inputs`` without a sample, or
            ``top_k=None`` where the request takes the implicit route.
        ParamGroupError: As for :func:`estimate_memory`.
        UnsupportedDtypeError: As for :func:`estimate_memory`.
        BatchNormTrainingError: As for :func:`estimate_memory`.
        ProductsTooLargeError: As for :func:`estimate_memory`.
    """
    check_positive_int(num_samples, "num_samples")
    check_positive_int(batch_size, "batch_size")
    options = request_options(options, option_values)
    if options.subsampling is not None:
        raise InvalidArgumentError(
            "subsampling selects samples of one mini-batch; a data loader takes "
            "none: estimate a loader over the samples whose curvature you want."
        )
    request = _Request.of(
        model,
        example_inputs,
        options,
        loss_func=loss_func,
        param_groups=param_groups,
        top_k=top_k,
    )
    return request.estimate(
        Blocks.of_loader(num_samples, batch_size, options.chunk_size),
        f"a data loader of {num_samples} samples in batches of {batch_size}",
    )


def largest_batch(
    model: Module,
    example_inputs: Tensor,
    budget_bytes: int | None = None,
    *,
    count_resident: bool = True,
    max_batch_size: int = 2**20,
    **request: object,
) -> int:
    """The largest mini-batch that an exact route of the request fits into a budget.

    The estimate is the growth of the process's memory; a budget is a statement
    about the process ("it fits in 8 GiB"): by default what the process holds
    now counts against it. Under ``solver="auto"`` a batch fits where the Gram
    route's estimate or the implicit route's (its Krylov basis cut to the
    budget) does, whichever; :func:`estimate_memory` at the size found tells
    which route the run takes with the memory available then (pass ``solver``
    to hold the request to one route). A request the implicit route cannot
    honour (Monte-Carlo sampling, ``gram_dtype``, ``top_k=None``, ...) or that
    names another solver is held to the Gram route's estimate.

    Example::

        N = largest_batch(model, X[:1], 8 * 2**30, loss_func=loss_func, top_k=10)

    Args:
        model: The network.
        example_inputs: A few input samples (see :func:`estimate_memory`).
        budget_bytes: Memory the process may hold in all (``None``: what it can
            still allocate now, :func:`vivit.gram.memory.available_bytes`:
            the least of free memory, its memory control group's and its
            address-space limit).
        count_resident: Whether ``budget_bytes`` includes what the process holds
            now (its resident set on the CPU, PyTorch's reserved memory on a
            GPU: :func:`vivit.gram.memory.resident_bytes`); ``False``: the
            budget is for the request alone, on top of that.
        max_batch_size: Upper end of the search.
        **request: Keywords of :func:`estimate_memory` (``loss_func``,
            ``top_k``, ``param_groups``, ``options`` and the options by name);
            not ``num_curvature_samples`` nor ``subsampling`` (they would not
            grow with the batch).

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
    named = {k: request.pop(k) for k in ("loss_func", "param_groups") if k in request}
    top_k = request.pop("top_k", 10)
    options = request_options(request.pop("options", None), request)
    the_request = _Request.of(model, example_inputs, options, top_k=top_k, **named)
    device = the_request.param_groups[0][0].device
    if budget_bytes is None:
        budget = available_bytes(device)
    else:
        budget = budget_bytes - (resident_bytes(device) if count_resident else 0)
    routes = the_request.routes()

    def fits(batch_size: int) -> bool:
        blocks = Blocks.of_batch(batch_size, batch_size, options.chunk_size)
        return any(
            the_request.route_estimate(route, blocks, budget).total <= budget
            for route in routes
        )

    if budget <= 0:
        return 0
    low, high = 0, 1
    while high <= max_batch_size and fits(high):
        low, high = high, 2 * high
    high = min(high, max_batch_size + 1)
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@dataclass
class _Request:
    """A request to estimate: the model, its probe and the checked options.

    Attributes:
        model: The network.
        example_inputs: The probe's samples.
        loss_func: The loss module (``None``: one BackPACK supports).
        param_groups: The checked parameter groups.
        options: The checked options.
        top_k: Leading eigenpairs asked for (``None``: all).
    """

    model: Module
    example_inputs: ModelInputs
    loss_func: Module | None
    param_groups: list[list[Parameter]]
    options: CurvatureOptions
    top_k: int | None
    _width: int | None = field(default=None, init=False)

    @classmethod
    def of(
        cls,
        model: Module,
        example_inputs: ModelInputs,
        options: CurvatureOptions,
        *,
        loss_func: Module | None = None,
        param_groups: Sequence[Sequence[Parameter]] | None = None,
        top_k: int | None = 10,
    ) -> _Request:
        """The request, its model, inputs and parameters checked as the run's."""
        groups = check_request(model, example_inputs, param_groups)
        check_solver(options.solver, top_k)
        return cls(model, example_inputs, loss_func, groups, options, top_k)

    def estimate(self, blocks: Blocks, data: str = "") -> RequestEstimate:
        """The estimate of the route the request takes, with its reason."""
        choice = fixed_route(self.options)
        if choice is None:
            choice = compare_routes(
                self._route_request(blocks, data),
                available_bytes(self.param_groups[0][0].device),
            )
        if choice.name == "implicit" and self.top_k is None:
            raise InvalidArgumentError(
                f"This request takes the implicit route ({choice.reason}), which "
                "computes a few leading eigenpairs: pass top_k (e.g. top_k=10), "
                "or name a Gram solver (solver='dense') for all of them."
            )
        if choice.name == "gram" and choice.estimate is not None:
            estimate = choice.estimate
        else:
            estimate = self.route_estimate(choice.name, blocks)
        return dataclasses.replace(estimate, reason=choice.reason)

    def routes(self) -> list[str]:
        """The routes the request may take: one it fixes, or both under ``"auto"``."""
        choice = fixed_route(self.options)
        if choice is not None:
            return [choice.name]
        return ["gram"] if self.top_k is None else ["gram", "implicit"]

    def route_estimate(
        self, route: str, blocks: Blocks, available: int | None = None
    ) -> RequestEstimate:
        """A route's estimate of the samples for ``top_k`` pairs.

        ``available`` bounds the implicit route's Krylov basis (``None``: the
        memory available).
        """
        if route == "gram":
            return self._gram(blocks)
        return self._implicit(blocks, self.top_k, available)

    def _route_request(self, blocks: Blocks, data: str) -> RouteRequest:
        """What the route choice compares (the Gram route for ``top_k``)."""
        return RouteRequest(
            gram=self._gram(blocks),
            implicit=lambda available: self._implicit(blocks, ROUTE_TOP_K, available),
            blocks=blocks,
            num_params=max(sum(p.numel() for p in g) for g in self.param_groups),
            data=data,
        )

    def _gram(self, blocks: Blocks) -> MemoryEstimate:
        """The Gram route's estimate for ``top_k`` pairs."""
        return gram_estimate(
            self.model,
            self.example_inputs,
            blocks,
            loss_func=self.loss_func,
            options=self.options,
            param_groups=self.param_groups,
            top_k=self.top_k,
        )

    def _implicit(
        self, blocks: Blocks, top_k: int, available: int | None
    ) -> ImplicitEstimate:
        """The implicit route's estimate for ``top_k`` pairs (one probe in all)."""
        if self._width is None:
            self._width = activation_width(
                self.model, self.example_inputs, self.param_groups, self.options
            )
        return products_estimate(
            self._width, blocks.block, self.param_groups, top_k, available
        )


def request_options(
    options: CurvatureOptions | None, values: Mapping[str, object]
) -> CurvatureOptions:
    """The request's options, checked as the run checks them.

    Args:
        options: Options built before (``None``: the defaults, this process
            alone).
        values: Options by name; they replace those of ``options``.

    Returns:
        The checked options.

    Raises:
        InvalidArgumentError: For an unknown name, or ``options`` that are not a
            :class:`~vivit.options.CurvatureOptions`; any error building the
            options raises (a malformed value).
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


def _curvature_samples(
    num_curvature_samples: int | None, options: CurvatureOptions, batch_size: int
) -> int:
    """``N_S``: the subsampling's size (checked against the batch), or ``N``."""
    if num_curvature_samples is not None and options.subsampling is not None:
        raise InvalidArgumentError(
            "Pass subsampling or num_curvature_samples, not both: "
            "num_curvature_samples stands for a subsampling not known yet."
        )
    if options.subsampling is not None:
        return len(check_subsampling(options.subsampling, batch_size))
    if num_curvature_samples is None:
        return batch_size
    check_positive_int(num_curvature_samples, "num_curvature_samples")
    if num_curvature_samples > batch_size:
        raise InvalidArgumentError(
            f"num_curvature_samples={num_curvature_samples} exceeds the "
            f"batch_size={batch_size}: the curvature samples are a subset of "
            "the mini-batch; pass at most batch_size (or None for all)."
        )
    return num_curvature_samples
