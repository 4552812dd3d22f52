"""The func engine: curvature factors of any model whose samples are independent.

See :mod:`vivit.engines.func.engine` for how it works and its cost model.
"""

from vivit.engines.func.engine import DEFAULT_MEMORY_BUDGET, FuncEngine

__all__ = ["DEFAULT_MEMORY_BUDGET", "FuncEngine"]
