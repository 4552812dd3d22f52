"""Which layer runs which module extension: the one list of what the engine supports.

Parameter-free layers keep BackPACK's ``SqrtGGN`` extensions, fixed where BackPACK
1.7.1 builds kernels in the default dtype or recomputes a max pooling's argmax.
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
from backpack.core.derivatives.conv1d import Conv1DDerivatives
from backpack.core.derivatives.conv2d import Conv2DDerivatives
from backpack.core.derivatives.conv3d import Conv3DDerivatives
from backpack.core.derivatives.conv_transpose1d import ConvTranspose1DDerivatives
from backpack.core.derivatives.conv_transpose2d import ConvTranspose2DDerivatives
from backpack.core.derivatives.conv_transpose3d import ConvTranspose3DDerivatives
from backpack.core.derivatives.embedding import EmbeddingDerivatives
from backpack.core.derivatives.maxpool1d import MaxPool1DDerivatives
from backpack.core.derivatives.maxpool2d import MaxPool2DDerivatives
from backpack.core.derivatives.maxpool3d import MaxPool3DDerivatives
from backpack.core.derivatives.maxpoolnd import MaxPoolNDDerivatives
from backpack.custom_module.branching import SumModule
from backpack.custom_module.pad import Pad
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing
from backpack.extensions.mat_to_mat_jac_base import MatToJacMat
from backpack.extensions.module_extension import ModuleExtension
from backpack.extensions.secondorder.sqrt_ggn import (
    activations,
    custom_module,
    dropout,
    flatten,
    pad,
    padding,
    slicing,
)
from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule
from backpack.utils.subsampling import subsample
from torch import Tensor, nn
from torch.nn import Module

from vivit.engines.backpack.layers import (
    GramBatchNormNd,
    GramConvNd,
    GramLinear,
    GramLoss,
    GramParamsExtension,
)
from vivit.losses import SUPPORTED_LOSSES

#: Attribute under which a max-pooling layer keeps ``(output, argmax indices)``.
POOL_INDICES = "vivit_pool_indices"

MAX_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Set torch's default dtype inside (BackPACK builds AvgPool's kernels in it)."""
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
            with default_dtype(mat.dtype):
                return super().jac_t_mat_prod(module, g_inp, g_out, mat, **kwargs)

        def param_mjp(self, param_str, module, g_inp, g_out, mat: Tensor, **kwargs):
            with default_dtype(mat.dtype):
                return super().param_mjp(param_str, module, g_inp, g_out, mat, **kwargs)

    DtypeSafe.__name__ = DtypeSafe.__qualname__ = f"DtypeSafe{derivatives.__name__}"
    return DtypeSafe


def store_pool_indices(module: Module, inputs: tuple[Tensor, ...], output: Tensor):
    """Forward hook: keep the argmax indices autograd saved for a max pooling."""
    if not isinstance(module, MAX_POOLS) or output.grad_fn is None:
        return
    indices = getattr(output.grad_fn, "_saved_result1", None)
    if isinstance(indices, Tensor) and indices.shape == output.shape:
        setattr(module, POOL_INDICES, (output, indices))


@cache
def saved_index(derivatives: type[MaxPoolNDDerivatives]) -> type[MaxPoolNDDerivatives]:
    """Sub-class max-pooling derivatives to take the forward's indices where stored."""

    class SavedIndexMaxPool(derivatives):
        def get_pooling_idx(self, module, subsampling=None) -> Tensor:
            saved = getattr(module, POOL_INDICES, None)
            if saved is None or saved[0] is not module.output:
                return super().get_pooling_idx(module, subsampling=subsampling)
            return subsample(saved[1], subsampling=subsampling)

    SavedIndexMaxPool.__name__ = SavedIndexMaxPool.__qualname__ = (
        f"SavedIndex{derivatives.__name__}"
    )
    return SavedIndexMaxPool


def module_extensions() -> dict[type[Module], ModuleExtension]:
    """A fresh module table: layer class (exact type, not sub-classes) to extension."""
    batch_norm = GramBatchNormNd()
    return {
        **{loss: GramLoss() for loss in SUPPORTED_LOSSES},
        nn.Linear: GramLinear(),
        nn.Conv1d: GramConvNd(Conv1DDerivatives()),
        nn.Conv2d: GramConvNd(Conv2DDerivatives()),
        nn.Conv3d: GramConvNd(Conv3DDerivatives()),
        nn.BatchNorm1d: batch_norm,
        nn.BatchNorm2d: batch_norm,
        nn.BatchNorm3d: batch_norm,
        nn.ConvTranspose1d: GramParamsExtension(ConvTranspose1DDerivatives()),
        nn.ConvTranspose2d: GramParamsExtension(ConvTranspose2DDerivatives()),
        nn.ConvTranspose3d: GramParamsExtension(ConvTranspose3DDerivatives()),
        nn.Embedding: GramParamsExtension(
            dtype_safe(EmbeddingDerivatives)(), ("weight",)
        ),
        nn.AvgPool1d: MatToJacMat(dtype_safe(AvgPool1DDerivatives)()),
        nn.AvgPool2d: MatToJacMat(dtype_safe(AvgPool2DDerivatives)()),
        nn.AvgPool3d: MatToJacMat(dtype_safe(AvgPool3DDerivatives)()),
        nn.MaxPool1d: SqrtGGNBaseModule(saved_index(MaxPool1DDerivatives)()),
        nn.MaxPool2d: SqrtGGNBaseModule(saved_index(MaxPool2DDerivatives)()),
        nn.MaxPool3d: SqrtGGNBaseModule(saved_index(MaxPool3DDerivatives)()),
        nn.ZeroPad2d: padding.SqrtGGNZeroPad2d(),
        nn.Dropout: dropout.SqrtGGNDropout(),
        nn.Flatten: flatten.SqrtGGNFlatten(),
        nn.ReLU: activations.SqrtGGNReLU(),
        nn.Sigmoid: activations.SqrtGGNSigmoid(),
        nn.Tanh: activations.SqrtGGNTanh(),
        nn.LeakyReLU: activations.SqrtGGNLeakyReLU(),
        nn.LogSigmoid: activations.SqrtGGNLogSigmoid(),
        nn.ELU: activations.SqrtGGNELU(),
        nn.SELU: activations.SqrtGGNSELU(),
        nn.Identity: custom_module.SqrtGGNScaleModule(),
        ScaleModule: custom_module.SqrtGGNScaleModule(),
        SumModule: custom_module.SqrtGGNSumModule(),
        Pad: pad.SqrtGGNPad(),
        Slicing: slicing.SqrtGGNSlicing(),
    }


@cache
def supported_types() -> frozenset[type[Module]]:
    """Layer and loss classes the engine supports (:func:`module_extensions`)."""
    return frozenset(module_extensions())


def supported_layer_names() -> str:
    """The supported layer classes' names (no losses), sorted, for error messages."""
    layers = supported_types() - set(SUPPORTED_LOSSES)
    return ", ".join(sorted(cls.__name__ for cls in layers))
