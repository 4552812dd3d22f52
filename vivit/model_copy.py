"""A copy of the caller's model to probe: its own modules and buffers, no hooks."""

from __future__ import annotations

import copy

from torch import Tensor
from torch.nn import Module, Parameter


def probe_copy(model: Module) -> tuple[Module, list[Parameter]]:
    """A copy of ``model`` whose runs leave the caller's model as it was.

    Its modules and buffers are its own and it has no module hooks, so a forward
    (or a trace) of it changes none of the caller's attributes and fires none of
    the caller's hooks; its parameters alias the caller's storage (not their tensor
    hooks), and tensors kept as plain attributes are shared (``docs/guide.rst``,
    "The observer's contract").

    Returns:
        The copy, and its parameters in the order of ``model.parameters()``.
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
