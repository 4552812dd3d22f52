"""The func engine: curvature factors of any model whose samples are independent."""

from vivit.engines.func.engine import DEFAULT_MEMORY_BUDGET, FuncEngine

__all__ = ["DEFAULT_MEMORY_BUDGET", "FuncEngine"]
