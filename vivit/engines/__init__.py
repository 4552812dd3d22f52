"""Engines: where the per-layer factors of the GGN square root come from.

An engine (:class:`~vivit.engines.base.Engine`) runs the forward and backward pass
of one mini-batch and hands every requested parameter's
:class:`~vivit.engines.base.ParamContribution` (its columns of ``V`` and, on
request, its per-sample gradients, as :class:`~vivit.gram.ParamFactors`, with the
:class:`~vivit.engines.base.BatchInfo` that fixes their scaling) to the group
pipeline. Two engines exist: BackPACK (:mod:`vivit.engines.backpack`, the only
package that imports BackPACK) and func (:mod:`vivit.engines.func`, hooks and
batched autograd, for any model whose samples are independent);
:func:`~vivit.engines.choice.resolve_engine` picks one.
"""

from vivit.engines.base import BatchInfo, ParamContribution

__all__ = ["BatchInfo", "ParamContribution"]
