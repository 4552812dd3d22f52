"""Factor forms of convolution and BatchNorm weights from forward hooks.

:class:`LayerCapture` records the input and output of every call of such a layer
whose weight is requested (other functions are recorded at the function level,
:mod:`vivit.engines.func.functional`): the input after the layer's forward
pre-hooks, the output before its forward hooks, whose changes then belong to the
graph above. Several calls of one layer stack along the positions (``docs/math.rst``,
"Layer structure").
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

#: Layers whose weight has the outer-product factor form, recorded by module hooks.
FACTOR_LAYERS = (Conv1d, Conv2d, Conv3d)
#: Layers whose weight is an entry-wise scale of the normalized input (evaluation
#: mode: :func:`vivit._validation.check_batch_norm` refuses batch statistics).
SCALE_LAYERS = (_BatchNorm,)
_CONVOLUTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass
class LayerCall:
    """One call of a factor-form layer.

    Attributes:
        module: The layer.
        inputs: Its input, detached.
        output: Its output (part of the autograd graph).
        versions: Version counters of input and output when recorded.
    """

    module: Module
    inputs: Tensor
    output: Tensor
    versions: tuple[int, int]

    def unchanged(self) -> bool:
        """Whether neither tensor was modified in place after the call."""
        return (self.inputs._version, self.output._version) == self.versions

    def layer_inputs(self) -> Tensor:
        """The layer input in factor layout ``[B, G, T, P]``.

        For a BatchNorm layer: its normalized input ``x̂``, ``[B, 1, T, O]``.
        """
        if isinstance(self.module, SCALE_LAYERS):
            return normalized_input(self.module, self.inputs)
        unfolded = unfold_conv_input(self.module, self.inputs)  # [B, I·k, T]
        groups = self.module.groups
        unfolded = unfolded.reshape(unfolded.shape[0], groups, -1, unfolded.shape[-1])
        return unfolded.transpose(2, 3)

    def output_vectors(self, vectors: Tensor) -> Tensor:
        """Vectors ``[V, B, *out]`` at the layer output as ``[V, B, G, T, O]``.

        A BatchNorm layer's channels are its ``O`` output features (``G = 1``).
        """
        num, batch = vectors.shape[:2]
        if isinstance(self.module, SCALE_LAYERS):
            groups, features = 1, self.module.num_features
        else:
            groups = self.module.groups
            features = self.module.out_channels // groups
        return vectors.reshape(num, batch, groups, features, -1).transpose(3, 4)


def normalized_input(module: _BatchNorm, inputs: Tensor) -> Tensor:
    """A BatchNorm input ``[B, O, *spatial]`` normalized by the running statistics.

    Returns:
        ``x̂`` with the channels last, ``[B, 1, T, O]`` (``docs/math.rst``, "Layer
        structure").
    """
    flat = inputs.reshape(inputs.shape[0], module.num_features, -1)
    scale = torch.rsqrt(module.running_var + module.eps).to(inputs.dtype)
    mean = module.running_mean.to(inputs.dtype)
    normalized = (flat - mean[:, None]) * scale[:, None]
    return normalized.transpose(1, 2).unsqueeze(1)


def unfold_conv_input(module: Module, inputs: Tensor) -> Tensor:
    """Patches of a convolution input ``[B, C_in, *spatial]``, ``[B, C_in·k, T]``.

    A grouped convolution with one-hot kernels: any dimension, stride, dilation and
    padding mode. Channel ``c·k + j`` is entry ``j`` of input channel ``c``.
    """
    kernel = module.kernel_size
    dims = len(kernel)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    padded = F.pad(inputs, module._reversed_padding_repeated_twice, mode=mode)
    entries = math.prod(kernel)
    eye = torch.eye(entries, dtype=inputs.dtype, device=inputs.device)
    one_hot = eye.reshape(entries, 1, *kernel).repeat(
        module.in_channels, *[1] * (dims + 1)
    )
    patches = _CONVOLUTIONS[dims](
        padded,
        one_hot,
        stride=module.stride,
        dilation=module.dilation,
        groups=module.in_channels,
    )
    return patches.reshape(patches.shape[0], patches.shape[1], -1)


@dataclass
class LayerCapture:
    """Forward hooks recording calls of factor-form layers with a weight in ``params``.

    Attributes:
        calls: Recorded calls, in forward order.
    """

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
        self.calls.append(
            LayerCall(
                module, inputs.detach(), output, (inputs._version, output._version)
            )
        )


def _accumulator(param: Parameter):
    """The autograd node that accumulates ``param``'s gradient."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def count_uses(output: Tensor, params: list[Parameter]) -> dict[int, int]:
    """How many operations of ``output``'s graph consume each parameter, by ``id``."""
    owner = {_accumulator(p): id(p) for p in params}
    uses = dict.fromkeys((id(p) for p in params), 0)
    if output.grad_fn is None:
        return uses
    seen = {output.grad_fn}
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child in owner:
                uses[owner[child]] += 1
            elif child not in seen:
                seen.add(child)
                stack.append(child)
    return uses
