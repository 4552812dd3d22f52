"""Parts of the samples combined into the curvature of their union.

A part of the samples is a loader's batch, a chunk of a mini-batch, or a rank's
shard. An engine computes each with the loss on that block alone; this module
turns the blocks' results into those of the loss on all samples together
(``docs/math.rst``, "Data sets and processes"):

- the GGN's columns are rescaled by ``√(R_union / R_block)`` (:func:`part_scale`)
  and stacked (:func:`concatenate_curvatures`), then merged into one set of
  factors per parameter (:func:`merged_parts`);
- losses and gradients are summed with the weights ``R_union / R_block``
  (:class:`UnionOutput`);
- Monte-Carlo samples are drawn per block from streams ``seed + b``
  (:func:`part_requests`), so a block's draws do not depend on the others.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vivit.engines.base import BatchInfo, CurvatureRequest, EngineOutput
from vivit.errors import InvalidArgumentError, InvalidTargetsError
from vivit.gram import (
    DenseFactors,
    OuterProductFactors,
    ParamFactors,
    StackedFactors,
)
from vivit.losses import LossNormalization
from vivit.sources.collector import GroupCurvature


def part_scale(union_factor: float, block_factor: float) -> float:
    """``√(R_union / R_block)``: rescales a block's ``V`` (or ``1`` if ``R_block=0``).

    A block whose ``R`` is ``0`` carries no weight (every target ignored): its
    columns are zero and stay so.
    """
    return math.sqrt(union_factor / block_factor) if block_factor > 0 else 1.0


def union_batch(batches: Sequence[BatchInfo]) -> BatchInfo:
    """The batch context of several blocks' samples together, in block order.

    Args:
        batches: Each block's context (same reduction, columns and MC samples).

    Returns:
        Sample weights concatenated; the GGN samples shifted by each block's offset.
    """
    weights: list[float] = []
    ggn_samples: list[int] = []
    for batch in batches:
        ggn_samples.extend(len(weights) + n for n in batch.ggn_samples)
        weights.extend(batch.normalization.sample_weights)
    first = batches[0]
    return BatchInfo(
        normalization=LossNormalization(first.reduction, tuple(weights)),
        ggn_samples=tuple(ggn_samples),
        columns_per_sample=first.columns_per_sample,
        mc_samples=first.mc_samples,
    )


def concatenate_curvatures(parts: Sequence[GroupCurvature]) -> GroupCurvature:
    """One group's curvature on the union of several parts of the samples.

    The blocks (batches of a loader, shards of processes) were computed each with
    the loss on its own samples; their columns of ``V`` are rescaled from the
    block's ``√R`` to that of the loss on all samples together, and stacked in
    block order (``docs/math.rst``, "Data sets and processes"). Per-sample
    gradients ``∇ℓ_n`` do not depend on ``R`` and are stacked as they are.

    Args:
        parts: The group's curvature of every block, in sample order, each with
            its factors kept; the same reduction, columns per sample and MC
            samples in all.

    Returns:
        The group's curvature on the union, its Gram matrix not formed.

    Raises:
        ValueError: If the blocks disagree in reduction, columns or MC samples.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    for part in parts[1:]:
        if (part.batch.reduction, part.batch.columns_per_sample) != (
            first.batch.reduction,
            first.batch.columns_per_sample,
        ) or part.batch.mc_samples != first.batch.mc_samples:
            raise ValueError(
                "Sample blocks disagree in reduction, columns per sample or MC "
                "samples; every block must use the same loss function and request."
            )
    batch = union_batch([part.batch for part in parts])
    scales = [
        part_scale(batch.ggn_reduction_factor, part.batch.ggn_reduction_factor)
        for part in parts
    ]
    ggn_factors = [
        StackedFactors(column, scales)
        for column in zip(*(part.ggn_factors for part in parts), strict=True)
    ]
    curvature = GroupCurvature(
        params=first.params,
        batch=batch,
        factor_dtype=first.factor_dtype,
        gram=None,
        ggn_factors=ggn_factors,
    )
    if first.grad_factors is not None:
        curvature.grad_factors = [
            StackedFactors(column)
            for column in zip(*(part.grad_factors for part in parts), strict=True)
        ]
    return curvature


def combine_curvatures(blocks: list[list[GroupCurvature]]) -> list[GroupCurvature]:
    """Each group's curvature on all blocks' samples together.

    Args:
        blocks: Every block's curvature (one per group), in sample order.

    Returns:
        Each group's curvature on the union
        (:func:`concatenate_curvatures`).
    """
    return [
        concatenate_curvatures([block[g] for block in blocks])
        for g in range(len(blocks[0]))
    ]


def merged_parts(
    blocks: list[list[GroupCurvature]], subsampling: Sequence[int] | None
) -> list[GroupCurvature]:
    """Every group's curvature on one process's blocks, one set of factors each.

    The blocks (a loader's batches, the chunks of a batch) are combined
    (:func:`combine_curvatures`: rescaled to the union's ``√R``) and
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
    """One set of factors for the non-empty parts of the samples (a copy)."""
    if not isinstance(factors, StackedFactors):
        return factors
    kept = [
        (block, scale)
        for block, scale in zip(factors.blocks, factors.scales, strict=True)
        if block.num_samples > 0
    ]
    blocks, scales = [b for b, _ in kept], [s for _, s in kept]
    kind = type(blocks[0])
    if len(blocks) == 1:
        return blocks[0] if scales[0] == 1.0 else blocks[0].scaled(scales[0])
    if not all(type(block) is kind for block in blocks):
        return StackedFactors(blocks, scales)
    if kind is OuterProductFactors:
        return OuterProductFactors.concatenate(blocks, scales, inputs_cache)
    if kind is DenseFactors:
        return DenseFactors.concatenate(blocks, scales)
    return StackedFactors(blocks, scales)


class UnionOutput:
    """The loss and gradient on all samples, accumulated block by block.

    Each block's loss ``L_b = R_b Σ_{n∈b} ℓ_n`` enters as ``L_b / R_b``; the sum
    times ``R_union`` is the loss on all samples, ``Σ_b (R_union / R_b) L_b``
    (``docs/math.rst``, "Data sets and processes"); likewise the gradient. Holds
    one loss and one gradient, whatever the number of blocks.
    """

    def __init__(self) -> None:
        self.batches: list[BatchInfo] = []
        self._first: EngineOutput | None = None
        self._sum: EngineOutput | None = None

    def add(self, batch: BatchInfo, output: EngineOutput) -> None:
        """Add a block's loss and gradient.

        Args:
            batch: The block's batch context (its ``R_b`` and sample weights).
            output: Its loss and gradient (of the loss on the block alone).
        """
        self.batches.append(batch)
        if self._first is None:  # one block's are used as they are: no sum yet
            self._first = output
            return
        if self._sum is None:
            self._sum = _unnormalized(self._first, self.batches[0])
        term = _unnormalized(output, batch)
        self._sum = EngineOutput(
            self._sum.loss + term.loss,
            [a + b for a, b in zip(self._sum.gradients, term.gradients, strict=True)],
        )

    def result(self, part: bool = False) -> tuple[Tensor, list[Tensor]]:
        """The loss and gradient on all samples (one block's as they are).

        Args:
            part: The samples are part of a larger union (a rank's shard), which
                may carry the weight these samples lack.

        Raises:
            InvalidArgumentError: If no block was added.
            InvalidTargetsError: If the samples carry no weight under a mean
                (every target ignored) and are not ``part`` of a larger union.
        """
        if self._first is None:
            raise InvalidArgumentError(
                "The data loader yielded no batch: pass at least one (inputs, "
                "targets) batch."
            )
        union = union_batch(self.batches)
        if not part and union.reduction == "mean" and union.reduction_factor() == 0:
            raise InvalidTargetsError(
                "Every target of every batch (and chunk, and rank's shard) is "
                "ignored (equals the loss's ignore_index): the mean loss on all "
                "samples is 0/0 (NaN) and has no curvature. Pass samples with at "
                "least one counted target."
            )
        if len(self.batches) == 1:
            return self._first.loss, self._first.gradients
        union = union.reduction_factor()
        return union * self._sum.loss, [union * g for g in self._sum.gradients]


def unnormalizing_scale(batch: BatchInfo) -> float:
    """``1 / R_b``, which undoes a block's loss reduction (``0`` for weight ``0``)."""
    factor = batch.reduction_factor()
    return 1.0 / factor if factor > 0 else 0.0


def _unnormalized(output: EngineOutput, batch: BatchInfo) -> EngineOutput:
    """``L_b / R_b`` and ``∇L_b / R_b`` (``0`` for a block of weight ``0``)."""
    scale = unnormalizing_scale(batch)
    return EngineOutput(output.loss * scale, [g * scale for g in output.gradients])


def part_requests(
    request: CurvatureRequest,
    agree: Callable[[int | None], int | None] | None = None,
) -> Callable[[int], CurvatureRequest]:
    """The request of each part of the samples: its own MC stream (exact: as is).

    Draws the base seed (:func:`base_seed`) once: every pass over the blocks
    with the returned requests draws the same samples. Without a generator the
    seed is one draw from torch's global generator, which it advances like any
    sampling operation, so that two requests draw independent samples.

    Args:
        request: The caller's request (its parameters' device is the samples').
        agree: Maps this process's seed (``None`` for the exact GGN) to the one
            all ranks of a process group use (rank 0's); a collective, so every
            rank calls it, MC or not.

    Returns:
        ``index ↦`` the request of block ``index``.
    """
    seed = None
    if request.mc_samples:
        seed = base_seed(request.generator)
    if agree is not None:
        seed = agree(seed)
    if request.mc_samples == 0:
        return lambda index: request
    device = request.params[0].device
    return lambda index: dataclasses.replace(
        request, generator=part_generator(seed, index, device)
    )


def base_seed(generator: torch.Generator | None) -> int:
    """One draw from ``generator`` that seeds the MC streams of every block.

    Args:
        generator: The caller's generator; ``None`` draws from torch's default
            generator.

    Returns:
        A seed in ``[0, 2⁶²)``; advances the generator by one draw.
    """
    device = "cpu" if generator is None else generator.device
    return int(torch.randint(0, 2**62, (), generator=generator, device=device))


def part_generator(
    seed: int, block: int, device: torch.device | str
) -> torch.Generator:
    """The generator of the Monte-Carlo samples of one part of the samples.

    Block ``b`` (a loader's ``b``-th batch or chunk; under a process group of
    ``W`` ranks, ``b = r + W·i`` for the ``i``-th batch of rank ``r``) draws
    from a generator seeded with ``seed + b``: its samples do not depend on how
    many draws other blocks made, nor on how many batches other ranks have, so
    a process group's shards (one batch per rank: ``b = r``) and a loader over
    the same shards in rank order draw the same samples (``docs/math.rst``,
    "Data sets and processes", "Several processes").

    Args:
        seed: The run's base seed (:func:`base_seed`).
        block: Index of the block.
        device: Device the samples are drawn on (the model output's).

    Returns:
        A fresh generator.
    """
    return torch.Generator(device=device).manual_seed((seed + block) % 2**63)
