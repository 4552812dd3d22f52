"""Engines: where the per-layer factors of the GGN square root come from.

BackPACK (:mod:`vivit.engines.backpack`, the only package that imports BackPACK) or
func (:mod:`vivit.engines.func`); :func:`~vivit.engines.choice.resolve_engine` picks.
"""

from vivit.engines.base import BatchInfo, ParamContribution

__all__ = ["BatchInfo", "ParamContribution"]
