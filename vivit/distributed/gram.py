"""Who forms which block ``V_aᵀ V_b`` of a Gram matrix; the matrix formed together."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from vivit.gram import ParamFactors, StackedFactors


def gram_block_owners(num_blocks: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Each rank's Gram blocks ``(a, b)``, ``a ≤ b``, in order.

    Block ``i`` of the upper triangle (row-major) goes to rank ``i mod W``.
    """
    pairs = [(a, b) for a in range(num_blocks) for b in range(a, num_blocks)]
    return [pairs[rank::world_size] for rank in range(world_size)]


def gram_block_entries(rows: Sequence[int], a: int, b: int) -> int:
    """Numbers sent for Gram block ``(a, b)``, ``b ≥ a`` (a diagonal's triangle)."""
    return rows[a] * (rows[a] + 1) // 2 if a == b else rows[a] * rows[b]


def sharded_gram(
    factors: Sequence[ParamFactors], group: dist.ProcessGroup
) -> tuple[Tensor, int]:
    """A group's Gram matrix ``[N·C, N·C]`` of the union, formed together.

    Each rank forms its blocks (of a diagonal block only the upper triangle
    travels); every rank assembles the same matrix. A collective. ``factors``:
    one :class:`~vivit.gram.StackedFactors` per parameter, a block per rank.
    Also returns the bytes of every rank's buffer in the all-gather.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    per_param = [
        f if isinstance(f, StackedFactors) else StackedFactors([f]) for f in factors
    ]
    rows = [block.num_rows for block in per_param[0].blocks]
    owners = gram_block_owners(len(rows), world_size)
    computed = [(a, b, _block_sum(per_param, a, b)) for a, b in owners[rank]]
    device = computed[0][2].device
    upper = [torch.triu_indices(n, n, device=device).unbind() for n in rows]
    mine = [
        block[upper[a]] if a == b else block.reshape(-1) for a, b, block in computed
    ]
    # W(W+1)/2 blocks for W ranks: every rank owns at least one
    sizes = [sum(gram_block_entries(rows, a, b) for a, b in o) for o in owners]
    buffer = mine[0].new_zeros(max(sizes))
    buffer[: sizes[rank]].copy_(torch.cat(mine))
    gathered = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(gathered, buffer, group=group)
    gram = _assemble(gathered, owners, rows, upper)
    return gram, buffer.numel() * buffer.element_size()


def _block_sum(per_param: Sequence[StackedFactors], a: int, b: int) -> Tensor:
    """Gram block ``(a, b)`` summed over the parameters."""
    block = per_param[0].block_gram(a, b)
    for param in per_param[1:]:
        block.add_(param.block_gram(a, b))
    return block


def _assemble(
    gathered: Sequence[Tensor],
    owners: Sequence[Sequence[tuple[int, int]]],
    rows: Sequence[int],
    upper: Sequence[tuple[Tensor, Tensor]],
) -> Tensor:
    """The Gram matrix from every rank's buffer of blocks, mirrored to full."""
    bounds = list(itertools.accumulate(rows, initial=0))
    gram = gathered[0].new_empty(bounds[-1], bounds[-1])
    for owned, data in zip(owners, gathered, strict=True):
        offset = 0
        for a, b in owned:
            size = gram_block_entries(rows, a, b)
            entries = data[offset : offset + size]
            offset += size
            block = gram[bounds[a] : bounds[a + 1], bounds[b] : bounds[b + 1]]
            if a == b:
                block[upper[a]] = entries
                block[upper[a][1], upper[a][0]] = entries
            else:
                block.copy_(entries.view(rows[a], rows[b]))
                mirror = gram[bounds[b] : bounds[b + 1], bounds[a] : bounds[a + 1]]
                mirror.copy_(block.T)
    return gram
