"""Stored factors own their memory: no later result reads a tensor of the caller.

An engine keeps a layer's input as a factor of ``V``
(:class:`~vivit.gram.OuterProductFactors`): for the first Linear layer of an MLP
that is the caller's inputs themselves (or a view of them, such as a chunk or a
reshape), and a layer applied to a parameter or
a buffer keeps that. Every result of a :class:`~vivit.LowRankGGN` is computed from
the factors after construction, so an in-place change of the caller's tensors
(normalising the inputs, reusing a buffer, an optimizer step) would change them.

:class:`CallerMemory` notes, block by block, which factor tensors share memory with
what the caller owns (the block's inputs and targets, the model's parameters and
buffers), and :meth:`CallerMemory.own` replaces them in the final factors by copies
(:mod:`vivit.sources.stored`). Only those are copied, each storage view once: the
factors of ``V`` and the per-sample gradients of a weight share one copy, and
factors that merging the blocks already copied (a batch in chunks, a loader's
batches) are not copied again. Without the caller's tensors (a loss computed
elsewhere, :meth:`~vivit.LowRankGGN.from_loss`) every factor tensor is copied once
(``docs/guide.rst``, "Results are computed from copies").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from vivit.gram import ParamFactors
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

    The noted tensors are kept until :meth:`own`, so that their memory cannot be
    reused by a later allocation in between.
    """

    def __init__(self) -> None:
        self._aliased: list[Tensor] = []

    def note(
        self, curvature: Sequence[GroupCurvature], caller: Sequence[Tensor] | None
    ) -> None:
        """Note the factor tensors of one block that share memory with the caller's.

        Args:
            curvature: The block's curvature, one per group, factors kept.
            caller: The caller's tensors the block read (its inputs and targets,
                the model's parameters and buffers); ``None`` if unknown: every
                factor tensor is then noted.
        """
        owned = None if caller is None else {_storage(t) for t in caller}
        for tensor in _factor_tensors(curvature):
            storage = _storage(tensor)
            if storage is not None and (owned is None or storage in owned):
                self._aliased.append(tensor)

    def own(self, curvature: Sequence[GroupCurvature]) -> None:
        """Replace every factor tensor that shares memory with a noted one by a copy.

        Views with the same memory, offset, shape and strides share one copy.

        Args:
            curvature: Each group's final curvature; its factor lists are
                replaced in place.
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
            key = (
                storage,
                tensor.storage_offset(),
                tensor.shape,
                tensor.stride(),
                tensor.dtype,
            )
            if key not in copies:
                copies[key] = tensor.clone(memory_format=torch.contiguous_format)
            return copies[key]

        for group in curvature:
            group.ggn_factors = _mapped(group.ggn_factors, owned)
            if group.grad_factors is not None:
                group.grad_factors = _mapped(group.grad_factors, owned)


def _mapped(
    factors: list[ParamFactors], function: Callable[[Tensor], Tensor]
) -> list[ParamFactors]:
    """Each factor with its tensors mapped."""
    return [factor.map_tensors(function) for factor in factors]
