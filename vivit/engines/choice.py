"""``engine="auto" | "backpack" | "func"``: which engine computes the factors."""

from __future__ import annotations

import logging

from torch.nn import Module

from vivit.engines.base import Engine, OutputSelector
from vivit.errors import InvalidArgumentError

#: The names an ``engine`` argument accepts.
ENGINE_NAMES = ("auto", "backpack", "func")

logger = logging.getLogger("vivit")


def check_engine(engine: object) -> None:
    """Check an ``engine``: a name of :data:`ENGINE_NAMES` or an :class:`Engine`.

    Raises:
        InvalidArgumentError: If it is neither.
    """
    if isinstance(engine, Engine) or engine in ENGINE_NAMES:
        return
    raise InvalidArgumentError(
        f"engine must be one of {ENGINE_NAMES} or a vivit.engines.base.Engine, got "
        f"{engine!r}."
    )


def resolve_engine(
    engine: str | Engine,
    model: Module,
    loss_func: Module,
    output: OutputSelector,
) -> Engine:
    """The engine to run (``engine`` checked); nothing runs the model.

    ``"auto"`` picks the BackPACK engine when it can run the model and the loss
    exactly (:func:`vivit.engines.backpack.unsupported_reason`) and the ``output``
    option is not a function (which may compute from the model's output, where
    BackPACK cannot follow); else the func engine. It logs the choice and the
    reason (logger ``"vivit"``, level INFO).
    """
    if isinstance(engine, Engine):
        return engine
    from vivit.engines.func import FuncEngine

    if engine == "func":
        return FuncEngine()
    from vivit.engines.backpack import BackpackEngine, unsupported_reason

    if engine == "backpack":
        return BackpackEngine()
    reason = unsupported_reason(model, loss_func)
    if reason is None and callable(output):
        reason = (
            "The output is selected by a function (output=<function>), which may "
            "compute from the model's output; BackPACK follows only a tensor the "
            "model returns (select it by name or position: output='logits', "
            "output=0)."
        )
    if reason is None:
        logger.info("engine='auto': BackPACK supports the model; using 'backpack'.")
        return BackpackEngine()
    logger.info("engine='auto': using 'func'. %s", reason)
    return FuncEngine()


def runs_without_engine(engine: str | Engine) -> bool:
    """Whether an ``engine`` option allows the implicit route (torch.func alone)."""
    return engine in ("auto", "func")


def runs_from_a_loss(engine: str | Engine) -> bool:
    """Whether an ``engine`` option allows a loss computed elsewhere (BackPACK's)."""
    return engine in ("auto", "backpack")
