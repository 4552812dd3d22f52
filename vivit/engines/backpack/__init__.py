"""The BackPACK engine: backpropagate the loss-Hessian square root, keep factors.

:class:`GramGGN` is a BackPACK second-order extension. Its loss module extensions
start the backward pass with the (exact or Monte-Carlo) square root of the loss
Hessian; BackPACK's module derivatives push it through every layer; the module
extensions of layers with parameters save a
:class:`~vivit.engines.base.ParamContribution` on each parameter instead of
materialising ``V``. :class:`BackpackEngine` runs it behind the engine seam and
:class:`ContributionHook` hands the contributions to the group pipeline. This
package is the only place that imports BackPACK.

:func:`unsupported_reason` says, before any computation, why the engine cannot run
a model (a layer or function it cannot backpropagate through, a weight used twice),
or ``None`` if it can. :func:`extended` prepares the caller's model and loss for one
backward pass and leaves them as they were afterwards.
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
