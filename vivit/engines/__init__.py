"""Engines: where the per-layer factors of the GGN square root come from.

An engine runs during a backward pass and leaves, on every parameter, a
:class:`~vivit.engines.base.ParamContribution`: the parameter's columns of ``V`` (and,
on request, its per-sample gradients) as :class:`~vivit.gram.ParamFactors`, plus the
:class:`~vivit.engines.base.BatchInfo` that fixes their scaling. Today's engine is a
BackPACK extension (:mod:`vivit.engines.backpack`).
"""

from vivit.engines.base import BatchInfo, ParamContribution

__all__ = ["BatchInfo", "ParamContribution"]
