"""BackPACK's hooks for the duration of one computation, then gone.

``backpack.extend`` never removes its hooks: on a caller's model every later
``backward`` would warn, ``torch.func`` transforms would fail on the hooks'
``autograd.Function``, and each layer would keep its last input alive. Modules the
user extended (the ViViT-compatible hook API needs that) keep their hooks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from backpack import hook_run_extensions, hook_store_io, memory_cleanup
from backpack.utils.module_classification import is_no_op
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from vivit.engines.backpack.extension import SAVEFIELD
from vivit.engines.backpack.pooling import (
    MAX_POOLS,
    forget_pool_indices,
    store_pool_indices,
)
from vivit.engines.backpack.support import inplace_flags, runnable_model

#: The attribute ``backpack.extend`` sets on the modules it extended.
EXTENDED_FLAG = "_backpack_extend"


@contextmanager
def extended(model: Module, loss_func: Module) -> Iterator[tuple[Module, Module]]:
    """Model and loss ready for a BackPACK backward pass, unchanged afterwards.

    Converts the model if its forward needs that
    (:func:`~vivit.engines.backpack.support.runnable_model`; the caller's model is not
    converted) and hooks the layers that lack BackPACK's hooks. On exit, also after an
    error, removes the hooks, what they stored and factors left on parameters, and
    restores the ``inplace`` flags the converter switched.

    Yields:
        ``(net, loss_module)``: compute the loss as ``loss_module(net(inputs),
        targets)``; ``net`` is ``model`` or its conversion.

    Raises:
        SharedWeightError: If a weight is used more than once in a forward pass.
        UnsupportedLayerError: If a layer, function or the loss cannot be handled.
    """
    flags = inplace_flags(model)
    with ExitStack() as cleanup:
        cleanup.callback(_restore_inplace, flags)
        net = runnable_model(model, loss_func)
        modules = [net, loss_func, *([model] if net is not model else [])]
        cleanup.callback(_clean, modules)
        cleanup.enter_context(_hooks(net))
        cleanup.enter_context(_hooks(loss_func))
        yield net, loss_func


@contextmanager
def _hooks(module: Module) -> Iterator[None]:
    """BackPACK's hooks on every layer of ``module`` that has none, until exit."""
    installed: list[tuple[Module, bool | None, list[RemovableHandle]]] = []
    try:
        for layer in module.modules():
            if is_no_op(layer) or _extended(layer):
                continue
            previous = layer._is_full_backward_hook
            handles = [
                layer.register_forward_hook(hook_store_io),
                layer.register_full_backward_hook(hook_run_extensions),
            ]
            if isinstance(layer, MAX_POOLS):
                handles.append(layer.register_forward_hook(store_pool_indices))
            installed.append((layer, previous, handles))
        yield
    finally:
        for layer, previous, handles in installed:
            for handle in handles:
                handle.remove()
            # torch remembers that the layer had full backward hooks and would
            # refuse the caller's register_backward_hook: forget it again.
            layer._is_full_backward_hook = previous


def _extended(layer: Module) -> bool:
    """Whether ``backpack.extend`` hooked the layer (a copy keeps the flag alone)."""
    hooks = layer._forward_hooks.values()
    return getattr(layer, EXTENDED_FLAG, False) and hook_store_io in hooks


def _clean(modules: list[Module]) -> None:
    """Drop the inputs/outputs BackPACK stored and factors left on parameters."""
    for module in modules:
        for layer in module.modules():
            memory_cleanup(layer)
            forget_pool_indices(layer)
        for param in module.parameters():
            if hasattr(param, SAVEFIELD):
                delattr(param, SAVEFIELD)


def _restore_inplace(flags: dict[Module, bool]) -> None:
    for layer, inplace in flags.items():
        layer.inplace = inplace
