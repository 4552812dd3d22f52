"""Parts of the samples (batches, chunks, shards) combined into their union's curvature.

Rescalings and Monte-Carlo streams: ``docs/math.rst``, "Data sets and processes".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vivit.engines.base import BatchInfo, CurvatureRequest, EngineOutput
from vivit.errors import InvalidArgumentError, InvalidTargetsError
from vivit.gram import DenseFactors, OuterProductFactors, ParamFactors, StackedFactors
from vivit.losses import LossNormalization
from vivit.sources.collector import GroupCurvature


def part_scales(union: BatchInfo, batches: Sequence[BatchInfo]) -> list[float]:
    """``√(R_union / R_b)`` of every block: rescales its ``V`` (``1`` if ``R_b=0``)."""
    return [
        math.sqrt(union.ggn_reduction_factor / b.ggn_reduction_factor)
        if b.ggn_reduction_factor > 0
        else 1.0
        for b in batches
    ]


def union_batch(batches: Sequence[BatchInfo]) -> BatchInfo:
    """The batch context of blocks' samples (same reduction, columns, MC) in order."""
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


def _concatenated(parts: Sequence[GroupCurvature]) -> GroupCurvature:
    """One group's curvature on the union of blocks: ``V`` rescaled, all stacked."""
    first = parts[0]
    if len(parts) == 1:
        return first
    kinds = {
        (p.batch.reduction, p.batch.columns_per_sample, p.batch.mc_samples)
        for p in parts
    }
    if len(kinds) > 1:
        raise ValueError(
            "Sample blocks disagree in reduction, columns per sample or MC "
            "samples; every block must use the same loss function and request."
        )
    batch = union_batch([part.batch for part in parts])
    scales = part_scales(batch, [part.batch for part in parts])
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
    """Each group's curvature on all blocks (each a list per group) together."""
    return [
        _concatenated([block[g] for block in blocks]) for g in range(len(blocks[0]))
    ]


def merged_parts(
    blocks: list[list[GroupCurvature]], subsampling: Sequence[int] | None
) -> list[GroupCurvature]:
    """Every group's curvature on one process's blocks (emptied), one set of factors."""
    combined = combine_curvatures(blocks)
    several = len(blocks) > 1
    blocks.clear()
    if not several:
        return combined
    return [merged_chunks(c, subsampling) for c in combined]


def merged_chunks(
    curvature: GroupCurvature, subsampling: Sequence[int] | None
) -> GroupCurvature:
    """A group's curvature over chunks as if computed in one piece (lists in place)."""
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
    if all(type(block) is kind for block in blocks):
        if kind is OuterProductFactors:
            return OuterProductFactors.concatenate(blocks, scales, inputs_cache)
        if kind is DenseFactors:
            return DenseFactors.concatenate(blocks, scales)
    return StackedFactors(blocks, scales)


class UnionOutput:
    """The loss and gradient on all samples, ``Σ_b (R_union / R_b) L_b`` (one sum)."""

    def __init__(self) -> None:
        self.batches: list[BatchInfo] = []
        self._first: EngineOutput | None = None
        self._sum: EngineOutput | None = None

    def add(self, batch: BatchInfo, output: EngineOutput) -> None:
        """Add a block's loss and gradient (of the loss on the block alone)."""
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
        """The loss and gradient on all samples (``part``: of a rank's shard).

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
    """``index ↦`` the request of part ``index``: its own MC stream (exact: as is).

    The base seed is drawn once, so every pass draws the same samples; ``agree``
    maps it (``None`` for the exact GGN) to the one all ranks use (a collective).
    """
    seed = base_seed(request.generator) if request.mc_samples else None
    if agree is not None:
        seed = agree(seed)
    if request.mc_samples == 0:
        return lambda index: request
    device = request.params[0].device
    return lambda index: dataclasses.replace(
        request, generator=part_generator(seed, index, device)
    )


def base_seed(generator: torch.Generator | None) -> int:
    """A seed in ``[0, 2⁶²)`` for every block's MC stream: one draw of ``generator``.

    ``None`` draws from torch's default generator, advancing it like any sampling.
    """
    device = "cpu" if generator is None else generator.device
    return int(torch.randint(0, 2**62, (), generator=generator, device=device))


def part_generator(
    seed: int, block: int, device: torch.device | str
) -> torch.Generator:
    """A fresh generator of block ``block``'s MC samples, seeded ``seed + block``."""
    return torch.Generator(device=device).manual_seed((seed + block) % 2**63)


def add_into(total: list[Tensor], terms: Sequence[Tensor]) -> None:
    """Add ``terms`` to ``total`` in place (an empty ``total`` takes them)."""
    if not total:
        total.extend(terms)
        return
    for kept, term in zip(total, terms, strict=True):
        kept.add_(term)


def per_group(
    flat: list[Tensor], param_groups: Sequence[Sequence]
) -> list[list[Tensor]]:
    """Tensors of every parameter, in group order, split into one list per group."""
    tensors = iter(flat)
    return [[next(tensors) for _ in group] for group in param_groups]
