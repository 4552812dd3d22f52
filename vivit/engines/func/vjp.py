"""Batched vector-Jacobian products, in chunks that fit a memory budget."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def batched_vjp(
    output: Tensor, inputs: Sequence[Tensor], vectors: Tensor, chunk_size: int
) -> list[Tensor]:
    """``Jᵀ v`` of ``output`` w.r.t. each input, for a stack of vectors ``v``.

    Vectors are pushed back ``chunk_size`` at a time through one vmapped backward
    pass (``torch.autograd.grad(..., is_grads_batched=True)``); an operation
    without a batching rule falls back to one backward pass per vector.

    Args:
        output: A tensor of the graph, shape ``[*out]``.
        inputs: Tensors of the graph to differentiate with respect to.
        vectors: ``[V, *out]``.
        chunk_size: At most this many vectors per backward pass.

    Returns:
        One tensor ``[V, *input.shape]`` per input (zeros where ``output`` does not
        depend on it), detached.
    """
    results: list[list[Tensor]] = [[] for _ in inputs]
    for chunk in vectors.split(max(chunk_size, 1)):
        for result, grads in zip(
            results, _vjp_chunk(output, inputs, chunk), strict=True
        ):
            result.append(grads)
    return [torch.cat(parts) for parts in results]


def _vjp_chunk(output: Tensor, inputs: Sequence[Tensor], chunk: Tensor) -> list[Tensor]:
    try:
        grads = torch.autograd.grad(
            output,
            inputs,
            chunk,
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=True,
        )
    except RuntimeError as error:
        if "atching rule" not in str(error) and "vmap" not in str(error):
            raise
        per_vector = [
            torch.autograd.grad(
                output, inputs, vector, retain_graph=True, allow_unused=True
            )
            for vector in chunk
        ]
        grads = [
            None if parts[0] is None else torch.stack(parts)
            for parts in zip(*per_vector, strict=True)
        ]
    return [
        chunk.new_zeros(len(chunk), *x.shape) if g is None else g.detach()
        for g, x in zip(grads, inputs, strict=True)
    ]


def one_hot_per_sample(vectors: Tensor) -> Tensor:
    """Place each sample's vectors in an otherwise zero batch.

    Backpropagating vector ``[b, v]`` of the result through a batch gives sample
    ``b``'s own ``J_bᵀ v`` at the parameters, where autograd would otherwise sum
    over the samples.

    Args:
        vectors: ``[V, B, *out]``.

    Returns:
        ``[B·V, B, *out]``; entry ``b·V + v`` holds ``vectors[v, b]`` at sample
        ``b`` and zeros elsewhere.
    """
    num, batch = vectors.shape[:2]
    placed = vectors.new_zeros(batch, num, *vectors.shape[1:])
    index = torch.arange(batch, device=vectors.device)
    placed[index, :, index] = vectors.transpose(0, 1)
    return placed.reshape(batch * num, *vectors.shape[1:])
