"""BackPACK derivatives that keep the floating-point type of what they propagate.

BackPACK 1.7.1 builds the averaging kernel of ``AvgPool{1,2,3}d`` and the one-hot
matrix of ``Embedding`` in torch's *default* dtype, so float64 fails in them
("expected scalar type Double but found Float").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
from backpack.core.derivatives.avgpool1d import AvgPool1DDerivatives
from backpack.core.derivatives.avgpool2d import AvgPool2DDerivatives
from backpack.core.derivatives.avgpool3d import AvgPool3DDerivatives
from backpack.core.derivatives.basederivatives import BaseDerivatives
from backpack.extensions.mat_to_mat_jac_base import MatToJacMat
from torch import Tensor
from torch.nn import AvgPool1d, AvgPool2d, AvgPool3d, Module


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@cache
def dtype_safe(derivatives: type[BaseDerivatives]) -> type[BaseDerivatives]:
    """Sub-class a derivatives class: its products run in the dtype they multiply."""

    class DtypeSafe(derivatives):
        def jac_t_mat_prod(self, module, g_inp, g_out, mat: Tensor, **kwargs):
            with _default_dtype(mat.dtype):
                return super().jac_t_mat_prod(module, g_inp, g_out, mat, **kwargs)

        def param_mjp(self, param_str, module, g_inp, g_out, mat: Tensor, **kwargs):
            with _default_dtype(mat.dtype):
                return super().param_mjp(param_str, module, g_inp, g_out, mat, **kwargs)

    DtypeSafe.__name__ = DtypeSafe.__qualname__ = f"DtypeSafe{derivatives.__name__}"
    return DtypeSafe


def avg_pool_extensions() -> dict[type[Module], MatToJacMat]:
    """Dtype-safe module extensions of ``AvgPool{1,2,3}d``, keyed by layer class."""
    return {
        AvgPool1d: MatToJacMat(dtype_safe(AvgPool1DDerivatives)()),
        AvgPool2d: MatToJacMat(dtype_safe(AvgPool2DDerivatives)()),
        AvgPool3d: MatToJacMat(dtype_safe(AvgPool3DDerivatives)()),
    }
