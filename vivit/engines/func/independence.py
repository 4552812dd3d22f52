"""Refuse models whose output for one sample depends on other samples or on chance.

Every engine assumes ``f(θ, x_n)`` depends on sample ``n`` alone (``docs/math.rst``,
"Setting").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import Module, RNNBase
from torch.nn.modules.dropout import _DropoutNd

from vivit._validation import check_batch_norm
from vivit.errors import SampleCouplingError
from vivit.model_inputs import ModelInputs, map_inputs, num_samples


def check_layers(model: Module) -> None:
    """Refuse layers that couple samples or draw random numbers.

    Raises:
        BatchNormTrainingError: For a BatchNorm layer that uses batch statistics
            (training mode, or no running statistics).
        SampleCouplingError: For a dropout layer in training mode with ``p > 0``,
            or a recurrent layer in training mode with dropout between its layers.
    """
    for name, module in model.named_modules():
        check_batch_norm(module, name or "The model")
        if isinstance(module, _DropoutNd) and module.training and module.p > 0:
            how = ""
        elif (
            isinstance(module, RNNBase)
            and module.training
            and module.dropout > 0
            and module.num_layers > 1
        ):
            how = f" with dropout={module.dropout} between its layers"
        else:
            continue
        raise SampleCouplingError(
            f"{name or 'The model'} ({module}) is in training mode{how}: the forward "
            "pass is random, so the GGN of one mini-batch is not defined. Call "
            "model.eval() before computing curvature."
        )


def check_samples_independent(
    forward: Callable[[ModelInputs], Tensor], inputs: ModelInputs, output: Tensor
) -> None:
    """Re-run ``forward`` with sample 0 replaced by sample 1: the others' must match.

    ``output``: the (detached) output of ``inputs``.

    Raises:
        SampleCouplingError: If an output changed.
    """
    several = num_samples(inputs) > 1
    perturbed = map_inputs(inputs, _first_replaced if several else Tensor.clone)
    again = forward(perturbed)
    expected = _first_replaced(output) if several else output.clone()
    eps = torch.finfo(output.dtype).eps if output.is_floating_point() else 0.0
    tolerance = eps**0.5 * (1.0 + output.abs().max().item())
    if again.shape != expected.shape or (again - expected).abs().max() > tolerance:
        raise SampleCouplingError(
            "The model's output for one sample depends on the other samples of the "
            "mini-batch or on random numbers: changing sample 0 (or running the "
            "model again) changed the outputs of other samples. The GGN's per-sample "
            "structure needs independent, deterministic samples: call model.eval() "
            "(BatchNorm, dropout) and remove operations that mix the batch axis."
        )


def _first_replaced(tensor: Tensor) -> Tensor:
    """A copy of ``tensor`` whose sample 0 is a copy of sample 1."""
    copy = tensor.clone()
    copy[0] = tensor[1]
    return copy
