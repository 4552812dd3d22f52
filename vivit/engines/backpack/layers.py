"""Module extensions of layers with parameters: save factors, not ``V``.

Linear and convolution weights keep layer input and backpropagated vectors
(:class:`~vivit.gram.OuterProductFactors`, ``V`` itself where that is smaller); every
other parameter gets its columns of ``V`` from BackPACK's ``param_mjp``. None keeps
BackPACK's own SqrtGGN extension, which would leave a raw ``V`` where a
contribution is expected.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from backpack.core.derivatives.basederivatives import BaseDerivatives
from backpack.core.derivatives.batchnorm_nd import BatchNormNdDerivatives
from backpack.core.derivatives.conv1d import Conv1DDerivatives
from backpack.core.derivatives.conv2d import Conv2DDerivatives
from backpack.core.derivatives.conv3d import Conv3DDerivatives
from backpack.core.derivatives.conv_transpose1d import ConvTranspose1DDerivatives
from backpack.core.derivatives.conv_transpose2d import ConvTranspose2DDerivatives
from backpack.core.derivatives.conv_transpose3d import ConvTranspose3DDerivatives
from backpack.core.derivatives.embedding import EmbeddingDerivatives
from backpack.core.derivatives.linear import LinearDerivatives
from backpack.extensions.mat_to_mat_jac_base import MatToJacMat
from backpack.utils.conv import unfold_input
from backpack.utils.subsampling import subsample
from torch import Tensor
from torch.nn import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Embedding,
    Linear,
    Module,
)

from vivit._validation import check_batch_norm
from vivit.engines.backpack.dtype import dtype_safe
from vivit.engines.base import ParamContribution
from vivit.errors import UnsupportedLayerError
from vivit.gram import DenseFactors, OuterProductFactors, ParamFactors
from vivit.gram.outer import GGN_COMPACT_RATIO

if TYPE_CHECKING:
    from vivit.engines.backpack.extension import GramGGN

#: Parameter names of layers with a weight and a bias.
PARAMS = ["weight", "bias"]


class GramParamsExtension(MatToJacMat):
    """Backpropagate like BackPACK's SqrtGGN; save each parameter's contribution.

    Sub-classes override :meth:`factors` for parameters with a factor form.
    """

    def __init__(self, derivatives: BaseDerivatives, params: list[str]):
        for name in params:
            setattr(self, name, partial(self._contribution, name))
        super().__init__(derivatives, params=params)

    def _contribution(
        self,
        param_str: str,
        ext: GramGGN,
        module: Module,
        g_inp: tuple[Tensor, ...],
        g_out: tuple[Tensor, ...],
        backproped: Tensor,
    ) -> ParamContribution:
        batch = ext.current_batch(module)
        with torch.no_grad():  # the layer input is part of the forward graph
            ggn, grad = self.factors(param_str, ext, module, g_inp, g_out, backproped)
        return ParamContribution(ggn=ggn, grad=grad, batch=batch)

    def factors(
        self,
        param_str: str,
        ext: GramGGN,
        module: Module,
        g_inp: tuple[Tensor, ...],
        g_out: tuple[Tensor, ...],
        backproped: Tensor,
    ) -> tuple[ParamFactors, ParamFactors | None]:
        """Columns of ``V`` and (if the extension asks) per-sample gradients.

        ``backproped`` is ``√R · J_outᵀ s`` at the layer output, ``[C, |S|, *out]``.

        Returns:
            Factors of ``V`` (active samples) and of the per-sample gradients (all
            samples, one column each), or ``None`` for the latter.
        """
        columns = self.derivatives.param_mjp(
            param_str,
            module,
            g_inp,
            g_out,
            backproped,
            sum_batch=False,
            subsampling=ext.get_subsampling(),
        )
        ggn = DenseFactors(columns.transpose(0, 1))
        if not ext.compute_gradients:
            return ggn, None
        grads = self.derivatives.param_mjp(
            param_str, module, g_inp, g_out, g_out[0].unsqueeze(0), sum_batch=False
        )
        scale = ext.current_batch(module).per_sample_gradient_scale
        return ggn, DenseFactors(grads.transpose(0, 1) * scale)


class GramLinear(GramParamsExtension):
    """``torch.nn.Linear``, also on inputs with extra axes ``[N, *T, I]``."""

    def __init__(self):
        super().__init__(LinearDerivatives(), PARAMS)

    def factors(self, param_str, ext, module, g_inp, g_out, backproped):  # noqa: D102
        if param_str != "weight":
            return super().factors(param_str, ext, module, g_inp, g_out, backproped)
        inputs = module.input0.reshape(
            module.input0.shape[0], 1, -1, module.in_features
        )
        return _outer_factors(ext, module, inputs, backproped, g_out, _linear_positions)


class GramConvNd(GramParamsExtension):
    """``torch.nn.Conv{1,2,3}d``: integer zero padding, any stride, dilation, groups."""

    def __init__(self, derivatives: BaseDerivatives):
        super().__init__(derivatives, PARAMS)

    def check_hyperparameters_module_extension(self, ext, module, g_inp, g_out):  # noqa: D102
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise UnsupportedLayerError(
                f"{module} is not supported: BackPACK's convolution derivatives "
                "assume explicit zero padding and give wrong results or fail for "
                f"padding={module.padding!r}, padding_mode={module.padding_mode!r}. "
                "Use integer padding with padding_mode='zeros' (padding='same' is "
                "padding=kernel_size // 2 for odd kernels and stride 1; 'valid' is "
                "padding=0), or pad explicitly before the convolution."
            )

    def factors(self, param_str, ext, module, g_inp, g_out, backproped):  # noqa: D102
        if param_str != "weight":
            return super().factors(param_str, ext, module, g_inp, g_out, backproped)
        unfolded = unfold_input(module, module.input0)  # [N, I·k, T]
        groups = module.groups
        inputs = unfolded.reshape(unfolded.shape[0], groups, -1, unfolded.shape[-1])
        inputs = inputs.transpose(2, 3)  # [N, G, T, P]
        return _outer_factors(
            ext,
            module,
            inputs,
            backproped,
            g_out,
            partial(_conv_positions, groups=groups),
        )


class GramBatchNormNd(GramParamsExtension):
    """``torch.nn.BatchNorm{1,2,3}d`` in evaluation mode, with running statistics."""

    def __init__(self):
        super().__init__(BatchNormNdDerivatives(), PARAMS)

    def check_hyperparameters_module_extension(self, ext, module, g_inp, g_out):  # noqa: D102
        check_batch_norm(module)


def _linear_positions(outputs: Tensor, num_vectors: int, num_samples: int) -> Tensor:
    """Reshape ``[V, N, *T, O]`` to ``[V, N, 1, T, O]``."""
    return outputs.reshape(num_vectors, num_samples, 1, -1, outputs.shape[-1])


def _conv_positions(
    outputs: Tensor, num_vectors: int, num_samples: int, groups: int
) -> Tensor:
    """Reshape ``[V, N, G·O, *spatial]`` to ``[V, N, G, T, O]``."""
    outputs = outputs.reshape(
        num_vectors, num_samples, groups, -1, outputs[0, 0, 0].numel()
    )
    return outputs.transpose(3, 4)


def _outer_factors(
    ext: GramGGN,
    module: Module,
    inputs: Tensor,
    backproped: Tensor,
    g_out: tuple[Tensor, ...],
    positions,
) -> tuple[ParamFactors, ParamFactors | None]:
    """Weight factors from inputs ``[N, G, T, P]`` and vectors ``[C, |S|, *out]``.

    ``positions`` reshapes ``[V, N, *out]`` to ``[V, N, G, T, O]``.
    """
    shape = module.weight.shape
    num_columns, num_active = backproped.shape[:2]
    active = subsample(inputs, subsampling=ext.get_subsampling())
    ggn = OuterProductFactors(
        active, positions(backproped, num_columns, num_active), shape
    ).compact(GGN_COMPACT_RATIO)
    if not ext.compute_gradients:
        return ggn, None
    scale = ext.current_batch(module).per_sample_gradient_scale
    grad_out = g_out[0].unsqueeze(0) * scale
    grad = OuterProductFactors(inputs, positions(grad_out, 1, inputs.shape[0]), shape)
    return ggn, grad.compact()


def param_layer_extensions() -> dict[type[Module], GramParamsExtension]:
    """Module extensions of every supported layer with parameters, by layer class."""
    batch_norm = GramBatchNormNd()
    return {
        Linear: GramLinear(),
        Conv1d: GramConvNd(Conv1DDerivatives()),
        Conv2d: GramConvNd(Conv2DDerivatives()),
        Conv3d: GramConvNd(Conv3DDerivatives()),
        BatchNorm1d: batch_norm,
        BatchNorm2d: batch_norm,
        BatchNorm3d: batch_norm,
        ConvTranspose1d: GramParamsExtension(ConvTranspose1DDerivatives(), PARAMS),
        ConvTranspose2d: GramParamsExtension(ConvTranspose2DDerivatives(), PARAMS),
        ConvTranspose3d: GramParamsExtension(ConvTranspose3DDerivatives(), PARAMS),
        Embedding: GramParamsExtension(dtype_safe(EmbeddingDerivatives)(), ["weight"]),
    }
