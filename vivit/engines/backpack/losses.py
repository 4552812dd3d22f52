"""Loss module extension: the start of the backward pass and its scaling.

The loss-Hessian square root comes from :mod:`vivit.losses` (not from BackPACK's
loss derivatives), which handles every option of the supported loss modules
exactly (``ignore_index``, class weights, label smoothing, soft targets) and
scales by ``√R_S`` of the loss on the active samples ``S`` alone, so curvature
subsampling is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backpack.extensions.module_extension import ModuleExtension
from torch import Tensor
from torch.nn import Module

from vivit.errors import InvalidTargetsError
from vivit.losses import LossCurvature

if TYPE_CHECKING:
    from vivit.engines.backpack.extension import GramGGN


class GramLoss(ModuleExtension):
    """Start the backward pass of a supported ``torch.nn`` loss module."""

    def backpropagate(
        self,
        ext: GramGGN,
        module: Module,
        grad_inp: tuple[Tensor, ...],
        grad_out: tuple[Tensor, ...],
        backproped: None,
    ) -> Tensor:
        """Return ``√R_S · S_n`` for the active samples, shape ``[K, |S|, *out]``.

        Args:
            ext: The running extension.
            module: The loss module (BackPACK stored its inputs on it).
            grad_inp: Gradients w.r.t. the loss inputs.
            grad_out: Gradients w.r.t. the loss output.
            backproped: Nothing is backpropagated into a loss.

        Returns:
            The loss-Hessian square root w.r.t. the model output.

        Raises:
            InvalidTargetsError: If the loss was called without targets as its
                second positional argument.
        """
        if not hasattr(module, "input1"):
            raise InvalidTargetsError(
                f"{type(module).__name__} was called without targets as its second "
                "positional argument: call loss_func(output, targets)."
            )
        curvature = LossCurvature(module, module.input0, module.input1)
        ext.start_batch(module, curvature)
        return curvature.sqrt_hessian(
            ext.get_subsampling(), ext.get_num_mc_samples(), mc_per=ext.mc_per
        )
