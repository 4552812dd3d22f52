"""The vectors the func engine backpropagates, and batched VJPs that fit a budget."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vivit.loss_roots import LossRoot
from vivit.model_inputs import ModelInputs


class _Stack:
    """Vectors indexed like a tensor of ``shape``, formed only where sliced."""

    shape: torch.Size

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, vectors: slice) -> Tensor:
        """Consecutive vectors, ``[k, *shape[1:]]``."""
        start, stop, _ = vectors.indices(len(self))
        parts = self._parts(start, max(start, stop))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class VectorStack(_Stack):
    """``[V, B, *out]`` vectors of the batch's ``samples`` (a range), lazily.

    The ``K`` columns of the loss-Hessian ``root`` of ``ggn_samples`` (zero outside
    them), then, unless ``None``, ``gradients`` ``∂ℓ_n/∂f_n`` ``[N, *out]``.
    """

    def __init__(
        self,
        root: LossRoot,
        ggn_samples: tuple[int, ...],
        gradients: Tensor | None,
        samples: range,
    ):
        self._root = root
        self._ggn_samples = ggn_samples
        self._gradients = gradients
        self._samples = samples
        # positions in S of the curvature samples in this range, and their rows
        kept = [(i, n) for i, n in enumerate(ggn_samples) if n in samples]
        self._in_root = torch.tensor(
            [i for i, _ in kept], dtype=torch.long, device=root.device
        )
        self._rows = [n - samples.start for _, n in kept]
        self.shape = torch.Size(
            (len(root) + (gradients is not None), len(samples), *root.shape[2:])
        )

    def samples(self, start: int, stop: int) -> VectorStack:
        """The vectors of this stack's samples ``start:stop``, formed as lazily."""
        span = self._samples[start:stop]
        return VectorStack(self._root, self._ggn_samples, self._gradients, span)

    def _parts(self, start: int, stop: int) -> list[Tensor]:
        parts = []
        num_root = len(self._root)
        if start < num_root:
            columns = self._root.rows(self._in_root)[start : min(stop, num_root)]
            if self._rows == list(range(len(self._samples))):
                parts.append(columns)
            else:
                placed = columns.new_zeros(len(columns), *self.shape[1:])
                placed[:, self._rows] = columns
                parts.append(placed)
        if stop > num_root:  # the gradient vector
            span = self._samples
            parts.append(self._gradients[span.start : span.stop].unsqueeze(0))
        return parts


class OneHotPerSample(_Stack):
    """Each sample's vectors in an otherwise zero batch, ``[B·V, B, *out]``, lazily.

    Vector ``b·V + v`` backpropagated gives sample ``b``'s own ``J_bᵀ v``.
    """

    def __init__(self, vectors: VectorStack):
        self._vectors = vectors
        self._per_sample, batch = vectors.shape[:2]
        self.shape = torch.Size((batch * self._per_sample, *vectors.shape[1:]))

    def _parts(self, start: int, stop: int) -> list[Tensor]:
        per = self._per_sample
        parts = []
        rows = start
        while rows < stop:
            sample, first = divmod(rows, per)
            last = min(per, first + stop - rows)
            own = self._vectors.samples(sample, sample + 1)[first:last]
            placed = own.new_zeros(last - first, *self.shape[1:])
            placed[:, sample] = own[:, 0]
            parts.append(placed)
            rows += last - first
        return parts


class BatchedVJP:
    """``Jᵀ v`` of a graph's output for stacks of vectors ``v``.

    One vmapped backward pass per chunk, or one pass per vector if the first chunk
    times that more than twice as fast (the same numbers).
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
        """``Jᵀ v`` ``[V, *input.shape]`` per input (detached; zeros if unused).

        ``vectors`` ``[V, *out]`` go back ``chunk_size`` per pass.
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
            grads, vmapped = _timed(_vmapped, output, inputs, chunk)
            if grads is None:
                self.batched = False
                return _looped(output, inputs, chunk)
            looped = len(chunk) * _timed(_looped, output, inputs, chunk[:1])[1]
            self.batched = vmapped <= 2 * looped  # vmap's first pass pays set-up
            return grads
        if self.batched:
            grads = _vmapped(output, inputs, chunk)
            if grads is not None:
                return grads
        return _looped(output, inputs, chunk)


def _timed(function: Callable, *args) -> tuple[object, float]:
    """``function(*args)`` and the seconds it took."""
    start = time.perf_counter()
    return function(*args), time.perf_counter() - start


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

    :func:`per_sample_vjp` or the one-hot batches through the chunk's graph: the
    first of several chunks times both; one chunk takes the one-hot batches.
    """

    def __init__(self):
        self.vectorized: bool | None = None

    def __call__(
        self,
        vectorized: Callable[[], list[Tensor] | None],
        one_hot: Callable[[], list[Tensor]],
        more_chunks: bool,
    ) -> list[Tensor]:
        """The columns ``[B, V, *param.shape]`` per parameter."""
        if self.vectorized is None and not more_chunks:
            return one_hot()
        if self.vectorized is None:
            columns, by_vmap = _timed(vectorized)
            if columns is None:
                self.vectorized = False
                return one_hot()
            self.vectorized = by_vmap <= _timed(one_hot)[1]
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
    """Each sample's ``J_nᵀ v`` at the parameters: ``vmap`` of one sample's pullback.

    ``sample_output(values, x)``: one sample's output (batch axis of one);
    ``vectors`` ``[V, B, *out]``, ``chunk_size`` of them per pullback.

    Returns:
        ``[B, V, *param.shape]`` per parameter, detached, or ``None`` where the model
        cannot run under ``vmap``.
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
