"""Samples in blocks: one mini-batch, or the batches of a data loader.

An engine computes the curvature of one block of samples at a time, with the
loss on that block alone. :func:`combine_blocks` turns the blocks' results into
those of the loss on all samples together: the GGN's columns are rescaled and
stacked (:func:`vivit.groups.concatenate_curvatures`), the losses and gradients
summed with the weights ``R_union / R_block`` (``docs/math.rst``, "Data sets and
processes").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Module

from vivit._validation import check_batch, check_inputs_match
from vivit.engines.base import ContributionSink, EngineOutput
from vivit.errors import InvalidArgumentError, VivitError
from vivit.groups import GroupCurvature, concatenate_curvatures, union_batch

#: Runs an engine on one block of samples into a sink.
BlockRun = Callable[[ContributionSink], EngineOutput]


@dataclass
class BlockResult:
    """What an engine leaves for one block of samples.

    Attributes:
        curvature: Every group's curvature, in group order, factors kept.
        output: The block's loss and gradient (of the loss on the block alone).
    """

    curvature: list[GroupCurvature]
    output: EngineOutput


def is_batch(data: object) -> bool:
    """Whether ``data`` is one mini-batch rather than an iterable of batches.

    Args:
        data: What the caller passed as data.

    Returns:
        ``True`` for a tensor, or a tuple or list with a tensor in it: a
        mini-batch, possibly malformed (:func:`~vivit._validation.check_batch`
        says how). A loader's items are batches, not tensors.
    """
    return isinstance(data, Tensor) or (
        isinstance(data, tuple | list) and any(isinstance(t, Tensor) for t in data)
    )


def iterate_batches(data: object, model: Module) -> Iterator[tuple[Tensor, Tensor]]:
    """The batches of a data loader, each checked like a mini-batch.

    Args:
        data: An iterable of ``(inputs, targets)`` batches (e.g. a ``DataLoader``).
        model: The network (its parameters give the expected dtype and device).

    Yields:
        ``(inputs, targets)`` of every batch.

    Raises:
        InvalidArgumentError: If ``data`` is neither a mini-batch nor an iterable of
            them, or a batch is malformed (the message names the batch).
    """
    if isinstance(data, Tensor | str | bytes) or not isinstance(data, Iterable):
        raise InvalidArgumentError(
            "data must be a pair (inputs, targets) of tensors or an iterable of such "
            f"batches (e.g. a DataLoader), got {type(data).__name__}."
        )
    params = list(model.parameters())
    for index, batch in enumerate(data):
        with naming_batch(index):
            batch = check_batch(batch)
            check_inputs_match(batch[0], params)
        yield batch


@contextmanager
def naming_batch(index: int) -> Iterator[None]:
    """Prefix the message of a library error with the loader's batch it concerns.

    Args:
        index: Position of the batch in the loader.

    Raises:
        VivitError: The error raised inside, of the same type, its message
            starting with ``"Batch {index} of the data loader: "``.
    """
    try:
        yield
    except VivitError as error:
        raise type(error)(f"Batch {index} of the data loader: {error}") from None


def base_seed(generator: torch.Generator | None) -> int:
    """One draw from ``generator`` that seeds the MC streams of every block.

    Args:
        generator: The caller's generator; ``None`` draws from torch's default
            generator (the caller forks the random state around the run).

    Returns:
        A seed in ``[0, 2⁶²)``; advances ``generator`` by one draw.
    """
    device = "cpu" if generator is None else generator.device
    return int(torch.randint(0, 2**62, (), generator=generator, device=device))


def block_generator(
    seed: int, block: int, device: torch.device | str
) -> torch.Generator:
    """The generator of the Monte-Carlo samples of one block of samples.

    Block ``b`` (a loader's ``b``-th batch; the shard of rank ``b``) draws from a
    generator seeded with ``seed + b``: its samples do not depend on how many
    draws other blocks made, so a process group's shards and a loader over the
    same shards in rank order draw the same samples (``docs/math.rst``, "Data
    sets and processes").

    Args:
        seed: The run's base seed (:func:`base_seed`).
        block: Index of the block.
        device: Device the samples are drawn on (the model output's).

    Returns:
        A fresh generator.
    """
    return torch.Generator(device=device).manual_seed((seed + block) % 2**63)


def combine_blocks(
    blocks: list[BlockResult],
) -> tuple[list[GroupCurvature], Tensor, list[Tensor]]:
    """The curvature, loss and gradient of all blocks' samples together.

    Args:
        blocks: Every block's result, in sample order.

    Returns:
        Each group's curvature on the union, the loss and the gradient of every
        requested parameter (as :class:`~vivit.engines.base.EngineOutput` has it).
    """
    curvature = [
        concatenate_curvatures([block.curvature[g] for block in blocks])
        for g in range(len(blocks[0].curvature))
    ]
    if len(blocks) == 1:
        output = blocks[0].output
        return curvature, output.loss, output.gradients
    batches = [block.curvature[0].batch for block in blocks]
    union = union_batch(batches).reduction_factor()
    weights = [union / batch.reduction_factor() for batch in batches]
    loss = sum(w * block.output.loss for w, block in zip(weights, blocks, strict=True))
    gradients = [
        sum(w * g for w, g in zip(weights, column, strict=True))
        for column in zip(*(block.output.gradients for block in blocks), strict=True)
    ]
    return curvature, loss, gradients
