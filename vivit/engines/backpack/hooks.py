"""BackPACK's hooks for the duration of one computation, then gone.

``backpack.extend`` installs, on every layer, a forward hook that stores the layer's
input and output on the module and a full backward hook that runs the extension;
it never removes them. On a caller's model that is lasting damage: every later
``backward`` warns about full backward hooks, ``torch.func`` transforms fail on the
hooks' ``autograd.Function``, and each layer keeps its last input alive.

:func:`extended` installs the same hooks with handles of its own on the modules
that lack them, yields the modules to compute the loss with, and on exit removes
the hooks and everything they stored. Modules the user extended with
``backpack.extend`` (the ViViT-compatible hook API needs that) keep their hooks.
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

    Checks the model before any computation, converts it if its forward needs that
    (:func:`~vivit.engines.backpack.support.runnable_model`: a new module holding
    the same layers and parameters; the caller's model is not converted), and
    installs BackPACK's forward and backward hooks on the layers that lack them.
    On exit, also after an error, the hooks are removed, the inputs and outputs
    they stored and any factors left on parameters are deleted, and layers the
    converter switched to ``inplace=False`` are switched back.

    Example::

        with extended(model, loss_func) as (net, loss_module):
            loss = loss_module(net(inputs), targets)
            with backpack(GramGGN(), extension_hook=collector):
                loss.backward()

    Args:
        model: The network.
        loss_func: The loss module.

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
            if is_no_op(layer) or getattr(layer, EXTENDED_FLAG, False):
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
