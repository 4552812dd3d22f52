"""What a piece of code allocates and computes: bytes live, multiply-adds, operations.

A storage counts from the operation that allocates it until freed (one an
operation's inputs hold is a view); multiply-adds are PyTorch's FLOP formulas halved.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from vivit.memory.costs import pass_cost


@dataclass(frozen=True)
class Usage:
    """Bytes live after each operation and at the end, multiply-adds, operations."""

    trace: list[int]
    kept: int
    work: float
    ops: int

    @property
    def peak(self) -> int:
        """Most bytes allocated at once during the call."""
        return max(self.trace, default=0)


def _storages(tree: object) -> list[torch.UntypedStorage]:
    return [
        t.untyped_storage()
        for t in tree_leaves(tree)
        if isinstance(t, torch.Tensor) and t.device.type != "meta"
    ]


class WorkExceeded(Exception):  # noqa: N818 (a stop, not an error)
    """A measured call stopped where its cost passed its budget (:class:`Counter`)."""

    def __init__(self, cost: float):
        super().__init__(f"stopped at a cost of {cost:.3g}")
        self.cost = cost


class Counter(TorchDispatchMode):
    """Counts the storages, multiply-adds and operations of what runs under it.

    Raises:
        WorkExceeded: Once the cost of what ran
            (:func:`~vivit.memory.costs.pass_cost` of its multiply-adds and
            operations) passes ``budget`` (``None``: never).
    """

    def __init__(self, budget: float | None = None) -> None:
        super().__init__()
        self.budget = budget
        self.current = self.ops = 0
        self.work = 0.0
        self.trace: list[int] = []
        self._live: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        flops = flop_registry.get(func.overloadpacket)
        if flops is not None:
            self.work += flops(*args, **kwargs, out_val=out) / 2
        if self.budget is not None:
            cost = pass_cost(self.work, self.ops)
            if cost > self.budget:
                raise WorkExceeded(cost)
        new = [s for s in _storages(out) if s._cdata not in self._live]
        if new:
            inputs = {s._cdata for s in _storages((args, kwargs))}
            for storage in new:
                if storage._cdata not in inputs | self._live.keys():
                    self._count(storage)
        self.trace.append(self.current)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()

        def freed(_: object) -> None:
            self._live.pop(key, None)
            self.current -= size

        self._live[key] = weakref.ref(storage, freed)
        self.current += size


def measure(
    call: Callable[[], object], budget: float | None = None
) -> tuple[object, Usage]:
    """Run ``call``; its result (kept alive, so ``kept`` counts it) and usage.

    Raises:
        WorkExceeded: Where its cost passes ``budget`` (:class:`Counter`).
    """
    with Counter(budget) as counter:
        result = call()
    return result, Usage(counter.trace, counter.current, counter.work, counter.ops)
