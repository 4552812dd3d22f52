"""Average pooling whose backpropagation keeps the input's floating-point type.

BackPACK 1.7.1 builds the (transposed) convolution behind the average-pooling
Jacobian in the default dtype, so float64 backpropagation through ``AvgPool{1,2,3}d``
fails with "expected scalar type Double but found Float". These derivatives build it
in the dtype of the backpropagated matrix.
"""

from __future__ import annotations

from backpack.core.derivatives.avgpoolnd import AvgPoolNDDerivatives
from backpack.extensions.mat_to_mat_jac_base import MatToJacMat
from torch import Tensor, get_default_dtype, set_default_dtype
from torch.nn import AvgPool1d, AvgPool2d, AvgPool3d, Module


class _DtypeSafeAvgPoolDerivatives(AvgPoolNDDerivatives):
    def _jac_t_mat_prod(
        self,
        module: Module,
        g_inp: tuple[Tensor, ...],
        g_out: tuple[Tensor, ...],
        mat: Tensor,
        subsampling: list[int] | None = None,
    ) -> Tensor:
        default = get_default_dtype()
        set_default_dtype(mat.dtype)
        try:
            return super()._jac_t_mat_prod(module, g_inp, g_out, mat, subsampling)
        finally:
            set_default_dtype(default)


def avg_pool_extensions() -> dict[type[Module], MatToJacMat]:
    """Module extensions of average pooling, keyed by layer class.

    Returns:
        Mapping from ``AvgPool{1,2,3}d`` to dtype-safe module extensions.
    """
    return {
        layer: MatToJacMat(_DtypeSafeAvgPoolDerivatives(N=dim))
        for dim, layer in ((1, AvgPool1d), (2, AvgPool2d), (3, AvgPool3d))
    }
