"""A mini-batch in chunks of samples: the backward pass one chunk at a time.

``LowRankGGN(..., chunk_size=B)`` runs the engine on consecutive chunks of at most
``B`` samples and combines them like the batches of a data loader
(:mod:`vivit.sources.blocks`, ``docs/math.rst``, "Data sets and processes"):
each chunk's columns of ``V`` are rescaled from the loss on the chunk to the loss
on the whole mini-batch, so the result is the curvature of the unchunked batch.
The backward pass (and the forward pass's activations) then hold one chunk at a
time; the kept factors and the Gram matrix are those of all samples.

A curvature subsampling is mapped to each chunk: its samples that fall into the
chunk, as positions in the chunk, in the subsampling's order. The engines need at
least one curvature sample, so a chunk that holds none runs with its first sample
and hands on its loss and gradients without that sample's columns
(:func:`run_chunk`). The rows of the combined ``V`` come chunk by chunk;
:func:`~vivit.sources.blocks.merged_chunks` concatenates each parameter's chunks
into one set of factors (so that the Gram matrix and the products run as on the
whole batch), drops the empty ones and puts the rows back into the subsampling's
order where it does not visit the chunks in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.nn import CrossEntropyLoss, Module, Parameter

from vivit.engines.base import (
    BatchInfo,
    ContributionSink,
    CurvatureRequest,
    Engine,
    EngineOutput,
    ParamContribution,
)
from vivit.errors import InvalidTargetsError
from vivit.losses import LossNormalization
from vivit.model_inputs import ModelInputs, num_samples, take_samples


@dataclass(frozen=True)
class SampleChunk:
    """Consecutive samples of a mini-batch that one engine run computes.

    Attributes:
        batch: ``(inputs, targets)`` of the chunk (views of the mini-batch's).
        subsampling: The engine's curvature subsampling, positions in the chunk
            (``None``: all of them).
        samples: The chunk's positions in the mini-batch (``None``: the whole
            mini-batch, not chunked).
        has_curvature: Whether any sample of the chunk is a curvature sample;
            without one, ``subsampling`` is ``[0]`` and the chunk's columns of
            ``V`` are dropped (:func:`run_chunk`).
    """

    batch: tuple[ModelInputs, Tensor]
    subsampling: list[int] | None
    samples: range | None = None
    has_curvature: bool = True


def run_chunk(
    engine: Engine,
    model: Module,
    loss_func: Module,
    chunk: SampleChunk,
    request: CurvatureRequest,
    sink: ContributionSink,
    combined: bool = True,
) -> EngineOutput:
    """Run the engine on one chunk (its request's subsampling is the chunk's).

    A block whose every target is ignored under a mean cross-entropy has the
    loss ``0/0`` on its own, but carries no weight in the loss on all samples
    (``docs/math.rst``, "Data sets and processes"): it runs with the summed loss
    (``0``, its Hessian roots ``0``) and is handed on with sample weights ``0``,
    so that it contributes zero columns of ``V``, zero loss and zero gradient,
    and the union's ``R`` comes from the other blocks
    (:class:`~vivit.sources.blocks.UnionOutput` refuses a union without weight).

    Args:
        engine: The engine.
        model: The network.
        loss_func: The loss module.
        chunk: The samples.
        request: The chunk's request.
        sink: The group pipeline's sink; a chunk without curvature samples hands
            on each contribution without its columns of ``V``.
        combined: Whether the block is combined with others (chunks, a loader's
            batches, ranks' shards); a lone mini-batch whose every target is
            ignored is refused by the loss as it is.

    Returns:
        The chunk's loss and gradient (of the loss on the chunk alone).

    Raises:
        InvalidTargetsError: For malformed targets of a chunk, naming its samples.
    """
    if not chunk.has_curvature:
        sink = _WithoutCurvature(sink)
    loss_func, weightless = block_loss(loss_func, chunk.batch[1], combined)
    if weightless:
        sink = _Weightless(sink)
    try:
        return engine.run(model, loss_func, chunk.batch, request, sink)
    except InvalidTargetsError as error:
        if chunk.samples is None:
            raise
        raise InvalidTargetsError(
            f"Chunk of samples {chunk.samples.start} to {chunk.samples.stop - 1} "
            f"(positions count from the chunk's first sample): {error}"
        ) from None


def is_combined(single_batch: bool, chunk: SampleChunk, grouped: bool) -> bool:
    """Whether a chunk's loss is combined with other blocks' (``block_loss``).

    Args:
        single_batch: The data is one mini-batch (not a loader's batches).
        chunk: The chunk of that batch.
        grouped: The process is a rank of a group (its shard is combined with
            the other ranks').

    Returns:
        ``False`` only for a lone mini-batch run whole, whose loss is the union's.
    """
    return not single_batch or chunk.samples is not None or grouped


def block_loss(
    loss_func: Module, targets: Tensor, combined: bool
) -> tuple[Module, bool]:
    """The loss a block of samples runs with, and whether it carries no weight.

    A block combined with others whose every target a mean cross-entropy
    ignores runs with the summed loss (:func:`run_chunk`); its samples then
    count with weight ``0`` (:func:`weightless`).

    Args:
        loss_func: The loss module.
        targets: The block's targets.
        combined: Whether the block is combined with others.

    Returns:
        The loss module to run and whether the block carries no weight.
    """
    if combined and _every_target_ignored(loss_func, targets):
        return _summed(loss_func), True
    return loss_func, False


def weightless(batch: BatchInfo) -> BatchInfo:
    """A block's batch context with sample weights ``0`` under a mean.

    Args:
        batch: The context the summed loss gave.

    Returns:
        The context of samples that carry no weight in the union's ``R``.
    """
    weights = (0.0,) * batch.batch_size
    return dataclasses.replace(batch, normalization=LossNormalization("mean", weights))


def _every_target_ignored(loss_func: Module, targets: Tensor) -> bool:
    """Whether a mean cross-entropy ignores every target of a block."""
    return (
        isinstance(loss_func, CrossEntropyLoss)
        and loss_func.reduction == "mean"
        and not targets.is_floating_point()
        and bool((targets == loss_func.ignore_index).all())
    )


def _summed(loss_func: CrossEntropyLoss) -> CrossEntropyLoss:
    """The same cross-entropy with reduction ``"sum"`` (defined on any block)."""
    return CrossEntropyLoss(
        weight=loss_func.weight,
        ignore_index=loss_func.ignore_index,
        reduction="sum",
        label_smoothing=loss_func.label_smoothing,
    )


class _Weightless:
    """Passes contributions on as those of samples of weight ``0`` (mean)."""

    def __init__(self, sink: ContributionSink):
        self._sink = sink

    def add(self, param: Parameter, contribution: ParamContribution) -> None:
        batch = weightless(contribution.batch)
        self._sink.add(param, dataclasses.replace(contribution, batch=batch))


class _WithoutCurvature:
    """Passes contributions on with no columns of ``V`` (no curvature samples)."""

    def __init__(self, sink: ContributionSink):
        self._sink = sink

    def add(self, param: Parameter, contribution: ParamContribution) -> None:
        batch = dataclasses.replace(contribution.batch, ggn_samples=())
        ggn = contribution.ggn.select([])
        self._sink.add(param, dataclasses.replace(contribution, ggn=ggn, batch=batch))


def split_batch(
    batch: tuple[ModelInputs, Tensor],
    chunk_size: int | None,
    subsampling: Sequence[int] | None = None,
) -> list[SampleChunk]:
    """Consecutive chunks of at most ``chunk_size`` samples, in sample order.

    Args:
        batch: ``(inputs, targets)`` of the mini-batch (checked).
        chunk_size: Most samples per chunk; ``None``: one chunk, the whole batch.
        subsampling: The mini-batch's curvature subsampling (checked; ``None``:
            every sample).

    Returns:
        The chunks, each with its part of the subsampling.
    """
    inputs, targets = batch
    size = num_samples(inputs)
    if chunk_size is None or chunk_size >= size:
        return [SampleChunk(batch, None if subsampling is None else list(subsampling))]
    chunks = []
    for start in range(0, size, chunk_size):
        stop = min(start + chunk_size, size)
        part = (take_samples(inputs, slice(start, stop)), targets[start:stop])
        samples = range(start, stop)
        if subsampling is None:
            chunks.append(SampleChunk(part, None, samples))
            continue
        local = [n - start for n in subsampling if start <= n < stop]
        chunks.append(SampleChunk(part, local or [0], samples, bool(local)))
    return chunks
