"""Which layer runs which module extension: the one list of what the engine supports.

Parameter-free layers keep BackPACK's ``SqrtGGN`` module extensions; layers with
parameters and losses use vivit's.
"""

from __future__ import annotations

from functools import cache

from backpack.custom_module.branching import SumModule
from backpack.custom_module.pad import Pad
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing
from backpack.extensions.module_extension import ModuleExtension
from backpack.extensions.secondorder.sqrt_ggn import (
    activations,
    custom_module,
    dropout,
    flatten,
    pad,
    padding,
    slicing,
)
from torch.nn import (
    ELU,
    SELU,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    Dropout,
    Flatten,
    Identity,
    LeakyReLU,
    LogSigmoid,
    Module,
    MSELoss,
    ReLU,
    Sigmoid,
    Tanh,
    ZeroPad2d,
)

from vivit.engines.backpack.dtype import avg_pool_extensions
from vivit.engines.backpack.layers import param_layer_extensions
from vivit.engines.backpack.losses import GramLoss
from vivit.engines.backpack.pooling import max_pool_extensions

#: Loss modules the engine starts the backward pass at.
LOSSES: tuple[type[Module], ...] = (MSELoss, CrossEntropyLoss, BCEWithLogitsLoss)


def module_extensions() -> dict[type[Module], ModuleExtension]:
    """A fresh module table: layer class (exact type, not sub-classes) to extension."""
    return {
        MSELoss: GramLoss(),
        CrossEntropyLoss: GramLoss(),
        BCEWithLogitsLoss: GramLoss(),
        **param_layer_extensions(),
        **avg_pool_extensions(),
        **max_pool_extensions(),
        ZeroPad2d: padding.SqrtGGNZeroPad2d(),
        Dropout: dropout.SqrtGGNDropout(),
        Flatten: flatten.SqrtGGNFlatten(),
        ReLU: activations.SqrtGGNReLU(),
        Sigmoid: activations.SqrtGGNSigmoid(),
        Tanh: activations.SqrtGGNTanh(),
        LeakyReLU: activations.SqrtGGNLeakyReLU(),
        LogSigmoid: activations.SqrtGGNLogSigmoid(),
        ELU: activations.SqrtGGNELU(),
        SELU: activations.SqrtGGNSELU(),
        Identity: custom_module.SqrtGGNScaleModule(),
        ScaleModule: custom_module.SqrtGGNScaleModule(),
        SumModule: custom_module.SqrtGGNSumModule(),
        Pad: pad.SqrtGGNPad(),
        Slicing: slicing.SqrtGGNSlicing(),
    }


@cache
def supported_types() -> frozenset[type[Module]]:
    """Layer and loss classes the engine supports (:func:`module_extensions`)."""
    return frozenset(module_extensions())


def supported_layer_names() -> str:
    """The supported layer classes' names (no losses), sorted, for error messages."""
    layers = supported_types() - set(LOSSES)
    return ", ".join(sorted(cls.__name__ for cls in layers))
