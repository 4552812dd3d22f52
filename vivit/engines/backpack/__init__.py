"""The BackPACK engine: backpropagate the loss-Hessian square root, keep factors.

The only package that imports BackPACK.
"""

from vivit.engines.backpack.engine import BackpackEngine, ContributionHook, extended
from vivit.engines.backpack.extension import SAVEFIELD, GramGGN
from vivit.engines.backpack.support import unsupported_reason

__all__ = [
    "SAVEFIELD",
    "BackpackEngine",
    "ContributionHook",
    "GramGGN",
    "extended",
    "unsupported_reason",
]
