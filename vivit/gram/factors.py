"""The interface of every form of a parameter's columns of ``V``, and shared helpers."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

#: Row blocks of :func:`self_gram`'s lower triangle: 8 do 56 % of the full work.
NUM_BLOCKS = 8
#: Below this many rows :func:`self_gram` takes the plain product, as fast.
MIN_ROWS = 512


class ParamFactors(ABC):
    """The columns of the GGN square root ``V`` that belong to one parameter.

    ``V_p`` is ``[p.numel(), N·C]``, column ``n·C + c`` of sample ``n``, in the form
    cheapest for the layer (``docs/math.rst``, "The GGN and its square root").

    Attributes:
        num_samples: Number of samples ``N`` whose columns are held.
        num_columns: Columns per sample ``C`` (``M`` with Monte-Carlo sampling).
        param_shape: Shape of the parameter.
    """

    num_samples: int
    num_columns: int
    param_shape: torch.Size

    @property
    def num_rows(self) -> int:
        """Number of Gram-space entries, ``N * C``."""
        return self.num_samples * self.num_columns

    def _tensors(self) -> dict[str, Tensor]:
        """The floating-point tensors that hold the factors (instance attributes)."""
        items = vars(self).items()
        return {
            k: v for k, v in items if isinstance(v, Tensor) and v.is_floating_point()
        }

    def tensors(self) -> list[Tensor]:
        """The floating-point tensors (possibly views) whose memory the factors keep."""
        return list(self._tensors().values())

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point type of the factors."""
        return next(iter(self._tensors().values())).dtype

    def to(self, dtype: torch.dtype) -> ParamFactors:
        """The same factors in ``dtype`` (``self`` if they have it, else a copy)."""
        if dtype == self.dtype:
            return self
        return self.map_tensors(lambda tensor: tensor.to(dtype))

    def map_tensors(self, function: Callable[[Tensor], Tensor]) -> ParamFactors:
        """Each tensor ``t`` as ``function(t)``: a copy, or ``self`` if unchanged."""
        tensors = self._tensors()
        mapped = {name: function(value) for name, value in tensors.items()}
        if all(mapped[name] is value for name, value in tensors.items()):
            return self
        converted = copy.copy(self)
        for name, value in mapped.items():
            setattr(converted, name, value)
        return converted

    @abstractmethod
    def scaled(self, factor: float) -> ParamFactors:
        """New factors: the columns of ``V`` times ``factor`` (a block's ``√R``)."""

    @abstractmethod
    def gram(self, other: ParamFactors | None = None) -> Tensor:
        """Gram block ``Vᵀ V_other``, ``[self.num_rows, other.num_rows]``.

        ``other``: factors of the same parameter, possibly of other samples or vectors
        (e.g. per-sample gradients); ``None`` gives ``Vᵀ V``.
        """

    @abstractmethod
    def vmp(self, u: Tensor) -> Tensor:
        """``V u``, ``[K, *param_shape]``, for Gram-space rows ``[K, N·C]``."""

    @abstractmethod
    def vtmp(self, w: Tensor) -> Tensor:
        """``Vᵀ w``, ``[K, N·C]``, for parameter-space rows ``[K, *param_shape]``."""

    @abstractmethod
    def select(self, samples: Sequence[int]) -> ParamFactors:
        """The factors of the samples at positions ``samples``, in that order."""

    def product_work(self, num_vectors: int) -> int:
        """Multiply-adds of :meth:`vmp` and :meth:`vtmp` of ``num_vectors`` vectors."""
        return 2 * num_vectors * self.num_rows * self.param_shape.numel()

    def gram_work(self) -> int:
        """Multiply-adds of :meth:`gram` (``Vᵀ V``); default: of an explicit ``V``."""
        return self.num_rows**2 * self.param_shape.numel()

    def gram_memory(self) -> int:
        """Entries of the largest intermediate of :meth:`gram` (explicit ``V``: 0)."""
        return 0

    def product_memory(self, num_vectors: int) -> int:
        """Entries of the largest intermediate of :meth:`vmp` or :meth:`vtmp`."""
        return 0

    @abstractmethod
    def materialize(self) -> Tensor:
        """``Vᵀ`` formed explicitly, ``[N·C, p.numel()]``."""


class CompositeFactors(ParamFactors):
    """Factors made of other factors of the same parameter, :attr:`members`."""

    members: list[ParamFactors]

    def tensors(self) -> list[Tensor]:  # noqa: D102
        return [tensor for member in self.members for tensor in member.tensors()]

    @property
    def dtype(self) -> torch.dtype:  # noqa: D102
        return self.members[0].dtype

    def gram_memory(self) -> int:  # noqa: D102
        return max(member.gram_memory() for member in self.members)

    def product_memory(self, num_vectors: int) -> int:  # noqa: D102
        return max(member.product_memory(num_vectors) for member in self.members)

    def product_work(self, num_vectors: int) -> int:  # noqa: D102
        return sum(member.product_work(num_vectors) for member in self.members)


def summed(terms: Iterable[Tensor]) -> Tensor:
    """The sum of ``terms`` (at least one), added in place into the first."""
    terms = iter(terms)
    total = next(terms)
    for term in terms:
        total.add_(term)
    return total


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


def scaled_cat(tensors: Sequence[Tensor], scales: Sequence[float], dim: int) -> Tensor:
    """``torch.cat`` of ``scale · tensor`` without a scaled copy of each."""
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    result = tensors[0].new_empty(shape)
    start = 0
    for tensor, scale in zip(tensors, scales, strict=True):
        part = result.narrow(dim, start, tensor.shape[dim]).copy_(tensor)
        if scale != 1.0:
            part.mul_(scale)
        start += tensor.shape[dim]
    return result


def per_sample_projections(x: Tensor, vectors: Tensor) -> Tensor:
    """``y[k, n, c] = Σ_f x[k, n, f] · vectors[c, n, f]``, ``[K, N, C]``.

    ``x`` ``[K, N, *F]``, ``vectors`` ``[C, N, *F]``. One batched product on strided
    views, where ``torch.einsum`` would copy ``vectors`` on every call.
    """
    K, N, C = x.shape[0], x.shape[1], vectors.shape[0]
    per_sample = x.reshape(K, N, -1).transpose(0, 1)
    columns = vectors.reshape(C, N, -1).permute(1, 2, 0)
    return torch.bmm(per_sample, columns).transpose(0, 1)
