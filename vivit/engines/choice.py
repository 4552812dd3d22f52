"""``engine="auto" | "backpack" | "func"``: which engine computes the factors."""

from __future__ import annotations

import logging

from torch.nn import Module

from vivit.engines.base import Engine
from vivit.errors import InvalidArgumentError

#: The names an ``engine`` argument accepts.
ENGINE_NAMES = ("auto", "backpack", "func")

logger = logging.getLogger("vivit")


def check_engine(engine: object) -> None:
    """Check an ``engine`` argument.

    Args:
        engine: A name of :data:`ENGINE_NAMES` or an :class:`Engine`.

    Raises:
        InvalidArgumentError: If it is neither.
    """
    if isinstance(engine, Engine) or engine in ENGINE_NAMES:
        return
    raise InvalidArgumentError(
        f"engine must be one of {ENGINE_NAMES} or a vivit.engines.base.Engine, got "
        f"{engine!r}."
    )


def resolve_engine(engine: str | Engine, model: Module, loss_func: Module) -> Engine:
    """The engine to run.

    ``"auto"`` picks the BackPACK engine when it can run the model and the loss
    (:func:`vivit.engines.backpack.unsupported_reason`: every layer supported, a
    forward its converter handles, no weight used twice), else the func engine,
    and logs the choice and the reason (logger ``"vivit"``, level INFO).

    Args:
        engine: A name of :data:`ENGINE_NAMES` or an engine instance.
        model: The network.
        loss_func: The loss module.

    Returns:
        The engine.
    """
    check_engine(engine)
    if isinstance(engine, Engine):
        return engine
    from vivit.engines.func import FuncEngine

    if engine == "func":
        return FuncEngine()
    from vivit.engines.backpack import BackpackEngine

    if engine == "backpack":
        return BackpackEngine()
    from vivit.engines.backpack import unsupported_reason

    reason = unsupported_reason(model, loss_func)
    if reason is None:
        logger.info("engine='auto': BackPACK supports the model; using 'backpack'.")
        return BackpackEngine()
    logger.info("engine='auto': using 'func'. %s", reason)
    return FuncEngine()
