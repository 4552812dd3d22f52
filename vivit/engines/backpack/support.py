"""Whether the BackPACK engine can handle a model and a loss exactly.

Used by ``engine="auto"``: BackPACK works on a whitelist of layers composed by
``nn.Sequential`` (or a model converted by ``backpack.extend(...,
use_converter=True)``) and keeps one contribution per parameter, so shared
weights, custom forwards and unknown layers go to the func engine.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor
from torch.fx import GraphModule
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, Module, MSELoss, Sequential
from torch.nn.modules.conv import _ConvNd

from vivit.engines.backpack.extension import GramGGN


def unsupported_reason(model: Module, loss_func: Module, inputs: Tensor) -> str | None:
    """Why the BackPACK engine cannot handle this model and loss, if it cannot.

    Runs one forward pass without gradients to find layers called more than once.

    Args:
        model: The network.
        loss_func: The loss module.
        inputs: Mini-batch inputs.

    Returns:
        A short reason, or ``None`` if BackPACK supports everything.
    """
    if not isinstance(loss_func, MSELoss | CrossEntropyLoss | BCEWithLogitsLoss):
        return f"loss {type(loss_func).__name__}"
    if isinstance(loss_func, CrossEntropyLoss) and (
        loss_func.weight is not None
        or loss_func.label_smoothing != 0.0
        or loss_func.ignore_index != -100
    ):
        return "CrossEntropyLoss with class weights, ignore_index or label smoothing"
    supported = set(GramGGN()._supported)
    for name, module in model.named_modules():
        has_children = next(module.children(), None) is not None
        if has_children and not isinstance(module, Sequential | GraphModule):
            return f"custom forward of {name or 'the model'} ({type(module).__name__})"
        if not has_children and type(module) not in supported:
            return f"layer {name or 'the model'} ({type(module).__name__})"
        if isinstance(module, _ConvNd) and (
            module.padding_mode != "zeros" or isinstance(module.padding, str)
        ):
            return f"the padding of {name or 'the model'} ({module})"
    names = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    if any(count > 1 for count in names.values()):
        return "a parameter shared between layers"
    calls: Counter[int] = Counter()
    handles = [
        m.register_forward_hook(lambda m, i, o: calls.update([id(m)]))
        for m in model.modules()
        if next(m.parameters(recurse=False), None) is not None
    ]
    try:
        with torch.no_grad():
            output = model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    if any(count > 1 for count in calls.values()):
        return "a layer called more than once (shared weights)"
    if isinstance(loss_func, CrossEntropyLoss) and output.dim() > 2:
        return "CrossEntropyLoss over outputs with extra axes"
    return None
