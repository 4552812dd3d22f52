"""``Vᵀ V`` from an explicit ``Vᵀ``, computing only its lower triangle."""

from __future__ import annotations

from torch import Tensor

#: Row blocks of the lower triangle; 8 blocks do 56 % of the full product's work.
NUM_BLOCKS = 8
#: Below this many rows the plain product is as fast.
MIN_ROWS = 512


def self_gram(vt: Tensor, out: Tensor | None = None) -> Tensor:
    """``Vᵀ V``, ``[R, R]``, of ``vt`` ``[R, D]``, added to ``out`` in place if given.

    PyTorch has no symmetric rank-k update, so for large ``R`` the lower triangle
    is computed in row blocks and mirrored.
    """
    rows = vt.shape[0]
    if rows < MIN_ROWS:
        gram = vt @ vt.T
        return gram if out is None else out.add_(gram)
    if out is None:
        out = vt.new_zeros(rows, rows)
    bounds = [rows * b // NUM_BLOCKS for b in range(NUM_BLOCKS + 1)]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        # rows [start, end) of the lower triangle and the diagonal tile
        out[start:end, :end].addmm_(vt[start:end], vt[:end].T)
        out[:start, start:end] = out[start:end, :start].T
        tile = out[start:end, start:end]  # mirror its lower triangle: exact symmetry
        tile.copy_(tile.tril() + tile.tril(-1).T)
    return out
