"""Loss module extension: the start of the backward pass and its scaling.

The root comes from :mod:`vivit.losses`, not from BackPACK's loss derivatives: it
handles every option of the supported losses and scales by ``√R_S`` of the active
samples alone, so curvature subsampling is exact (``docs/math.rst``, "Losses").
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
