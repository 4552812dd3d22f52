"""Calls that every rank of a group makes together, in step: the implicit route's.

Each call computes this rank's share, then one ``all_gather_object`` round
compares the call (name, input digest) and reports failures on every rank, then
the shares are summed by one ``all_reduce`` (bitwise identical on every rank) or
gathered in rank order (``docs/math.rst``, "Implicit products on several processes").
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from vivit.distributed.agreement import RankFailure, raise_failures
from vivit.distributed.layout import ExchangeReport
from vivit.errors import DistributedError

Share = TypeVar("Share")


class LockStep:
    """One rank's side of the calls a group makes together (see the module).

    Args:
        group: The process group, or ``None`` to run locally (every call then
            returns this process's share as it is).
        report: Counts the bytes and time of the calls.
    """

    def __init__(self, group: dist.ProcessGroup | None, report: ExchangeReport):
        self.group = group
        self.report = report
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)

    def sum(
        self, call: object, compute: Callable[[], Sequence[Tensor]]
    ) -> list[Tensor]:
        """Every rank's share of a call, summed over the ranks.

        Args:
            call: What the share is of (its name and a digest of its input),
                equal on every rank (compared with ``==``).
            compute: This rank's share: tensors of one type and device.

        Returns:
            The sums, shaped like the share; bitwise identical on every rank.

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
        """Every rank's share of a call, in rank order (small shares, pickled).

        Args:
            call: What the share is of, equal on every rank (see :meth:`sum`).
            compute: This rank's share (picklable).

        Returns:
            Every rank's share, rank 0's first; identical on every rank.

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
        """This rank's share, and every rank's handed part once the calls agree.

        ``split`` divides a share into what must agree besides the call (the
        shapes of a sum) and what every rank hands every rank (a gathered share).
        """
        try:
            share = compute()
        except BaseException as error:
            self._all_gather(RankFailure.of(self.rank, error))
            raise
        start = time.perf_counter()  # the round, not this rank's share
        agreed, handed = split(share)
        gathered = self._all_gather(((call, agreed), handed))
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

    def _all_gather(self, item: object) -> list[object]:
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, item, group=self.group)
        self.report.metadata_bytes += len(pickle.dumps(item))
        return gathered


def _described(call: object, agreed: object) -> str:
    """A call and what else must agree (the size of a sum), in words."""
    return str(call) if agreed is None else f"{call} ({agreed})"
