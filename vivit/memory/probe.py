"""Per-sample layer sizes of a model, from a forward pass on a few samples.

:mod:`vivit.memory.estimate` counts the memory of a request from these sizes; the
probe runs the model on the caller's example inputs only (without gradients,
with the modules' hooks switched off, the caller's random numbers left as they
were), so nothing of the request's batch size is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, no_grad
from torch.nn import Conv1d, Conv2d, Conv3d, Linear, Module
from torch.random import fork_rng

from vivit.engines.base import OutputSelector, select_output
from vivit.errors import InvalidArgumentError
from vivit.model_inputs import ModelInputs, call_model, input_tensors, num_samples

#: Layers whose weight keeps its columns of ``V`` as factors
#: (:class:`~vivit.gram.OuterProductFactors`).
OUTER_PRODUCT_LAYERS = (Linear, Conv1d, Conv2d, Conv3d)


@dataclass(frozen=True)
class ProbedLayer:
    """Per-sample sizes of a leaf module, from a probe forward pass.

    Attributes:
        module: The leaf module.
        inputs: Entries of its first input per sample.
        outputs: Entries of its output per sample.
        unfolded: Entries of a convolution's unfolded input per sample (``0`` for
            every other layer).
        is_input: Whether its first input is the model's input.
    """

    module: Module
    inputs: int
    outputs: int
    unfolded: int
    is_input: bool

    def weight_factor_shape(self) -> tuple[int, int, int, int]:
        """Groups ``G``, positions ``T``, features ``P`` in and ``O`` out per group.

        The shape of the factors of a Linear or convolution weight (inputs
        ``[N, G, T, P]``, backpropagated vectors ``[C, N, G, T, O]``).
        """
        module = self.module
        if isinstance(module, Linear):
            groups, inputs, outputs = 1, module.in_features, module.out_features
            positions = self.inputs // inputs
        else:
            groups, inputs = module.groups, module.weight[0].numel()
            outputs = module.out_channels // groups
            positions = self.unfolded // (groups * inputs)
        return groups, positions, inputs, outputs


def check_example_inputs(example_inputs: ModelInputs) -> None:
    """Refuse example inputs without a sample (the probe divides by their number).

    Args:
        example_inputs: The caller's example inputs: a tensor, or a dict of
            tensors (the model's keyword arguments).

    Raises:
        InvalidArgumentError: For anything but a tensor (or a non-empty dict of
            tensors) with a sample along its first axis.
    """
    if isinstance(example_inputs, Mapping):
        tensors = list(example_inputs.values())
        if tensors and all(isinstance(t, Tensor) for t in tensors):
            for tensor in tensors:
                check_example_inputs(tensor)
            return
    if not isinstance(example_inputs, Tensor):
        raise InvalidArgumentError(
            "example_inputs must be a tensor of a few input samples, "
            "[n, *input_shape], or a dict of such tensors (the model's keyword "
            f"arguments), got {type(example_inputs).__name__}."
        )
    if example_inputs.dim() == 0 or example_inputs.shape[0] < 1:
        raise InvalidArgumentError(
            "example_inputs must hold at least one sample along its first (batch) "
            f"axis, [n, *input_shape], got shape {tuple(example_inputs.shape)}: "
            "pass e.g. X[:1]."
        )


def probe(
    model: Module, inputs: ModelInputs, selector: OutputSelector = None
) -> tuple[list[ProbedLayer], int, tuple[int, ...]]:
    """Per-sample layer sizes from a forward pass on a few samples.

    Args:
        model: The network.
        inputs: A few input samples, ``[n, *input_shape]`` (or a dict of them).
        selector: Picks the output tensor from the model's return value
            (:func:`~vivit.engines.base.select_output`).

    Returns:
        Every leaf module that returned a tensor, in call order, the summed output
        size of those per sample, and the shape of the model's output per sample
        (``[C]``, or ``[C, *T]`` for sequences).

    Raises:
        InvalidArgumentError: If the model's output has not the inputs' samples
            along its first axis.
    """
    layers: list[ProbedLayer] = []
    outputs = 0
    num = num_samples(inputs)
    given = input_tensors(inputs)

    def record(module: Module, args: tuple, output: Tensor) -> None:
        nonlocal outputs
        if not isinstance(output, Tensor):
            return
        outputs += output.numel() // num
        unfolded = 0
        if isinstance(module, (Conv1d, Conv2d, Conv3d)):
            positions = math.prod(output.shape[2:])
            unfolded = module.weight[0].numel() * module.groups * positions
        first = args[0] if args and isinstance(args[0], Tensor) else None
        layers.append(
            ProbedLayer(
                module,
                0 if first is None else first.numel() // num,
                output.numel() // num,
                unfolded,
                is_input=any(first is tensor for tensor in given),
            )
        )

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    devices = [given[0].device] if given[0].device.type == "cuda" else []
    # a forward pass draws random numbers (Dropout): the caller's stay as they were
    with fork_rng(devices=devices), _hooks_replaced(model), no_grad():
        handles = [m.register_forward_hook(record) for m in leaves]
        try:
            result = select_output(call_model(model, inputs), selector)
        finally:
            for handle in handles:
                handle.remove()
    if result.dim() == 0 or len(result) != num:
        raise InvalidArgumentError(
            f"The model's output for example_inputs of shape "
            f"{tuple(given[0].shape)} is {tuple(result.shape)}, expected a tensor "
            f"with their {num} samples along its first axis: pass example inputs "
            "with a batch axis, [n, *input_shape] (e.g. X[:1])."
        )
    return layers, outputs, tuple(result.shape[1:])


@contextmanager
def _hooks_replaced(model: Module) -> Iterator[None]:
    """Switch off every module's forward hooks (BackPACK's store layer inputs)."""
    saved = []
    for module in model.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, type(getattr(module, attr))())
    try:
        yield
    finally:
        for module, attr, hooks in saved:
            setattr(module, attr, hooks)
