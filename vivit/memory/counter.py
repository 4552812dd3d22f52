"""What a piece of code allocates and computes: bytes live, multiply-adds, operations.

:class:`Counter` watches every ATen operation run under it: the bytes of the
tensor storages it allocates while they live (a storage that an operation's
inputs hold is a view, not an allocation), after each operation; the
multiply-adds of matrix products and convolutions (PyTorch's FLOP formulas);
and how many operations ran (each costs a fixed overhead besides its
arithmetic).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry


@dataclass(frozen=True)
class Usage:
    """What a call used.

    Attributes:
        trace: Bytes allocated after each operation, beyond what was allocated
            before the call (its peak is the largest).
        kept: Bytes still allocated after it (what its result holds).
        work: Multiply-adds of its matrix products and convolutions.
        ops: Operations it ran.
    """

    trace: list[int]
    kept: int
    work: float
    ops: int

    @property
    def peak(self) -> int:
        """Most bytes allocated at once during the call."""
        return max(self.trace, default=0)


class Counter(TorchDispatchMode):
    """Counts the storages, multiply-adds and operations of what runs under it."""

    def __init__(self) -> None:
        super().__init__()
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
        inputs = None
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._live:
                continue
            if inputs is None:  # a view of an input is no allocation
                inputs = {
                    t.untyped_storage()._cdata
                    for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and t.device.type != "meta"
                }
            if key in inputs:
                continue
            size = storage.nbytes()
            self._live[key] = weakref.ref(storage, self._freed(key, size))
            self.current += size
        self.trace.append(self.current)
        return out

    def _freed(self, key: int, size: int) -> Callable[[object], None]:
        def freed(_: object) -> None:
            self._live.pop(key, None)
            self.current -= size

        return freed


def measure(call: Callable[[], object]) -> tuple[object, Usage]:
    """Run ``call`` and count what it used.

    Args:
        call: The code to measure.

    Returns:
        Its result (kept alive, so that ``kept`` counts it) and its usage.
    """
    with Counter() as counter:
        result = call()
    return result, Usage(counter.trace, counter.current, counter.work, counter.ops)
