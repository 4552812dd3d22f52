"""Calls that every rank of a group makes together, in step: the implicit route's.

Each call computes this rank's share; one round compares the calls and reports
failures, then the shares are summed (``all_reduce``) or gathered in rank order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from vivit.distributed.agreement import RankFailure, gather_objects, raise_failures
from vivit.distributed.layout import ExchangeReport
from vivit.errors import DistributedError

Share = TypeVar("Share")


class LockStep:
    """One rank's side of the calls a group makes together (``group=None``: local)."""

    def __init__(self, group: dist.ProcessGroup | None, report: ExchangeReport):
        self.group = group
        self.report = report
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)

    def sum(
        self, call: object, compute: Callable[[], Sequence[Tensor]]
    ) -> list[Tensor]:
        """Every rank's share of a call, summed: bitwise identical on every rank.

        ``call`` names the share (with a digest of its input), equal on every
        rank; ``compute`` returns this rank's tensors (one type and device).

        Raises:
            DistributedError: If a rank failed (on the others), or a rank's call
                or shapes differ (on every rank).
        """
        if self.group is None:
            return list(compute())
        share, _ = self._round(  # the all-reduce needs as many numbers of one type
            call,
            compute,
            lambda s: (f"{sum(t.numel() for t in s)} numbers of {s[0].dtype}", None),
        )
        start = time.perf_counter()
        flat = torch.cat([t.reshape(-1) for t in share])
        dist.all_reduce(flat, group=self.group)
        self.report.reductions += 1
        self.report.reduced_bytes += flat.numel() * flat.element_size()
        self.report.reduction_seconds += time.perf_counter() - start
        parts = flat.split([t.numel() for t in share])
        return [
            part.view(t.shape).to(t.dtype) for part, t in zip(parts, share, strict=True)
        ]

    def gather(self, call: object, compute: Callable[[], Share]) -> list[Share]:
        """Every rank's (small, picklable) share of a call, in rank order.

        Raises:
            DistributedError: As for :meth:`sum`.
        """
        if self.group is None:
            return [compute()]
        _, shares = self._round(call, compute, lambda share: (None, share))
        return shares

    def _round(
        self,
        call: object,
        compute: Callable[[], Share],
        split: Callable[[Share], tuple[object, object]],
    ) -> tuple[Share, list[object]]:
        """This rank's share, and every rank's handed part once all calls agree."""
        try:
            share = compute()
        except BaseException as error:
            gather_objects(self.group, RankFailure.of(self.rank, error), self.report)
            raise
        start = time.perf_counter()  # the round, not this rank's share
        agreed, handed = split(share)
        gathered = gather_objects(self.group, ((call, agreed), handed), self.report)
        self.report.reduction_seconds += time.perf_counter() - start
        raise_failures(gathered, self.world_size)
        first = gathered[0][0]
        differences = [
            f"rank {rank} computes {_described(*theirs)}, rank 0 {_described(*first)}"
            for rank, (theirs, _) in enumerate(gathered)
            if theirs != first
        ]
        if differences:
            raise DistributedError(
                "The ranks of the process group make different calls: "
                + "; ".join(differences)
                + ". Under a process group every rank must make the same calls "
                "(eigh, directional_derivatives, newton, operator products) with "
                "the same arguments in the same order, and run the same library "
                "versions with the same number of threads: the replicated "
                "eigensolver must take the same steps on every rank."
            )
        return share, [part for _, part in gathered]


def _described(call: object, agreed: object) -> str:
    """A call and what else must agree (the size of a sum), in words."""
    return str(call) if agreed is None else f"{call} ({agreed})"
