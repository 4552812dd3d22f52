"""The vectors the func engine backpropagates, formed a block at a time.

A batch's vectors ``[V, N, *out]`` are the ``K`` columns of the loss-Hessian root
(zero outside the curvature subsampling), then the per-sample gradients
``∂ℓ_n/∂f_n``: for an exact cross-entropy root ``N (C T)²`` numbers
(``docs/math.rst``, "Losses"). :class:`VectorStack` and :class:`OneHotPerSample` are
indexed like the tensors they stand for and form only what is indexed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vivit.loss_roots import LossRoot


class VectorStack:
    """``[V, B, *out]`` vectors of the samples ``start:stop`` of a batch, lazily.

    Args:
        root: The loss-Hessian root of the curvature samples ``S``.
        ggn_samples: ``S``, indices into the batch.
        gradients: ``∂ℓ_n/∂f_n`` of every sample of the batch, ``[N, *out]``, or
            ``None`` (no gradient vector).
        samples: The batch's samples this stack holds, ``range(start, stop)``.
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

    def __len__(self) -> int:
        return self.shape[0]

    def samples(self, start: int, stop: int) -> VectorStack:
        """The vectors of this stack's samples ``start:stop``, formed as lazily."""
        first = self._samples.start
        return VectorStack(
            self._root,
            self._ggn_samples,
            self._gradients,
            range(first + start, first + min(stop, len(self._samples))),
        )

    def __getitem__(self, vectors: slice) -> Tensor:
        """Consecutive vectors of the stack's samples, ``[k, B, *out]``."""
        start, stop, _ = vectors.indices(len(self))
        stop = max(start, stop)
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
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class OneHotPerSample:
    """Each sample's vectors in an otherwise zero batch, ``[B·V, B, *out]``, lazily.

    Backpropagating vector ``b·V + v`` through a batch gives sample ``b``'s own
    ``J_bᵀ v`` at the parameters, where autograd would otherwise sum over the
    samples.

    Args:
        vectors: The ``[V, B, *out]`` vectors (a tensor or a :class:`VectorStack`).
    """

    def __init__(self, vectors: Tensor | VectorStack):
        self._vectors = vectors
        num, batch = vectors.shape[:2]
        self._per_sample = num
        self.shape = torch.Size((batch * num, *vectors.shape[1:]))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, vectors: slice) -> Tensor:
        """Rows ``vectors`` (consecutive), ``[k, B, *out]``: row ``b·V + v``."""
        start, stop, _ = vectors.indices(len(self))
        stop = max(start, stop)
        per = self._per_sample
        parts = []
        rows = start
        while rows < stop:
            sample, first = divmod(rows, per)
            last = min(per, first + stop - rows)
            own = _sample_vectors(self._vectors, sample)[first:last]
            placed = own.new_zeros(last - first, *self.shape[1:])
            placed[:, sample] = own[:, 0]
            parts.append(placed)
            rows += last - first
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _sample_vectors(vectors: Tensor | VectorStack, sample: int) -> Tensor | VectorStack:
    """The ``[V, 1, *out]`` vectors of one sample."""
    if isinstance(vectors, VectorStack):
        return vectors.samples(sample, sample + 1)
    return vectors[:, sample : sample + 1]
