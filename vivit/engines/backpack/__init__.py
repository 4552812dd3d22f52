"""The BackPACK engine: backpropagate the loss-Hessian square root, keep factors.

:class:`GramGGN` is a BackPACK second-order extension. Its loss module extensions
start the backward pass with the (exact or Monte-Carlo) square root of the loss
Hessian; BackPACK's module derivatives push it through every layer; the module
extensions of layers with parameters save a
:class:`~vivit.engines.base.ParamContribution` on each parameter instead of
materialising ``V``.
"""

from vivit.engines.backpack.extension import SAVEFIELD, GramGGN
from vivit.engines.backpack.hooks import extended, is_extended
from vivit.engines.backpack.support import (
    analyse,
    check_supported,
    runnable_model,
    unsupported_reason,
)

__all__ = [
    "SAVEFIELD",
    "GramGGN",
    "analyse",
    "check_supported",
    "extended",
    "is_extended",
    "runnable_model",
    "unsupported_reason",
]
