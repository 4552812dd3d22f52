"""Batched vector-Jacobian products, in chunks that fit a memory budget."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from vivit.engines.func.columns import OneHotPerSample, VectorStack


class BatchedVJP:
    """``Jᵀ v`` of a graph's output for stacks of vectors ``v``.

    Vectors are pushed back ``chunk_size`` at a time through one vmapped backward
    pass (``torch.autograd.grad(..., is_grads_batched=True)``) or one backward pass
    per vector. The first call times both on its first chunk and keeps the faster:
    some operations have slow batching rules (an LSTM's backward pass on the CPU
    runs about 10 times slower vmapped than in a loop) or none (then the loop is
    used). Both give the same numbers; the loop is chosen only if it is estimated
    more than twice as fast.
    """

    def __init__(self):
        self.batched: bool | None = None

    def __call__(
        self,
        output: Tensor,
        inputs: Sequence[Tensor],
        vectors: Tensor | VectorStack | OneHotPerSample,
        chunk_size: int,
    ) -> list[Tensor]:
        """``Jᵀ v`` of ``output`` w.r.t. each input.

        Args:
            output: A tensor of the graph, shape ``[*out]``.
            inputs: Tensors of the graph to differentiate with respect to.
            vectors: ``[V, *out]``: a tensor, or a stack that forms the
                vectors it is sliced for (:mod:`vivit.engines.func.columns`).
            chunk_size: At most this many vectors per vmapped backward pass.

        Returns:
            One tensor ``[V, *input.shape]`` per input (zeros where ``output``
            does not depend on it), detached.
        """
        if not inputs:
            return []
        total, step = len(vectors), max(chunk_size, 1)
        if total <= step:  # one pass: its products are the result
            grads = self._chunk(output, inputs, vectors[:])
            return [
                x.new_zeros(total, *x.shape) if grad is None else grad.detach()
                for grad, x in zip(grads, inputs, strict=True)
            ]
        # several passes: each written into the result, no list of parts besides
        results = [x.new_zeros(total, *x.shape) for x in inputs]
        for start in range(0, total, step):
            chunk = vectors[start : start + step]
            grads = self._chunk(output, inputs, chunk)
            for result, grad in zip(results, grads, strict=True):
                if grad is not None:
                    result[start : start + len(chunk)] = grad
            del chunk, grads
        return results

    def _chunk(self, output, inputs, chunk) -> list[Tensor | None]:
        if self.batched is None:
            start = time.perf_counter()
            grads = _vmapped(output, inputs, chunk)
            if grads is None:
                self.batched = False
                return _looped(output, inputs, chunk)
            vmapped = time.perf_counter() - start
            start = time.perf_counter()
            _looped(output, inputs, chunk[:1])
            looped = len(chunk) * (time.perf_counter() - start)
            # the first vmapped pass also pays one-time costs: loop only if clearly
            # faster
            self.batched = vmapped <= 2 * looped
            return grads
        if self.batched:
            grads = _vmapped(output, inputs, chunk)
            if grads is not None:
                return grads
        return _looped(output, inputs, chunk)


def _vmapped(output, inputs, chunk) -> list[Tensor | None] | None:
    """One vmapped backward pass; ``None`` if an operation has no batching rule."""
    try:
        return list(
            torch.autograd.grad(
                output,
                inputs,
                chunk,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
        )
    except RuntimeError as error:
        if "atching rule" not in str(error) and "vmap" not in str(error):
            raise
        return None


def _looped(output, inputs, chunk) -> list[Tensor | None]:
    """One backward pass per vector."""
    per_vector = [
        torch.autograd.grad(
            output, inputs, vector, retain_graph=True, allow_unused=True
        )
        for vector in chunk
    ]
    return [
        None if parts[0] is None else torch.stack(parts)
        for parts in zip(*per_vector, strict=True)
    ]
