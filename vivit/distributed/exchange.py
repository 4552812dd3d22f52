"""The rounds of collectives of one construction across the ranks of a group."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from vivit.distributed.agreement import (
    RankFailure,
    check_requests,
    check_sample_shapes,
    gather_objects,
    raise_failures,
)
from vivit.distributed.gram import sharded_gram
from vivit.distributed.layout import ExchangeReport
from vivit.distributed.packing import Packer, pack_shard, unpack_shard
from vivit.engines.base import BatchInfo
from vivit.errors import DistributedError
from vivit.gram import ParamFactors
from vivit.sources.runs import PartResult

Item = TypeVar("Item")
Decision = TypeVar("Decision")


class ShardExchange:
    """One construction's agreement and exchange across the ranks of a group.

    A context manager: an exception that leaves it before this rank's three
    rounds (route, request, shard) is sent to the others in the round they wait
    in, so every rank raises. ``group=None``: every method passes its input on.
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.report = ExchangeReport(world_size=self.world_size)
        self._rounds_left = 0 if group is None else 3

    def __enter__(self) -> ShardExchange:
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if exc is not None and self._rounds_left:
            self._rounds_left = 0
            self._all_gather_object(RankFailure.of(self.rank, exc))
        return False

    def _all_gather_object(self, item: object) -> list[object]:
        start = time.perf_counter()
        try:
            gathered = gather_objects(self.group, item, self.report)
        except BaseException:  # the group is broken: no further round
            self._rounds_left = 0
            raise
        self.report.seconds += time.perf_counter() - start
        return gathered

    def _round(self, item: object) -> list[object]:
        """One agreement round: every rank's item, or raise if a rank failed."""
        self._rounds_left -= 1
        gathered = self._all_gather_object(item)
        self._last_if_raises(raise_failures, gathered, self.world_size)
        return gathered

    def _last_if_raises(
        self, check: Callable[..., Decision], *args: object
    ) -> Decision:
        """Run an agreement check; if it raises (on every rank), no round follows."""
        try:
            return check(*args)
        except DistributedError:
            self._rounds_left = 0
            raise

    def _shard_round(self, item: tuple, sample_shape: tuple | None) -> list[tuple]:
        """The shard round: every rank's item; refused if the targets' shapes differ."""
        gathered = self._round((*item, sample_shape))
        check_sample_shapes([shape for *_, shape in gathered])
        return [message[:-1] for message in gathered]

    def decide(self, item: Item, rule: Callable[[list[Item]], Decision]) -> Decision:
        """The route round: ``rule`` of every rank's item (rank order), on every rank.

        Raises:
            DistributedError: On every rank, if a rank failed or ``rule`` refuses.
        """
        if self.group is None:
            return rule([item])
        return self._last_if_raises(rule, self._round(item))

    def agree(self, fingerprint: dict[str, object], seed: int | None) -> int | None:
        """The request round: every rank asks for the same; rank 0's MC ``seed``.

        Raises:
            DistributedError: On every rank, if a rank failed or the requests differ.
        """
        if self.group is None:
            return seed
        gathered = self._round((fingerprint, seed))
        self._last_if_raises(check_requests, [request for request, _ in gathered])
        return gathered[0][1]

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Element-wise: whether every rank's flag is true (one small collective)."""
        if self.group is None:
            return flags
        gathered = self._all_gather_object(flags)
        return [all(column) for column in zip(*gathered, strict=True)]

    def gram(self, factors: Sequence[ParamFactors]) -> Tensor:
        """A group's Gram matrix of the union, formed together (``sharded_gram``)."""
        start = time.perf_counter()
        gram, buffer_bytes = sharded_gram(factors, self.group)
        self.report.gram_buffer_bytes += buffer_bytes
        self.report.gram_seconds += time.perf_counter() - start
        return gram

    def exchange(
        self,
        blocks: list[PartResult],
        param_groups: list[list[Tensor]],
        sample_shape: tuple[int, ...] | None = None,
    ) -> list[PartResult]:
        """The shard round and the data: every rank's block (rank order), rebuilt.

        ``blocks`` holds exactly this rank's one (its shard's parts merged).

        Raises:
            DistributedError: If another rank failed before the exchange, or
                the ranks' targets differ in shape per sample (on every rank).
        """
        if self.group is None:
            return blocks
        (block,) = blocks
        start, before = time.perf_counter(), self.report.seconds
        packer = Packer()
        description = pack_shard(block, packer)
        gathered = self._shard_round(
            (description, packer.size, packer.payload), sample_shape
        )
        size = max(size for _, size, _ in gathered)
        buffer = torch.zeros(size, dtype=torch.uint8, device=block.output.loss.device)
        packer.fill(buffer)
        buffers = [torch.empty_like(buffer) for _ in range(self.world_size)]
        dist.all_gather(buffers, buffer, group=self.group)
        rebuilt = [
            unpack_shard(desc, data, param_groups)
            for (desc, *_), data in zip(gathered, buffers, strict=True)
        ]
        self.report.payload_bytes = [payload for *_, payload in gathered]
        self.report.buffer_bytes = size
        # the whole exchange, the shard round (which timed itself) included
        self.report.seconds = before + time.perf_counter() - start
        return rebuilt

    def shard_contexts(
        self, batch: BatchInfo, loss: Tensor, sample_shape: tuple[int, ...] | None
    ) -> list[tuple[BatchInfo, Tensor]]:
        """The implicit route's shard round: every rank's batch context and loss.

        Raises:
            DistributedError: As :meth:`exchange`.
        """
        if self.group is None:
            return [(batch, loss)]
        gathered = self._shard_round((batch, loss.detach().cpu()), sample_shape)
        return [(context, value.to(loss.device)) for context, value in gathered]
