"""What stops the BackPACK engine, and how its refusal reads.

:class:`Obstacle` is one reason, :func:`refusal` the error naming them; the obstacles
that one layer alone shows are here too (the extension checks each layer with them).
"""

from __future__ import annotations

from dataclasses import dataclass

from backpack import hook_store_io
from torch.nn import Module
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.nn.utils.parametrize import is_parametrized
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.weight_norm import WeightNorm

from vivit.engines.backpack.table import store_pool_indices, supported_layer_names
from vivit.errors import UnsupportedLayerError

#: Forward hooks that only record (BackPACK's and the library's own).
_OWN_HOOKS = (hook_store_io, store_pool_indices)

#: What every refusal ends with: the engine that can.
FUNC_HINT = (
    "The torch.func engine handles it: LowRankGGN(..., engine='func') (or "
    "engine='auto', which picks it for such models)."
)

#: How many obstacles an error message names.
MAX_NAMED = 3
#: Why a weight used more than once is refused.
DROPS_OTHERS = "BackPACK keeps one contribution per parameter: it would drop the others"


@dataclass(frozen=True)
class Obstacle:
    """One reason why the BackPACK engine cannot run a model.

    ``layer``: a layer without module extension (the error lists supported layers).
    """

    error: type[Exception]
    message: str
    func_can: bool = True
    layer: bool = False


def refusal(obstacles: list[Obstacle], context: str = "") -> Exception:
    """The error naming ``obstacles`` (the first decides its class), and who can.

    ``context`` is a prefix naming where they were found.
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


def unsupported_layer(name: str) -> Obstacle:
    """The obstacle of a layer (named with where it is called) without extension."""
    return Obstacle(
        UnsupportedLayerError, f"layer {name} has no BackPACK extension", layer=True
    )


def bad_padding(layer: Module, name: str) -> list[Obstacle]:
    """The obstacle of a convolution whose padding BackPACK gets wrong (or none)."""
    if not isinstance(layer, _ConvNd) or (
        layer.padding_mode == "zeros" and not isinstance(layer.padding, str)
    ):
        return []
    message = (
        f"{name} pads with padding={layer.padding!r}, padding_mode="
        f"{layer.padding_mode!r}, which BackPACK's convolution derivatives get "
        "wrong (use integer padding with padding_mode='zeros': padding='same' is "
        "padding=kernel_size // 2 for odd kernels and stride 1, 'valid' is "
        "padding=0; or pad before the convolution)"
    )
    return [Obstacle(UnsupportedLayerError, message)]


def forward_changes(model: Module, layer: str | None = None) -> list[Obstacle]:
    """Hooks and parametrizations of every module (only ``model``, named ``layer``)."""
    named = (
        [(layer, model)]
        if layer is not None
        else [
            (f"`{name}` ({type(m).__name__})" if name else "the model", m)
            for name, m in model.named_modules()
        ]
    )
    obstacles = [o for where, m in named for o in _module_changes(m, where)]
    if _global_forward_pre_hooks or _global_forward_hooks:
        obstacles.append(
            Obstacle(
                UnsupportedLayerError,
                "global module forward hooks are registered "
                "(torch.nn.modules.module.register_module_forward_hook), which may "
                "change every layer's input or output; BackPACK would miss that",
            )
        )
    return obstacles


#: Why a forward that differs from its layers' functions is refused.
_TENSORS_USED = "BackPACK hands curvature only to the tensors a layer uses"
_OWN_FUNCTION = (
    "BackPACK backpropagates through the layer's own function and would miss the change"
)


def _module_changes(module: Module, where: str) -> list[Obstacle]:
    """The obstacles of one module's own hooks and parametrizations."""
    messages = []
    if is_parametrized(module):
        tensors = ", ".join(f"`{t}`" for t in module.parametrizations)
        messages.append(
            f"{where} is parametrized (torch.nn.utils.parametrize: {tensors} "
            f"computed from the parameters under `parametrizations`), and "
            f"{_TENSORS_USED}"
        )
    messages.extend(_pre_hook(where, h) for h in module._forward_pre_hooks.values())
    messages.extend(
        f"{where} has the forward hook {_hook_name(hook)}, which may change its "
        f"output; {_OWN_FUNCTION}"
        for hook in module._forward_hooks.values()
        if hook not in _OWN_HOOKS
    )
    return [Obstacle(UnsupportedLayerError, message) for message in messages]


def _pre_hook(where: str, hook: object) -> str:
    """Why a forward pre-hook is refused: a pruning, a weight norm, or another."""
    if isinstance(hook, BasePruningMethod):
        return (
            f"{where} is pruned (torch.nn.utils.prune: `weight = weight_orig * "
            "weight_mask` is computed by a forward pre-hook, and "
            f"{_TENSORS_USED}, not to `weight_orig`)"
        )
    if isinstance(hook, WeightNorm):
        return (
            f"{where} is weight-normalized (torch.nn.utils.weight_norm: the weight "
            "is computed from `weight_g` and `weight_v` by a forward pre-hook, and "
            f"{_TENSORS_USED})"
        )
    return (
        f"{where} has the forward pre-hook {_hook_name(hook)}, which may change its "
        f"input; {_OWN_FUNCTION}"
    )


def _hook_name(hook: object) -> str:
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"`{name}`"
