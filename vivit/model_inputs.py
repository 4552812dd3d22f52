"""A mini-batch's model inputs: one tensor, or a dict of tensors passed by keyword.

Every tensor of a dict holds the samples along its first axis: slicing the samples
slices every one of them alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor
from torch.nn import Module

#: A batch's inputs: a tensor, or names mapped to tensors (``model(**inputs)``).
ModelInputs = Tensor | Mapping[str, Tensor]


def input_tensors(inputs: ModelInputs) -> list[Tensor]:
    """The inputs' tensors: the tensor itself, or the mapping's values, in order."""
    return list(inputs.values()) if isinstance(inputs, Mapping) else [inputs]


def num_samples(inputs: ModelInputs) -> int:
    """Number of samples ``N``: the first axis of (every tensor of) checked inputs."""
    return input_tensors(inputs)[0].shape[0]


def map_inputs(
    inputs: ModelInputs, function: Callable[[Tensor], Tensor]
) -> ModelInputs:
    """The inputs (a tensor, or a dict: same keys) with ``function`` applied to each."""
    if isinstance(inputs, Mapping):
        return {key: function(value) for key, value in inputs.items()}
    return function(inputs)


def take_samples(inputs: ModelInputs, index: slice | Tensor) -> ModelInputs:
    """Some samples of the inputs: every tensor indexed by ``index`` along axis 0."""
    return map_inputs(inputs, lambda tensor: tensor[index])


def call_model(model: Module, inputs: ModelInputs) -> object:
    """``model(**inputs)`` for a mapping, ``model(inputs)`` for a tensor."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)
