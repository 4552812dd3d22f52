"""A copy of the caller's model to probe: its own modules and buffers, no hooks."""

from __future__ import annotations

import copy
import logging

from torch import Tensor
from torch.nn import Module, Parameter

logger = logging.getLogger("vivit")


def probe_copy(model: Module) -> tuple[Module, list[Parameter]]:
    """A copy of ``model`` whose runs leave the caller's model as it was.

    Its modules and buffers are its own and it has no module hooks, so a forward
    (or a trace) of it changes none of the caller's attributes and fires none of
    the caller's hooks; its parameters alias the caller's storage (not their tensor
    hooks), and tensors kept as plain attributes are shared (``docs/guide.rst``,
    "The observer's contract").

    Returns:
        The copy, and its parameters in the order of ``model.parameters()``.

    Raises:
        Exception: What ``copy.deepcopy`` raises for an attribute it cannot copy.
    """
    params = list(model.parameters())
    plain = [v for m in model.modules() for v in vars(m).values()]
    memo = {id(v): v for v in plain if isinstance(v, Tensor)}
    memo |= {id(p): Parameter(p.detach(), p.requires_grad) for p in params}
    twin = copy.deepcopy(model, memo)
    for module in twin.modules():
        for name, value in vars(module).items():
            if name.endswith("hooks") and isinstance(value, dict):
                value.clear()
    return twin, [memo[id(p)] for p in params]


def probe_copy_or_model(model: Module) -> tuple[Module, list[Parameter]]:
    """:func:`probe_copy`, or the model itself where it cannot be copied (logged)."""
    try:
        return probe_copy(model)
    except Exception as error:  # noqa: BLE001 (any attribute deepcopy refuses)
        logger.info(
            "Cannot copy the model (%s: %s): its probes run on the model itself, "
            "whose forward runs for them.", type(error).__name__, error,
        )  # fmt: skip
        return model, list(model.parameters())
