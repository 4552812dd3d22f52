"""The interface shared by every representation of a parameter's columns of ``V``."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


class ParamFactors(ABC):
    """The columns of the GGN square root ``V`` that belong to one parameter.

    ``V`` restricted to a parameter ``p`` is a ``[p.numel(), N * C]`` matrix whose
    column ``n * C + c`` is ``√R · J_nᵀ s_nc`` (``docs/math.rst``). Sub-classes keep it
    in whatever form is cheapest for the layer and implement the products on it.

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
        return {
            name: value
            for name, value in vars(self).items()
            if isinstance(value, Tensor) and value.is_floating_point()
        }

    def tensors(self) -> list[Tensor]:
        """The tensors that hold the factors (their memory is what the factors keep).

        Returns:
            The floating-point tensors, possibly views of larger storages.
        """
        return list(self._tensors().values())

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point type of the factors."""
        return next(iter(self._tensors().values())).dtype

    def to(self, dtype: torch.dtype) -> ParamFactors:
        """The same factors in another floating-point type.

        Every product of the result runs in ``dtype``: float32 factors cast to
        float64 give the Gram matrix of the float32 ``V`` to float64 rounding
        (``docs/math.rst``, "Precision and the numerical zero").

        Args:
            dtype: Target floating-point type.

        Returns:
            ``self`` if it already has that type, else a converted copy.
        """
        if dtype == self.dtype:
            return self
        return self.map_tensors(lambda tensor: tensor.to(dtype))

    def map_tensors(self, function: Callable[[Tensor], Tensor]) -> ParamFactors:
        """The same factors with every tensor replaced by ``function(tensor)``.

        Args:
            function: Maps a tensor of the factors to one of the same shape (a
                cast, a copy).

        Returns:
            ``self`` if ``function`` returns every tensor itself, else a shallow
            copy holding the new tensors.
        """
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
        """The columns of ``V`` multiplied by a scalar.

        Rescales the ``√R`` of a block of samples to that of a larger set of
        samples (``docs/math.rst``, "Data sets and processes").

        Args:
            factor: The scalar.

        Returns:
            New factors; ``self`` is left as it is.
        """

    @abstractmethod
    def gram(self, other: ParamFactors | None = None) -> Tensor:
        """Gram block ``Vᵀ V_other`` (``Vᵀ V`` if ``other`` is ``None``).

        Args:
            other: Factors of the same parameter, possibly of other samples or other
                backpropagated vectors (e.g. per-sample gradients).

        Returns:
            Tensor of shape ``[self.num_rows, other.num_rows]``.
        """

    @abstractmethod
    def vmp(self, u: Tensor) -> Tensor:
        """Multiply ``V`` onto vectors in Gram space.

        Args:
            u: Stacked vectors, shape ``[K, N * C]``.

        Returns:
            ``V u`` in parameter shape, ``[K, *param_shape]``.
        """

    @abstractmethod
    def vtmp(self, w: Tensor) -> Tensor:
        """Multiply ``Vᵀ`` onto vectors in parameter space.

        Args:
            w: Stacked vectors in parameter shape, ``[K, *param_shape]``.

        Returns:
            ``Vᵀ w``, shape ``[K, N * C]``.
        """

    @abstractmethod
    def select(self, samples: Sequence[int]) -> ParamFactors:
        """Restrict to a block of samples.

        Args:
            samples: Positions (into this object's samples) to keep, in order.

        Returns:
            Factors holding only the columns of the selected samples.
        """

    def product_work(self, num_vectors: int) -> int:
        """Multiply-adds of :meth:`vmp` and :meth:`vtmp` with ``K`` vectors each.

        Used by the eigensolvers' cost model (:mod:`vivit.linalg.top_k`). The
        default is that of an explicit ``V``: ``2·K·N·C·numel``.

        Args:
            num_vectors: ``K``.

        Returns:
            The multiply-adds of both products together.
        """
        return 2 * num_vectors * self.num_rows * self.param_shape.numel()

    def gram_work(self) -> int:
        """Multiply-adds of :meth:`gram` (``Vᵀ V``).

        The default is that of an explicit ``V`` (``R²·numel``; the lower
        triangle alone is about half of it for large ``R``).

        Returns:
            The multiply-adds.
        """
        return self.num_rows**2 * self.param_shape.numel()

    @abstractmethod
    def materialize(self) -> Tensor:
        """Form the columns of ``V`` explicitly.

        Returns:
            ``Vᵀ`` as a ``[N * C, p.numel()]`` matrix.
        """


def per_sample_projections(x: Tensor, vectors: Tensor) -> Tensor:
    """``y[k, n, c] = Σ_f x[k, n, f] · vectors[c, n, f]``: each sample's columns.

    One batched matrix product over the samples on strided views of both
    operands. ``torch.einsum`` copies ``vectors`` into a sample-major layout for
    this contraction on every call: 13.4 s of a language model's 21 s
    matrix-free solve (``benchmarks/README.md``, "MC-1 on language models").

    Args:
        x: ``[K, N, *F]``, ``K`` vectors in the per-sample feature space.
        vectors: ``[C, N, *F]``, the backpropagated vectors of every sample.

    Returns:
        ``[K, N, C]``.
    """
    K, N, C = x.shape[0], x.shape[1], vectors.shape[0]
    per_sample = x.reshape(K, N, -1).transpose(0, 1)
    columns = vectors.reshape(C, N, -1).permute(1, 2, 0)
    return torch.bmm(per_sample, columns).transpose(0, 1)
