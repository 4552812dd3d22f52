"""A mini-batch in chunks of samples: the backward pass one chunk at a time.

``LowRankGGN(..., chunk_size=B)`` runs the engine on consecutive chunks of at most
``B`` samples and combines them like the batches of a data loader
(:func:`vivit.data.combine_blocks`, ``docs/math.rst``, "Data sets and processes"):
each chunk's columns of ``V`` are rescaled from the loss on the chunk to the loss
on the whole mini-batch, so the result is the curvature of the unchunked batch.
The backward pass (and the forward pass's activations) then hold one chunk at a
time; the kept factors and the Gram matrix are those of all samples.

A curvature subsampling is mapped to each chunk: its samples that fall into the
chunk, as positions in the chunk, in the subsampling's order. The engines need at
least one curvature sample, so a chunk that holds none runs with its first sample
and hands on its loss and gradients without that sample's columns
(:func:`run_chunk`). The rows of the combined ``V`` come chunk by chunk;
:func:`merged_chunks` concatenates each parameter's chunks into one set of
factors (so that the Gram matrix and the products run as on the whole batch),
drops the empty ones and puts the rows back into the subsampling's order where it
does not visit the chunks in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.nn import Module, Parameter

from vivit.data import combine_curvatures
from vivit.engines.base import (
    ContributionSink,
    CurvatureRequest,
    Engine,
    EngineOutput,
    ParamContribution,
)
from vivit.errors import InvalidArgumentError, InvalidTargetsError
from vivit.gram import (
    DenseFactors,
    OuterProductFactors,
    ParamFactors,
    SampleBlockFactors,
)
from vivit.groups import GroupCurvature


def check_chunk_size(chunk_size: int | None) -> None:
    """Check that ``chunk_size`` is a positive integer or ``None``.

    Args:
        chunk_size: Most samples per backward pass (``None``: the whole batch).

    Raises:
        InvalidArgumentError: Otherwise.
    """
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise InvalidArgumentError(
            f"chunk_size must be a positive integer or None, got {chunk_size!r}."
        )
    if chunk_size < 1:
        raise InvalidArgumentError(
            f"chunk_size must be a positive integer (samples per backward pass) or "
            f"None for the whole batch, got {chunk_size}."
        )


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

    batch: tuple[Tensor, Tensor]
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
) -> EngineOutput:
    """Run the engine on one chunk (its request's subsampling is the chunk's).

    Args:
        engine: The engine.
        model: The network.
        loss_func: The loss module.
        chunk: The samples.
        request: The chunk's request.
        sink: The group pipeline's sink; a chunk without curvature samples hands
            on each contribution without its columns of ``V``.

    Returns:
        The chunk's loss and gradient (of the loss on the chunk alone).

    Raises:
        InvalidTargetsError: For malformed targets of a chunk, naming its samples;
            if every target of a chunk is ignored (its loss is ``0/0``, though
            the whole batch's need not be), with the advice to use larger chunks.
    """
    if not chunk.has_curvature:
        sink = _WithoutCurvature(sink)
    try:
        return engine.run(model, loss_func, chunk.batch, request, sink)
    except InvalidTargetsError as error:
        if chunk.samples is None:
            raise
        # the loss's own messages call an empty mean 0/0 (vivit.losses)
        advice = (
            " Each chunk is a loss of its own: use a larger chunk_size, or None."
            if "0/0" in str(error)
            else ""
        )
        raise InvalidTargetsError(
            f"Chunk of samples {chunk.samples.start} to {chunk.samples.stop - 1} "
            f"(positions count from the chunk's first sample): {error}{advice}"
        ) from None


class _WithoutCurvature:
    """Passes contributions on with no columns of ``V`` (no curvature samples)."""

    def __init__(self, sink: ContributionSink):
        self._sink = sink

    def add(self, param: Parameter, contribution: ParamContribution) -> None:
        batch = dataclasses.replace(contribution.batch, ggn_samples=())
        ggn = contribution.ggn.select([])
        self._sink.add(param, dataclasses.replace(contribution, ggn=ggn, batch=batch))


def split_batch(
    batch: tuple[Tensor, Tensor],
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
    size = inputs.shape[0]
    if chunk_size is None or chunk_size >= size:
        return [SampleChunk(batch, None if subsampling is None else list(subsampling))]
    chunks = []
    for start in range(0, size, chunk_size):
        stop = min(start + chunk_size, size)
        part, samples = (inputs[start:stop], targets[start:stop]), range(start, stop)
        if subsampling is None:
            chunks.append(SampleChunk(part, None, samples))
            continue
        local = [n - start for n in subsampling if start <= n < stop]
        chunks.append(SampleChunk(part, local or [0], samples, bool(local)))
    return chunks


def merged_blocks(
    blocks: list[list[GroupCurvature]], subsampling: Sequence[int] | None
) -> list[GroupCurvature]:
    """Every group's curvature on one process's blocks, one set of factors each.

    The blocks (a loader's batches, the chunks of a batch) are combined
    (:func:`~vivit.data.combine_curvatures`: rescaled to the union's ``√R``) and
    each parameter's factors merged (:func:`merged_chunks`), so that every later
    product runs as on one batch instead of forming each block's ``V`` once per
    partner block.

    Args:
        blocks: Every block's curvature (one per group), in sample order; the
            list is emptied, so that each block's factors are released as soon
            as they are merged (the peak holds one parameter's copy, not all).
        subsampling: The mini-batch's curvature subsampling (``None``: all, or a
            loader's batches).

    Returns:
        Each group's curvature on the union; one block's as it is.
    """
    combined = combine_curvatures(blocks)
    several = len(blocks) > 1
    blocks.clear()
    if not several:
        return combined
    return [merged_chunks(c, subsampling) for c in combined]


def merged_chunks(
    curvature: GroupCurvature, subsampling: Sequence[int] | None
) -> GroupCurvature:
    """A group's curvature combined over chunks, as if computed in one piece.

    Each parameter's blocks (one per chunk) are concatenated into one set of
    factors, one parameter at a time (a copy of that parameter's factors is alive
    at once; a weight's ``V`` and per-sample gradients keep sharing their
    inputs): products and the Gram matrix then run as on the unchunked batch,
    instead of forming every chunk's ``V`` once per cross-Gram block. Chunks
    without curvature samples are left out, and the rows are put into the
    subsampling's order where it does not visit the chunks in order.

    Args:
        curvature: Combined over the chunks (rows chunk by chunk); its factor
            lists are replaced in place.
        subsampling: The mini-batch's curvature subsampling (``None``: all).

    Returns:
        The curvature with merged factors.
    """
    inputs_cache: list = []  # V and gradients of a weight share their inputs
    for factors in (curvature.ggn_factors, curvature.grad_factors or []):
        for index, blocks in enumerate(factors):
            factors[index] = _merged(blocks, inputs_cache)
    batch = curvature.batch
    order = tuple(batch.ggn_samples)
    if subsampling is None or order == tuple(subsampling):
        return curvature
    position = {n: i for i, n in enumerate(order)}
    rows = [position[n] for n in subsampling]
    return dataclasses.replace(
        curvature,
        batch=dataclasses.replace(batch, ggn_samples=tuple(subsampling)),
        ggn_factors=[f.select(rows) for f in curvature.ggn_factors],
    )


def _merged(factors: ParamFactors, inputs_cache: list) -> ParamFactors:
    """One set of factors for the non-empty blocks of samples (a copy)."""
    if not isinstance(factors, SampleBlockFactors):
        return factors
    blocks = [
        block if scale == 1.0 else block.scaled(scale)
        for block, scale in zip(factors.blocks, factors.scales, strict=True)
        if block.num_samples > 0
    ]
    kind = type(blocks[0])
    if len(blocks) == 1:
        return blocks[0]
    if not all(type(block) is kind for block in blocks):
        return SampleBlockFactors(blocks)
    if kind is OuterProductFactors:
        return OuterProductFactors.concatenate(blocks, inputs_cache)
    if kind is DenseFactors:
        return DenseFactors.concatenate(blocks)
    return SampleBlockFactors(blocks)
