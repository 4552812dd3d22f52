"""Products ``H_n u`` with the loss Hessian w.r.t. the output, and output gradients.

The implicit route's stand-in for a root ``S_n`` (``docs/math.rst``, "Implicit
GGN-vector products").
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module

from vivit.losses import LossCurvature, LossNormalization


class LossHessianProducts:
    """``H_n u`` and ``∂ℓ_n/∂f_n`` of every sample of ``loss_func(output, targets)``.

    Attributes:
        normalization: The loss's reduction and sample weights (``R``).

    Raises:
        VivitError: As :class:`vivit.losses.LossCurvature` for an unsupported
            loss, option or targets, or a non-finite output.
    """

    def __init__(self, loss_func: Module, output: Tensor, targets: Tensor):
        curvature = LossCurvature(loss_func, output, targets)  # the scales c_np
        self.normalization: LossNormalization = curvature.normalization
        self._kind, self._loss_func = curvature._kind, loss_func
        self._output = output = curvature.output
        self._targets = curvature.targets
        self._scale = curvature._scale.to(device=output.device, dtype=output.dtype)
        if self._kind == "ce":
            self._probs = output.softmax(1)
            # c_np·p, [N, C, *T]: one factor for the product's last step
            self._scale = self._scale.unsqueeze(1) * self._probs
        elif self._kind == "bce":
            sigma = output.sigmoid()
            self._scale = self._scale * sigma * (1 - sigma)

    @torch.no_grad()  # never differentiated (out= refuses tensors that need grad)
    def hessian_matmul(self, tangents: Tensor) -> Tensor:
        """``H_n u_n`` (``ℓ_n``'s Hessian, not ``L``'s) of tangents ``[K, N, *out]``."""
        if self._kind == "ce":
            # one temporary of the tangents' shape, reused in place (each new
            # one of a vocabulary's size costs its first touch of memory)
            product = self._probs * tangents
            projected = product.sum(2, keepdim=True)
            torch.sub(tangents, projected, out=product)
            return product.mul_(self._scale)
        return self._scale * tangents

    def output_gradients(self) -> Tensor:
        """``∂ℓ_n/∂f_n`` of every sample, ``[N, *out]``: ``∂L/∂f / R`` (0 if R = 0)."""
        factor = self.normalization.reduction_factor()
        output = self._output.detach().requires_grad_()
        with torch.enable_grad():
            loss = self._loss_func(output, self._targets)
        (gradient,) = torch.autograd.grad(loss, output)
        return gradient / factor if factor > 0 else gradient
