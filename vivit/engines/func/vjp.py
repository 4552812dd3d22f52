"""Batched vector-Jacobian products, in chunks that fit a memory budget."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vivit.engines.func.columns import OneHotPerSample, VectorStack
from vivit.model_inputs import ModelInputs


class BatchedVJP:
    """``Jᵀ v`` of a graph's output for stacks of vectors ``v``.

    Per chunk one vmapped backward pass (``is_grads_batched=True``) or one backward
    pass per vector, the same numbers: the first call times both on its first chunk and
    keeps the loop only if it is estimated more than twice as fast (some operations
    have slow batching rules, or none).
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


class ExplicitColumns:
    """Explicit columns of a chunk by the faster of two exact routes.

    :func:`per_sample_vjp` (one pass, but a second forward pass under ``vmap``) or the
    one-hot batches (``B`` backward passes through the chunk's graph). With several
    chunks the first times both and keeps the faster; with one chunk the one-hot
    batches reuse the graph the engine already holds.
    """

    def __init__(self):
        self.vectorized: bool | None = None

    def __call__(
        self,
        vectorized: Callable[[], list[Tensor] | None],
        one_hot: Callable[[], list[Tensor]],
        more_chunks: bool,
    ) -> list[Tensor]:
        """The columns, ``[B, V, *param.shape]`` per parameter.

        Args:
            vectorized: Runs :func:`per_sample_vjp` (``None`` if it cannot).
            one_hot: Pushes the one-hot batches back.
            more_chunks: Whether more chunks follow this one.
        """
        if self.vectorized is None and not more_chunks:
            return one_hot()
        if self.vectorized is None:
            start = time.perf_counter()
            columns = vectorized()
            by_vmap = time.perf_counter() - start
            if columns is None:
                self.vectorized = False
                return one_hot()
            start = time.perf_counter()
            one_hot()
            self.vectorized = by_vmap <= time.perf_counter() - start
            return columns
        columns = vectorized() if self.vectorized else None
        return one_hot() if columns is None else columns


def per_sample_vjp(
    sample_output: Callable[[list[Tensor], ModelInputs], Tensor],
    params: list[Tensor],
    inputs: ModelInputs,
    vectors: Tensor,
    chunk_size: int,
) -> list[Tensor] | None:
    """Each sample's ``J_nᵀ v`` at the parameters, vectorized over the samples.

    ``vmap`` over the samples of one sample's pullback, itself vmapped over that
    sample's vectors.

    Args:
        sample_output: The output of one sample (its input with a batch axis of
            one) as a function of the parameters' values.
        params: The parameters.
        inputs: The chunk's inputs ``[B, *in]`` (or a dict of them).
        vectors: ``[V, B, *out]``.
        chunk_size: At most this many vectors per vmapped pullback.

    Returns:
        One tensor ``[B, V, *param.shape]`` per parameter, detached, or ``None``
        where the model cannot run under ``vmap`` (an operation without a batching
        rule, data-dependent control flow, an LSTM's fused kernel).
    """
    values = [p.detach() for p in params]

    def one_sample(x: ModelInputs, v: Tensor) -> list[Tensor]:
        _, pullback = torch.func.vjp(lambda *w: sample_output(list(w), x), *values)
        return torch.func.vmap(pullback, chunk_size=max(chunk_size, 1))(v)

    try:
        columns = torch.func.vmap(one_sample)(inputs, vectors.transpose(0, 1))
    except RuntimeError:
        # the model ran without vmap (the engine's first forward pass): a failure
        # here is vmap's (an LSTM's fused kernel writes its batch in place)
        return None
    return [c.detach() for c in columns]
