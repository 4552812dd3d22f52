"""What stops the BackPACK engine, and how its refusal reads.

:class:`Obstacle` is one reason, :func:`refusal` the error naming them. The
obstacles of one layer's hooks and parametrizations are here too: the extension
checks every layer its backward pass reaches with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from backpack import hook_store_io
from torch.nn import Module
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.nn.utils.parametrize import is_parametrized
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.weight_norm import WeightNorm

from vivit.engines.backpack.pooling import store_pool_indices
from vivit.engines.backpack.table import supported_layer_names
from vivit.errors import UnsupportedLayerError

#: Forward hooks that only record (BackPACK's and the library's own).
_OWN_HOOKS = (hook_store_io, store_pool_indices)

#: What every refusal ends with: the engine that can.
FUNC_HINT = (
    "The torch.func engine handles it: LowRankGGN(..., engine='func') (or "
    "engine='auto', which picks it for such models)."
)


@dataclass(frozen=True)
class Obstacle:
    """One reason why the BackPACK engine cannot run a model.

    Attributes:
        error: The exception class to raise.
        message: What cannot be handled, named, and where.
        func_can: Whether the torch.func engine handles it.
        layer: Whether it is a layer without module extension (the error then
            lists the supported layers once).
    """

    error: type[Exception]
    message: str
    func_can: bool = True
    layer: bool = False


#: How many obstacles an error message names.
MAX_NAMED = 3


def refusal(obstacles: list[Obstacle], context: str = "") -> Exception:
    """The error for a model with obstacles: what cannot be handled, and who can.

    Args:
        obstacles: At least one; the first decides the exception class.
        context: Prefix naming where the obstacles were found.

    Returns:
        The exception to raise.
    """
    named = "; ".join(o.message for o in obstacles[:MAX_NAMED])
    more = len(obstacles) - MAX_NAMED
    rest = f"; and {more} more" if more > 0 else ""
    layers = (
        f" Supported layers: {supported_layer_names()}."
        if any(o.layer for o in obstacles)
        else ""
    )
    hint = f" {FUNC_HINT}" if all(o.func_can for o in obstacles) else ""
    return obstacles[0].error(
        f"{context}The BackPACK engine cannot handle this model: {named}{rest}."
        f"{layers}{hint}"
    )


def module_forward_changes(module: Module, where: str) -> list[Obstacle]:
    """The obstacles of one module's hooks and parametrizations.

    Args:
        module: The layer.
        where: How messages name it.

    Returns:
        Its obstacles (without the global module hooks:
        :func:`global_hook_obstacles`).
    """
    obstacles = []
    if is_parametrized(module):
        tensors = ", ".join(f"`{t}`" for t in module.parametrizations)
        obstacles.append(
            Obstacle(
                UnsupportedLayerError,
                f"{where} is parametrized (torch.nn.utils.parametrize: {tensors} "
                "computed from the parameters under `parametrizations`), and "
                "BackPACK hands curvature only to the tensors a layer uses",
            )
        )
    for hook in module._forward_pre_hooks.values():
        obstacles.append(_pre_hook(where, hook))
    for hook in module._forward_hooks.values():
        if hook not in _OWN_HOOKS:
            obstacles.append(
                Obstacle(
                    UnsupportedLayerError,
                    f"{where} has the forward hook {_hook_name(hook)}, which may "
                    "change its output; BackPACK backpropagates through the "
                    "layer's own function and would miss the change",
                )
            )
    return obstacles


def global_hook_obstacles() -> list[Obstacle]:
    """The obstacle of global module forward hooks, if any are registered (or none)."""
    if not (_global_forward_pre_hooks or _global_forward_hooks):
        return []
    return [
        Obstacle(
            UnsupportedLayerError,
            "global module forward hooks are registered "
            "(torch.nn.modules.module.register_module_forward_hook), which may "
            "change every layer's input or output; BackPACK would miss that",
        )
    ]


def _pre_hook(where: str, hook: object) -> Obstacle:
    """The obstacle of a forward pre-hook: a pruning, a weight norm, or another."""
    if isinstance(hook, BasePruningMethod):
        what = (
            f"{where} is pruned (torch.nn.utils.prune: `weight = weight_orig * "
            "weight_mask` is computed by a forward pre-hook, and BackPACK hands "
            "curvature only to the tensors a layer uses, not to `weight_orig`)"
        )
    elif isinstance(hook, WeightNorm):
        what = (
            f"{where} is weight-normalized (torch.nn.utils.weight_norm: the weight "
            "is computed from `weight_g` and `weight_v` by a forward pre-hook, and "
            "BackPACK hands curvature only to the tensors a layer uses)"
        )
    else:
        what = (
            f"{where} has the forward pre-hook {_hook_name(hook)}, which may change "
            "its input; BackPACK backpropagates through the layer's own function "
            "and would miss the change"
        )
    return Obstacle(UnsupportedLayerError, what)


def _hook_name(hook: object) -> str:
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"`{name}`"
