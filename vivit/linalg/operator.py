"""The GGN ``G`` of a parameter group and its pseudo-inverse as operators, never formed.

Also as :class:`scipy.sparse.linalg.LinearOperator`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy
import torch
from scipy.sparse.linalg import LinearOperator
from torch import Tensor
from torch.nn import Parameter

from vivit._validation import check_finite
from vivit.errors import InvalidArgumentError
from vivit.linalg.group_products import VProducts

#: ``(top_k, solver) → (evals [K], directions)``: the leading numerically non-zero
#: eigenpairs, the directions as the products take them (Gram eigenvectors
#: ``[N·C, K]``, or parameter-space eigenvectors ``[D, K]``).
Eigenpairs = Callable[[int | None, str | None], tuple[Tensor, Tensor]]


class OperatorProducts(Protocol):
    """``G w`` and ``G_K⁺ w = Σ_k e_k e_kᵀ w / λ_k`` (:data:`Eigenpairs`) of a group.

    Vectors: one ``[K, *p.shape]`` per parameter.
    """

    dtype: torch.dtype  # the type the products run in

    def ggn_matmul(self, vectors: Sequence[Tensor]) -> list[Tensor]: ...  # noqa: D102

    def pinv_matmul(  # noqa: D102
        self, vectors: Sequence[Tensor], evals: Tensor, directions: Tensor
    ) -> list[Tensor]: ...


class GramSpaceProducts:
    """:class:`OperatorProducts` through the group's products with ``V``."""

    def __init__(self, products: VProducts):
        self._products = products
        self.dtype = products.dtype

    def ggn_matmul(self, vectors: Sequence[Tensor]) -> list[Tensor]:  # noqa: D102
        return self._products.v_matmul(self._products.vt_matmul(vectors))

    def pinv_matmul(  # noqa: D102
        self, vectors: Sequence[Tensor], evals: Tensor, directions: Tensor
    ) -> list[Tensor]:
        # in float64: λ² underflows float32 for small resolved eigenvalues
        products = self._products.vt_matmul(vectors)
        projections = products.double() @ directions.double()
        scales = evals.double() ** -2
        coefficients = (projections * scales) @ directions.double().T
        return self._products.v_matmul(coefficients.to(products.dtype))


class GGNOperator:
    """``G`` of one parameter group, applied through products; never formed.

    Vectors are flat over the group's parameters (each flattened row-major, in the
    group's order), ``[D]`` or ``[D, K]``, or one tensor per parameter, ``p.shape``
    or ``[K, *p.shape]``. From :meth:`vivit.LowRankGGN.operator` or
    :meth:`vivit.StreamingGGN.operator` (``products``, the group's ``params`` and
    ``eigenpairs`` for :meth:`pinv_matvec`). For a model sharded with FSDP2,
    ``DTensor`` vectors are gathered and their results sharded alike (``gather``,
    ``place``: ``docs/math.rst``, "Models sharded with FSDP2").

    Attributes:
        shape: ``(D, D)``.
        dtype: Data type of the vectors and results (the parameters'); the
            products run in their own type (``gram_dtype`` if one was given).
        device: Their device.
    """

    def __init__(
        self,
        products: OperatorProducts,
        params: Sequence[Parameter],
        eigenpairs: Eigenpairs,
        gather: Callable[[Tensor], Tensor] | None = None,
        place: Callable[[list[Tensor], int], list[Tensor]] | None = None,
    ):
        self._products = products
        self._gather, self._place = gather, place
        self._shapes = [p.shape for p in params]
        self._eigenpairs = eigenpairs
        size = sum(p.numel() for p in params)
        self.shape = (size, size)
        self.dtype = params[0].dtype
        self.device = params[0].device

    def matvec(self, vectors: Tensor | Sequence[Tensor]) -> Tensor | list[Tensor]:
        """``G v`` in the format of ``vectors`` (see :class:`GGNOperator`)."""
        rows, restore = self._to_rows(vectors)
        return restore(self._products.ggn_matmul(rows))

    def pinv_matvec(
        self,
        vectors: Tensor | Sequence[Tensor],
        top_k: int | None = None,
        solver: str | None = None,
    ) -> Tensor | list[Tensor]:
        """``G_K⁺ v = Σ_k e_k e_kᵀ v / λ_k``, in the format of ``vectors``.

        Args:
            vectors: As for :meth:`matvec`.
            top_k: Number ``K`` of leading eigenpairs (``None``: every eigenvalue
                above the numerical-zero tolerance, the pseudo-inverse of ``G``).
            solver: Eigensolver for ``top_k`` pairs (``None``: the one of the
                :class:`~vivit.LowRankGGN`).

        Raises:
            NonFiniteError: If eigenvalues too small for the products' type make
                it overflow.
        """
        evals, directions = self._eigenpairs(top_k, solver)
        rows, restore = self._to_rows(vectors)
        result = self._products.pinv_matmul(rows, evals, directions)
        for part in result:
            check_finite(
                part,
                "G⁺ v (eigenvalues too small for the data type: use gram_dtype="
                "torch.float64 or a smaller top_k)",
                batch_axis=False,
            )
        return restore(result)

    def to_scipy(self) -> LinearOperator:
        """``G`` as a symmetric ``LinearOperator`` ``(D, D)`` on flat NumPy vectors."""
        return self._scipy(self.matvec)

    def pinv_to_scipy(
        self, top_k: int | None = None, solver: str | None = None
    ) -> LinearOperator:
        """``G_K⁺`` (:meth:`pinv_matvec`) as a symmetric ``LinearOperator``."""
        self._eigenpairs(top_k, solver)  # compute (and check) the eigenpairs now
        return self._scipy(lambda v: self.pinv_matvec(v, top_k, solver))

    def _scipy(self, apply: Callable[[Tensor], Tensor]) -> LinearOperator:
        def real_matmat(array: numpy.ndarray) -> numpy.ndarray:
            array = numpy.ascontiguousarray(array)  # torch takes no negative strides
            vectors = torch.as_tensor(array, device=self.device)
            return apply(vectors.to(self.dtype)).cpu().numpy()

        def matmat(array: numpy.ndarray) -> numpy.ndarray:
            array = numpy.asarray(array)
            if numpy.iscomplexobj(array):  # a real operator: G (a + ib) = Ga + iGb
                return real_matmat(array.real) + 1j * real_matmat(array.imag)
            return real_matmat(array)

        dtype = torch.empty((), dtype=self.dtype).numpy().dtype
        symmetric = dict.fromkeys(("matvec", "rmatvec", "matmat", "rmatmat"), matmat)
        return LinearOperator(self.shape, dtype=dtype, **symmetric)

    def _to_rows(
        self, vectors: Tensor | Sequence[Tensor]
    ) -> tuple[list[Tensor], Callable[[list[Tensor]], Tensor | list[Tensor]]]:
        """Rows ``[K, *p.shape]`` in the products' type, and the way back."""
        size = self.shape[0]
        expected = [tuple(shape) for shape in self._shapes]
        sharded = False  # DTensor rows (an FSDP2 model's), gathered
        if isinstance(vectors, Tensor):
            if vectors.ndim not in (1, 2) or vectors.shape[0] != size:
                raise InvalidArgumentError(
                    f"Expected a flat vector [{size}] or vectors [{size}, K] over "
                    f"the group's {size} parameters, got {tuple(vectors.shape)}."
                )
            single = vectors.ndim == 1
            columns = vectors.reshape(size, -1).to(self.dtype)
            chunks = columns.split([shape.numel() for shape in self._shapes])
            rows = [c.T.reshape(-1, *s) for c, s in zip(chunks, expected, strict=True)]

            def restore(result: list[Tensor]) -> Tensor:
                flat = torch.cat([r.reshape(r.shape[0], -1) for r in result], 1).T
                return flat.squeeze(1) if single else flat

        else:
            given = [torch.as_tensor(v) for v in vectors]
            whole = [v if self._gather is None else self._gather(v) for v in given]
            sharded = any(w is not v for w, v in zip(whole, given, strict=True))
            rows = [v.to(self.dtype) for v in whole]
            shapes = [tuple(v.shape) for v in rows]
            batched = [s[1:] for s in shapes] == expected
            if shapes == expected:
                rows = [v.unsqueeze(0) for v in rows]
                restore = lambda r: [t[0] for t in r]  # noqa: E731
            elif batched and len({s[:1] for s in shapes}) == 1:  # one K for all
                restore = list
            else:
                raise InvalidArgumentError(
                    f"Expected one tensor per parameter of the group with shapes "
                    f"{expected} (optionally with a leading axis K), got {shapes}."
                )
        rows = [row.to(self._products.dtype) for row in rows]
        if sharded:  # as sharded as they came
            leading = int(shapes != expected)
            return rows, lambda result: self._place(
                restore([r.to(self.dtype) for r in result]), leading
            )
        return rows, lambda result: restore([r.to(self.dtype) for r in result])
