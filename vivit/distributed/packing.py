"""A rank's part of the samples as one byte buffer and a description, and back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vivit.engines.base import BatchInfo, EngineOutput
from vivit.gram import ParamFactors, StackedFactors
from vivit.sources.collector import GroupCurvature
from vivit.sources.runs import PartResult

#: Byte alignment of every tensor in an exchanged buffer (whole cache lines).
ALIGNMENT = 64


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in an exchanged byte buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class Packer:
    """Lays out tensors in one byte buffer (``size`` bytes, aligned; ``payload``)."""

    def __init__(self) -> None:
        self._tensors: list[tuple[int, Tensor]] = []
        self.size = 0
        self.payload = 0

    def add(self, tensor: Tensor) -> _Slot:
        """Place ``tensor`` after the previous ones; where it will sit."""
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        slot = _Slot(self.size, nbytes, tensor.dtype, tuple(tensor.shape))
        self._tensors.append((self.size, tensor))
        self.payload += nbytes
        self.size += -(-nbytes // ALIGNMENT) * ALIGNMENT
        return slot

    def fill(self, buffer: Tensor) -> None:
        """Copy the tensors' bytes into ``buffer`` (``uint8``, at least ``size``)."""
        for offset, tensor in self._tensors:
            data = tensor.contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + data.numel()].copy_(data)


def _unpack(slot: _Slot, buffer: Tensor) -> Tensor:
    data = buffer[slot.offset : slot.offset + slot.nbytes]
    return data.view(slot.dtype).reshape(slot.shape)


def pack_factors(factors: ParamFactors, dtype: torch.dtype, packer: Packer) -> tuple:
    """A picklable description of factors, their tensors to ``packer`` in ``dtype``.

    Held in ``gram_dtype`` but computed in the model's ``dtype``, they travel in
    that exactly; stacked blocks each describe themselves.
    """
    if isinstance(factors, StackedFactors):
        blocks = [pack_factors(block, dtype, packer) for block in factors.blocks]
        return StackedFactors, blocks, list(factors.scales)
    state = {
        name: packer.add(value.to(dtype) if value.is_floating_point() else value)
        if isinstance(value, Tensor)
        else value
        for name, value in vars(factors).items()
    }
    return type(factors), factors.dtype, state


def unpack_factors(description: tuple, buffer: Tensor) -> ParamFactors:
    """The factors :func:`pack_factors` described (viewing ``buffer`` if not cast)."""
    cls, held_dtype, state = description
    if cls is StackedFactors:  # (cls, blocks, scales)
        blocks = [unpack_factors(block, buffer) for block in held_dtype]
        return StackedFactors(blocks, state)
    factors = cls.__new__(cls)
    factors.__dict__.update(
        {
            name: _unpack(value, buffer) if isinstance(value, _Slot) else value
            for name, value in state.items()
        }
    )
    return factors.to(held_dtype)


def pack_shard(block: PartResult, packer: Packer) -> dict:
    """Describe a rank's block (factors, batch contexts, loss); tensors to packer."""
    groups = []
    for curvature in block.curvature:
        dtype = curvature.factor_dtype
        groups.append(
            {
                "batch": curvature.batch,
                "factor_dtype": dtype,
                "ggn": [pack_factors(f, dtype, packer) for f in curvature.ggn_factors],
                "grad": [
                    pack_factors(f, dtype, packer) for f in curvature.grad_factors
                ],
            }
        )
    return {"groups": groups, "loss": packer.add(block.output.loss)}


def unpack_shard(
    description: dict, buffer: Tensor, param_groups: list[list[Tensor]]
) -> PartResult:
    """The block :func:`pack_shard` described (no Gram matrices), with its gradient."""
    curvature = [
        GroupCurvature(
            params=params,
            batch=group["batch"],
            factor_dtype=group["factor_dtype"],
            gram=None,
            ggn_factors=[unpack_factors(f, buffer) for f in group["ggn"]],
            grad_factors=[unpack_factors(f, buffer) for f in group["grad"]],
        )
        for params, group in zip(param_groups, description["groups"], strict=True)
    ]
    gradients = [
        shard_gradient(factors, group.batch, buffer.device).to(param.dtype)
        for group in curvature
        for factors, param in zip(group.grad_factors, group.params, strict=True)
    ]
    loss = _unpack(description["loss"], buffer)
    return PartResult(curvature, EngineOutput(loss=loss, gradients=gradients))


def shard_gradient(
    grad_factors: ParamFactors, batch: BatchInfo, device: torch.device
) -> Tensor:
    """``∇L_b = R_b Σ_n ∇ℓ_n`` from per-sample gradient factors (no exchange)."""
    ones = torch.full(
        (1, grad_factors.num_rows),
        batch.reduction_factor(),
        dtype=grad_factors.dtype,
        device=device,
    )
    return grad_factors.vmp(ones)[0]
