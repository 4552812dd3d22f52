"""The rounds of collectives of one construction across the ranks of a group.

:class:`ShardExchange` runs them in order (the protocol is in
:mod:`vivit.distributed`) and times and counts them; what is compared, packed
and formed in each round is up to :mod:`~vivit.distributed.agreement`,
:mod:`~vivit.distributed.packing` and :mod:`~vivit.distributed.gram`.
"""

from __future__ import annotations

import pickle
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

    Use as a context manager around everything a rank does before the exchange:
    an exception that leaves it before this rank has taken part in the three
    rounds (route, request, block) is reported to the other ranks in the round
    they wait in (and re-raised here), so that every rank raises instead of
    waiting.

    Args:
        group: The process group, or ``None`` to run locally (every method then
            passes its input through).
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
        gathered: list[object] = [None] * self.world_size
        start = time.perf_counter()
        try:
            dist.all_gather_object(gathered, item, group=self.group)
        except BaseException:  # the group is broken: no further round
            self._rounds_left = 0
            raise
        self.report.metadata_bytes += len(pickle.dumps(item))
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

    def decide(self, item: Item, rule: Callable[[list[Item]], Decision]) -> Decision:
        """The route round: one decision from every rank's item, the same on all.

        Args:
            item: This rank's item (picklable).
            rule: Decides from every rank's item, in rank order (raising a
                :class:`~vivit.errors.DistributedError` raises on every rank).

        Returns:
            The decision (``rule([item])`` locally).

        Raises:
            DistributedError: On every rank, if a rank failed before the round
                or the rule refuses the items.
        """
        if self.group is None:
            return rule([item])
        return self._last_if_raises(rule, self._round(item))

    def agree(self, fingerprint: dict[str, object], seed: int | None) -> int | None:
        """Check that every rank asks for the same; the run's MC seed (rank 0's).

        Args:
            fingerprint: This rank's request
                (:func:`~vivit.distributed.agreement.request_fingerprint`).
            seed: This rank's Monte-Carlo base seed (``None`` for the exact GGN).

        Returns:
            Rank 0's seed.

        Raises:
            DistributedError: On every rank, if a rank failed before the backward
                pass or the requests differ (naming the ranks and options).
        """
        if self.group is None:
            return seed
        gathered = self._round((fingerprint, seed))
        self._last_if_raises(check_requests, [request for request, _ in gathered])
        return gathered[0][1]

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Element-wise: whether every rank's flag is true (one small collective).

        Args:
            flags: This rank's flags.

        Returns:
            The flags of all ranks, combined with ``and``.
        """
        if self.group is None:
            return flags
        gathered = self._all_gather_object(flags)
        return [all(column) for column in zip(*gathered, strict=True)]

    def gram(self, factors: Sequence[ParamFactors]) -> Tensor:
        """A group's Gram matrix of the union, each rank forming its share.

        See :func:`~vivit.distributed.gram.sharded_gram` (a collective: every
        rank calls it for the same groups in the same order).

        Args:
            factors: The group's factors of ``V`` over the union, one
                :class:`~vivit.gram.StackedFactors` per parameter with one
                block per rank.

        Returns:
            ``[N·C, N·C]``, identical on every rank.
        """
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
        """Every rank's block, in rank order, rebuilt from the exchanged bytes.

        Args:
            blocks: This rank's block (exactly one: its shard, or all its
                loader's batches combined).
            param_groups: The parameter groups, to attach to the rebuilt curvature.
            sample_shape: The shape per sample of this rank's targets, compared
                across the ranks in the shard round.

        Returns:
            One block per rank, identical on every rank.

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
        gathered = self._round((description, packer.size, packer.payload, sample_shape))
        check_sample_shapes([shape for *_, shape in gathered])
        size = max(size for _, size, _, _ in gathered)
        buffers = self._all_gather_bytes(packer, size, block.output.loss.device)
        rebuilt = [
            unpack_shard(desc, data, param_groups)
            for (desc, *_), data in zip(gathered, buffers, strict=True)
        ]
        self.report.payload_bytes = [payload for _, _, payload, _ in gathered]
        self.report.buffer_bytes = size
        # the whole exchange, the shard round (which timed itself) included
        self.report.seconds = before + time.perf_counter() - start
        return rebuilt

    def shard_contexts(
        self, batch: BatchInfo, loss: Tensor, sample_shape: tuple[int, ...] | None
    ) -> list[tuple[BatchInfo, Tensor]]:
        """The implicit route's shard round: every rank's batch context and loss.

        The implicit route keeps no factors: every rank's sample weights (its
        ``R``) and GGN samples and the loss on its shard are all it exchanges
        at construction (its gradient is summed after this round).

        Args:
            batch: This rank's shard's batch context (GGN samples in its
                subsampling's order).
            loss: The loss on this rank's shard.
            sample_shape: The shape per sample of this rank's targets.

        Returns:
            Every rank's context and loss, in rank order.

        Raises:
            DistributedError: If another rank failed before this round, or the
                ranks' targets differ in shape per sample (on every rank).
        """
        if self.group is None:
            return [(batch, loss)]
        start, before = time.perf_counter(), self.report.seconds
        gathered = self._round((batch, loss.detach().cpu(), sample_shape))
        check_sample_shapes([shape for *_, shape in gathered])
        self.report.seconds = before + time.perf_counter() - start
        return [(context, value.to(loss.device)) for context, value, _ in gathered]

    def _all_gather_bytes(
        self, packer: Packer, size: int, device: torch.device
    ) -> list[Tensor]:
        """Every rank's packed tensors, each in a byte buffer of ``size``."""
        buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        packer.fill(buffer)
        buffers = [torch.empty_like(buffer) for _ in range(self.world_size)]
        dist.all_gather(buffers, buffer, group=self.group)
        return buffers
