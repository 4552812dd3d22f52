"""Factor forms of convolution and BatchNorm weights from forward hooks.

Each call's input (after pre-hooks) and output (before hooks) is recorded
(``docs/math.rst``, "Layer structure").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Conv1d, Conv2d, Conv3d, Module, Parameter
from torch.nn.modules.batchnorm import _BatchNorm

from vivit.engines.base import graph_nodes

#: Layers whose weight has the outer-product factor form, recorded by module hooks.
FACTOR_LAYERS = (Conv1d, Conv2d, Conv3d)
#: Layers whose weight is an entry-wise scale of the normalized input (evaluation
#: mode: :func:`vivit._validation.check_batch_norm` refuses batch statistics).
SCALE_LAYERS = (_BatchNorm,)
_CONVOLUTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass
class Recorded:
    """A recorded call: input (detached), output, their versions when recorded."""

    inputs: Tensor
    output: Tensor
    versions: tuple[int, int]

    def unchanged(self) -> bool:
        """Whether neither tensor was modified in place after the call."""
        return (self.inputs._version, self.output._version) == self.versions


@dataclass
class LayerCall(Recorded):
    """One call of a factor-form layer, ``module``."""

    module: Module

    def params(self) -> list[Parameter]:
        """The layer's weight and bias (where it has one)."""
        return [p for p in (self.module.weight, self.module.bias) if p is not None]

    def layer_inputs(self) -> Tensor:
        """The layer input as ``[B, G, T, P]`` (BatchNorm: ``x̂``, ``[B, 1, T, O]``)."""
        if isinstance(self.module, SCALE_LAYERS):
            return normalized_input(self.module, self.inputs)
        unfolded = unfold_conv_input(self.module, self.inputs)  # [B, I·k, T]
        return grouped_patches(unfolded, self.module.groups)

    def output_vectors(self, vectors: Tensor) -> Tensor:
        """Vectors ``[V, B, *out]`` at the output as ``[V, B, G, T, O]``."""
        if isinstance(self.module, SCALE_LAYERS):
            return grouped_vectors(vectors, 1, self.module.num_features)
        groups = self.module.groups
        return grouped_vectors(vectors, groups, self.module.out_channels // groups)


def grouped_patches(patches: Tensor, groups: int) -> Tensor:
    """Patches ``[B, G·P, T]`` in factor layout ``[B, G, T, P]``."""
    grouped = patches.reshape(patches.shape[0], groups, -1, patches.shape[-1])
    return grouped.transpose(2, 3)


def grouped_vectors(vectors: Tensor, groups: int, features: int) -> Tensor:
    """Vectors ``[V, B, G·O, *spatial]`` in factor layout ``[V, B, G, T, O]``."""
    return vectors.reshape(*vectors.shape[:2], groups, features, -1).transpose(3, 4)


def normalized_input(module: _BatchNorm, inputs: Tensor) -> Tensor:
    """``x̂`` ``[B, 1, T, O]``: a BatchNorm input normalized by running statistics."""
    flat = inputs.reshape(inputs.shape[0], module.num_features, -1)
    scale = torch.rsqrt(module.running_var + module.eps).to(inputs.dtype)
    mean = module.running_mean.to(inputs.dtype)
    normalized = (flat - mean[:, None]) * scale[:, None]
    return normalized.transpose(1, 2).unsqueeze(1)


def unfold_conv_input(module: Module, inputs: Tensor) -> Tensor:
    """Patches ``[B, C_in·k, T]`` of a convolution input (any padding mode)."""
    kernel = module.kernel_size
    dims = len(kernel)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    padded = F.pad(inputs, module._reversed_padding_repeated_twice, mode=mode)
    entries = math.prod(kernel)
    eye = torch.eye(entries, dtype=inputs.dtype, device=inputs.device)
    channels = module.in_channels
    one_hot = eye.reshape(entries, 1, *kernel).repeat(channels, *[1] * (dims + 1))
    # (input, weight, bias, stride, padding, dilation, groups)
    args = (None, module.stride, 0, module.dilation, channels)
    patches = _CONVOLUTIONS[dims](padded, one_hot, *args)
    return patches.reshape(patches.shape[0], patches.shape[1], -1)


@dataclass
class LayerCapture:
    """Forward hooks recording (in ``calls``) the layers with a weight in ``params``."""

    model: Module
    params: list[Parameter]
    calls: list[LayerCall] = field(default_factory=list)

    def __post_init__(self):
        requested = {id(p) for p in self.params}
        self.layers = [
            m
            for m in self.model.modules()
            if isinstance(m, FACTOR_LAYERS + SCALE_LAYERS) and id(m.weight) in requested
        ]

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record calls inside the block; the hooks are removed afterwards."""
        self.calls = []
        # first among the layer's forward hooks: the layer's own output, before
        # a user's hook changes it (the change is then part of the graph above)
        handles = [
            m.register_forward_hook(self._record, prepend=True) for m in self.layers
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, module: Module, args: tuple, output: Tensor) -> None:
        inputs = args[0] if args else None  # keyword inputs: no factor form
        if not isinstance(output, Tensor) or not isinstance(inputs, Tensor):
            return
        versions = (inputs._version, output._version)
        self.calls.append(LayerCall(inputs.detach(), output, versions, module))


def count_uses(output: Tensor, params: list[Parameter]) -> dict[int, int]:
    """How many operations of ``output``'s graph consume each parameter, by ``id``."""
    # the node that accumulates each parameter's gradient
    owner = {p.view_as(p).grad_fn.next_functions[0][0]: id(p) for p in params}
    uses = dict.fromkeys((id(p) for p in params), 0)
    for node in graph_nodes(output):
        for child, _ in node.next_functions:
            if child in owner:
                uses[owner[child]] += 1
    return uses
