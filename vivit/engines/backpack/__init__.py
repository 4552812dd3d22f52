"""The BackPACK engine: backpropagate the loss-Hessian square root, keep factors.

This package is the only place that imports BackPACK. :func:`unsupported_reason`
says, before any computation, why the engine cannot run a model, or ``None``.
"""

from vivit.engines.backpack.engine import BackpackEngine, ContributionHook
from vivit.engines.backpack.extension import SAVEFIELD, GramGGN
from vivit.engines.backpack.hooks import extended
from vivit.engines.backpack.support import unsupported_reason

__all__ = [
    "SAVEFIELD",
    "BackpackEngine",
    "ContributionHook",
    "GramGGN",
    "extended",
    "unsupported_reason",
]
