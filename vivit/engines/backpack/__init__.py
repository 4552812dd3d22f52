"""The BackPACK engine: backpropagate the loss-Hessian square root, keep factors.

:class:`GramGGN` is a BackPACK second-order extension. Its loss module extensions
start the backward pass with the (exact or Monte-Carlo) square root of the loss
Hessian; BackPACK's module derivatives push it through every layer; the module
extensions of layers with parameters save a
:class:`~vivit.engines.base.ParamContribution` on each parameter instead of
materialising ``V``. :class:`BackpackEngine` runs it behind the engine seam and
:class:`ContributionHook` hands the contributions to the group pipeline. This
package is the only place that imports BackPACK.
"""

from vivit.engines.backpack.engine import (
    BackpackEngine,
    ContributionHook,
    extend_if_needed,
)
from vivit.engines.backpack.extension import SAVEFIELD, GramGGN

__all__ = [
    "SAVEFIELD",
    "BackpackEngine",
    "ContributionHook",
    "GramGGN",
    "extend_if_needed",
]
