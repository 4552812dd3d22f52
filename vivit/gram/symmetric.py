"""``Vᵀ V`` from an explicit ``Vᵀ``, computing only its lower triangle."""

from __future__ import annotations

from torch import Tensor

#: Row blocks of the lower triangle; 8 blocks do 56 % of the full product's work.
NUM_BLOCKS = 8
#: Below this many rows the plain product is as fast.
MIN_ROWS = 512


def self_gram(vt: Tensor) -> Tensor:
    """``Vᵀ V`` for ``Vᵀ`` given as a ``[R, D]`` matrix.

    A matrix product does not know that ``Vᵀ V`` is symmetric (PyTorch exposes no
    symmetric rank-k update), so for large ``R`` the lower triangle is computed in
    row blocks and mirrored.

    Args:
        vt: ``Vᵀ``, shape ``[R, D]``.

    Returns:
        The symmetric ``[R, R]`` Gram matrix.
    """
    rows = vt.shape[0]
    if rows < MIN_ROWS:
        return vt @ vt.T
    gram = vt.new_empty(rows, rows)
    bounds = [rows * b // NUM_BLOCKS for b in range(NUM_BLOCKS + 1)]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        block = vt[start:end] @ vt[:end].T  # [end - start, end]
        gram[start:end, :start] = block[:, :start]
        gram[:start, start:end] = block[:, :start].T
        square = block[:, start:]  # mirror its lower triangle: exactly symmetric
        gram[start:end, start:end] = square.tril() + square.tril(-1).T
    return gram
