"""Module extensions of the loss and of layers with parameters: save factors, not ``V``.

Linear and convolution weights keep layer input and backpropagated vectors; every
other parameter gets its columns of ``V`` from BackPACK's ``param_mjp``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from backpack.core.derivatives.basederivatives import BaseDerivatives
from backpack.core.derivatives.batchnorm_nd import BatchNormNdDerivatives
from backpack.core.derivatives.linear import LinearDerivatives
from backpack.extensions.mat_to_mat_jac_base import MatToJacMat
from backpack.extensions.module_extension import ModuleExtension
from backpack.utils.conv import unfold_input
from backpack.utils.subsampling import subsample
from torch import Tensor
from torch.nn import Module

from vivit._validation import check_batch_norm
from vivit.engines.base import ParamContribution
from vivit.engines.func.capture import grouped_patches, grouped_vectors
from vivit.errors import InvalidTargetsError
from vivit.gram import DenseFactors, OuterProductFactors
from vivit.gram.outer import GGN_COMPACT_RATIO
from vivit.losses import LossCurvature

if TYPE_CHECKING:
    from vivit.engines.backpack.extension import GramGGN

#: A weight's inputs ``[N, G, T, P]`` and what turns vectors ``[V, N, *out]`` into
#: ``[V, N, G, T, O]``.
Layout = tuple[Tensor, Callable[[Tensor], Tensor]]


class GramLoss(ModuleExtension):
    """Start the backward pass at a loss module (``docs/math.rst``, "Losses")."""

    def backpropagate(self, ext, module, grad_inp, grad_out, backproped) -> Tensor:
        """``√R_S · S_n`` of the active samples, ``[K, |S|, *out]``.

        Raises:
            InvalidTargetsError: If the loss was called without targets.
        """
        if not hasattr(module, "input1"):
            raise InvalidTargetsError(
                f"{type(module).__name__} was called without targets as its second "
                "positional argument: call loss_func(output, targets)."
            )
        curvature = LossCurvature(module, module.input0, module.input1)
        ext.start_batch(module, curvature)
        return curvature.sqrt_hessian(
            ext.get_subsampling(), ext.get_num_mc_samples(), mc_per=ext.request.mc_per
        )


class GramParamsExtension(MatToJacMat):
    """Backpropagate like BackPACK's SqrtGGN; save each parameter's contribution."""

    def __init__(
        self, derivatives: BaseDerivatives, params: tuple[str, ...] = ("weight", "bias")
    ):
        for name in params:
            setattr(self, name, partial(self._contribution, name))
        super().__init__(derivatives, params=list(params))

    def weight_layout(self, module: Module) -> Layout | None:
        """The weight's factor layout; ``None``: explicit columns."""
        return None

    def _contribution(
        self,
        param_str: str,
        ext: GramGGN,
        module: Module,
        g_inp: tuple[Tensor, ...],
        g_out: tuple[Tensor, ...],
        backproped: Tensor,
    ) -> ParamContribution:
        """``backproped``: ``√R · J_outᵀ s`` at the layer output, ``[C, |S|, *out]``."""
        batch = ext.current_batch(module)
        scale = batch.per_sample_gradient_scale
        subsampling, grad = ext.get_subsampling(), None
        with torch.no_grad():  # the layer input is part of the forward graph
            layout = self.weight_layout(module) if param_str == "weight" else None
            if layout is not None:
                inputs, positions = layout
                shape = module.weight.shape
                active = subsample(inputs, subsampling=subsampling)
                ggn = OuterProductFactors(active, positions(backproped), shape)
                ggn = ggn.compact(GGN_COMPACT_RATIO)
                if ext.request.compute_gradients:
                    out = positions(g_out[0].unsqueeze(0) * scale)
                    grad = OuterProductFactors(inputs, out, shape).compact()
            else:
                mjp = partial(
                    self.derivatives.param_mjp, param_str, module, g_inp, g_out
                )
                columns = mjp(backproped, sum_batch=False, subsampling=subsampling)
                ggn = DenseFactors(columns.transpose(0, 1))
                if ext.request.compute_gradients:
                    grads = mjp(g_out[0].unsqueeze(0), sum_batch=False)
                    grad = DenseFactors(grads.transpose(0, 1) * scale)
        return ParamContribution(ggn=ggn, grad=grad, batch=batch)


class GramLinear(GramParamsExtension):
    """``torch.nn.Linear``, also on inputs with extra axes ``[N, *T, I]``."""

    def __init__(self):
        super().__init__(LinearDerivatives())

    def weight_layout(self, module: Module) -> Layout:  # noqa: D102
        inputs = module.input0.reshape(
            module.input0.shape[0], 1, -1, module.in_features
        )
        return inputs, lambda out: out.reshape(*out.shape[:2], 1, -1, out.shape[-1])


class GramConvNd(GramParamsExtension):
    """``torch.nn.Conv{1,2,3}d``: integer zero padding, any stride, dilation, groups."""

    def weight_layout(self, module: Module) -> Layout:  # noqa: D102
        groups = module.groups
        inputs = grouped_patches(unfold_input(module, module.input0), groups)
        features = module.out_channels // groups
        return inputs, partial(grouped_vectors, groups=groups, features=features)


class GramBatchNormNd(GramParamsExtension):
    """``torch.nn.BatchNorm{1,2,3}d`` in evaluation mode, with running statistics."""

    def __init__(self):
        super().__init__(BatchNormNdDerivatives())

    def check_hyperparameters_module_extension(self, ext, module, g_inp, g_out):  # noqa: D102
        check_batch_norm(module)
