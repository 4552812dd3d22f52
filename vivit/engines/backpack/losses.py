"""Loss module extensions: the start of the backward pass and its scaling.

BackPACK's loss extensions return ``√R · S_n`` with ``R`` taken from the whole
mini-batch. With curvature subsampling the GGN is that of the loss on the active
samples alone, whose ``R`` for mean reduction is ``1/|S|``: the one correction
``√(N/|S|)`` happens here and nowhere else.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from backpack.extensions.secondorder.sqrt_ggn import losses as sqrt_ggn_losses
from torch import Tensor
from torch.nn import Module

if TYPE_CHECKING:
    from vivit.engines.backpack.extension import GramGGN


class _GramLossMixin:
    """Record the batch context and rescale the loss-Hessian root for subsampling."""

    def backpropagate(
        self,
        ext: GramGGN,
        module: Module,
        grad_inp: tuple[Tensor, ...],
        grad_out: tuple[Tensor, ...],
        backproped: None,
    ) -> Tensor:
        """Return ``√R_S · S_n`` for the active samples, shape ``[C, |S|, *out]``.

        Args:
            ext: The running extension.
            module: The loss module.
            grad_inp: Gradients w.r.t. the loss inputs.
            grad_out: Gradients w.r.t. the loss output.
            backproped: Nothing is backpropagated into a loss.

        Returns:
            The loss-Hessian square root w.r.t. the model output.
        """
        batch = ext.start_batch(module)
        sqrt_hessian = super().backpropagate(
            ext, module, grad_inp, grad_out, backproped
        )
        num_active = len(batch.ggn_samples)
        if batch.reduction == "mean" and num_active != batch.batch_size:
            sqrt_hessian = sqrt_hessian * math.sqrt(batch.batch_size / num_active)
        return sqrt_hessian


class GramMSELoss(_GramLossMixin, sqrt_ggn_losses.SqrtGGNMSELoss):
    """``torch.nn.MSELoss``."""


class GramCrossEntropyLoss(_GramLossMixin, sqrt_ggn_losses.SqrtGGNCrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss``."""


class GramBCEWithLogitsLoss(_GramLossMixin, sqrt_ggn_losses.SqrtGGNBCEWithLogithsLoss):
    """``torch.nn.BCEWithLogitsLoss``."""
