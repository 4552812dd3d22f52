"""One part of the samples through an engine, into each group's curvature."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import Module, Parameter

from vivit._validation import check_finite
from vivit.engines.base import (
    ContributionSink,
    CurvatureRequest,
    Engine,
    EngineOutput,
    ParamContribution,
)
from vivit.errors import InvalidTargetsError, NoCurvatureError
from vivit.options import CurvatureOptions
from vivit.sources.collector import GroupCollector, GroupCurvature
from vivit.sources.data import Part, weightless

#: Runs an engine on one part of the samples into a sink.
PartRun = Callable[[ContributionSink], EngineOutput]


@dataclass
class PartResult:
    """Each group's curvature (factors kept), the part's own loss and gradient."""

    curvature: list[GroupCurvature]
    output: EngineOutput


def curvature_request(
    param_groups: list[list[Parameter]], options: CurvatureOptions, **fields: object
) -> CurvatureRequest:
    """What the engine computes for the options (``fields``: the source's own)."""
    return CurvatureRequest(
        param_groups=param_groups,
        mc_samples=options.mc_samples,
        mc_per=options.mc_per,
        generator=options.generator,
        gram_dtype=options.gram_dtype,
        output=options.output,
        **fields,
    )


def run_part(
    run: PartRun,
    param_groups: list[list[Parameter]],
    gram_dtype: torch.dtype | None,
    keep_gradient_factors: bool = True,
) -> PartResult:
    """One engine run: every group's curvature (factors kept), loss and gradient.

    Raises:
        NonFiniteError: If the loss is not finite.
        NoCurvatureError: If a group received no curvature.
    """
    curvature: dict[int, GroupCurvature] = {}
    collector = GroupCollector(
        param_groups,
        curvature.__setitem__,
        keep_factors=True,
        keep_gradient_factors=keep_gradient_factors,
        gram_dtype=gram_dtype,
        keep_gram=False,
    )
    output = run(collector)
    check_finite(output.loss, "loss", batch_axis=False)
    missing = [g for g in range(len(param_groups)) if g not in curvature]
    if missing:
        raise NoCurvatureError(
            f"Parameter group(s) {missing} received no curvature from the backward "
            f"pass ({collector.num_missing(missing[0])} parameter(s) of group "
            f"{missing[0]} missing): their layers are not part of the loss's "
            "computation graph, or not extended with backpack.extend."
        )
    return PartResult([curvature[g] for g in range(len(curvature))], output)


def run_engine(
    engine: Engine,
    model: Module,
    part: Part,
    request: CurvatureRequest,
    sink: ContributionSink,
) -> EngineOutput:
    """Run the engine on one part (the request's subsampling becomes the part's).

    Raises:
        InvalidTargetsError: For malformed targets of a chunk, naming its samples.
    """
    if not part.has_curvature:
        sink = _Changing(sink, _without_curvature)
    if part.weightless:
        sink = _Changing(sink, _weightless)
    request = dataclasses.replace(request, subsampling=part.subsampling)
    try:
        return engine.run(
            model, part.loss_func, (part.inputs, part.targets), request, sink
        )
    except InvalidTargetsError as error:
        if part.samples is None:
            raise
        raise InvalidTargetsError(
            f"Chunk of samples {part.samples.start} to {part.samples.stop - 1} "
            f"(positions count from the chunk's first sample): {error}"
        ) from None


class _Changing:
    """Passes contributions on, each changed by ``change``."""

    def __init__(self, sink: ContributionSink, change: Callable):
        self._sink, self._change = sink, change

    def add(self, param: Parameter, contribution: ParamContribution) -> None:
        self._sink.add(param, self._change(contribution))


def _without_curvature(contribution: ParamContribution) -> ParamContribution:
    """The contribution with no columns of ``V`` (no curvature samples)."""
    batch = dataclasses.replace(contribution.batch, ggn_samples=())
    ggn = contribution.ggn.select([])
    return dataclasses.replace(contribution, ggn=ggn, batch=batch)


def _weightless(contribution: ParamContribution) -> ParamContribution:
    """The contribution of samples of weight ``0`` (mean)."""
    return dataclasses.replace(contribution, batch=weightless(contribution.batch))
