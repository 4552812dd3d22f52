"""Stored factors own their memory: no later result reads a tensor of the caller."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from vivit.sources.collector import GroupCurvature


def _storage(tensor: Tensor) -> int | None:
    """Address of the memory a tensor is a view of (``None`` if it holds none)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() > 0 else None


def stored_bytes(curvature: Iterable[GroupCurvature], counted: set[int]) -> int:
    """Bytes of the factor tensors' storages not in ``counted`` (then added to it)."""
    total = 0
    for tensor in _factor_tensors(curvature):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in counted:
            counted.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _factor_tensors(curvature: Iterable[GroupCurvature]) -> Iterator[Tensor]:
    """Every tensor that the factors of ``V`` and of the gradients hold."""
    for group in curvature:
        for factors in (group.ggn_factors or [], group.grad_factors or []):
            for factor in factors:
                yield from factor.tensors()


class CallerMemory:
    """Which factor tensors alias the caller's memory; replaces them by copies.

    Noted tensors are held until :meth:`own`, so their memory is not reused.
    """

    def __init__(self) -> None:
        self._aliased: list[Tensor] = []

    def note(
        self, curvature: Sequence[GroupCurvature], caller: Sequence[Tensor] | None
    ) -> None:
        """Note the factor tensors sharing memory with ``caller`` (``None``: all)."""
        owned = None if caller is None else {_storage(t) for t in caller}
        for tensor in _factor_tensors(curvature):
            storage = _storage(tensor)
            if storage is not None and (owned is None or storage in owned):
                self._aliased.append(tensor)

    def own(self, curvature: Sequence[GroupCurvature]) -> None:
        """Replace, in place, each factor tensor sharing a noted one's memory by a copy.

        Views with the same memory, offset, shape and strides share one copy.
        """
        aliased = {_storage(t) for t in self._aliased}
        self._aliased.clear()
        if not aliased:
            return
        copies: dict[tuple, Tensor] = {}

        def owned(tensor: Tensor) -> Tensor:
            storage = _storage(tensor)
            if storage not in aliased:
                return tensor
            offset, stride = tensor.storage_offset(), tensor.stride()
            key = (storage, offset, tensor.shape, stride, tensor.dtype)
            if key not in copies:
                copies[key] = tensor.clone(memory_format=torch.contiguous_format)
            return copies[key]

        for group in curvature:
            group.ggn_factors = [f.map_tensors(owned) for f in group.ggn_factors]
            if group.grad_factors is not None:
                group.grad_factors = [f.map_tensors(owned) for f in group.grad_factors]
