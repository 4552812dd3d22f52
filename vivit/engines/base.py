"""The engine seam: what every engine hands to the group pipeline.

Each requested parameter's :class:`ParamContribution` goes to a
:class:`ContributionSink` as soon as it exists; the run returns loss and gradient.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_finite
from vivit.errors import InvalidArgumentError
from vivit.gram import ParamFactors
from vivit.gram.memory import check_gram_fits
from vivit.losses import LossCurvature, LossNormalization
from vivit.model_inputs import ModelInputs

#: Picks the loss's input from a model's output: ``None`` (the output itself), a
#: key, attribute or position (``"logits"``, ``0``), or a function of the output.
OutputSelector = str | int | Callable[[object], Tensor] | None


def check_output_selector(output: object) -> None:
    """Raise :class:`~vivit.errors.InvalidArgumentError` unless an OutputSelector."""
    if (
        output is None
        or callable(output)
        or (isinstance(output, str) and output)
        or (isinstance(output, int) and not isinstance(output, bool))
    ):
        return
    raise InvalidArgumentError(
        "output must be None (the model returns the output tensor), the key or "
        "attribute of the model's structured output (output='logits'), a position "
        "in a returned tuple (output=0), or a function of the model's output "
        f"(output=lambda out: out[0]), got {output!r}."
    )


def select_output(output: object, selector: OutputSelector = None) -> Tensor:
    """The tensor the loss is computed from, out of what the model returned.

    Raises:
        InvalidArgumentError: If ``output`` (without selector) or the selection is
            not a tensor, or the selector names no field of it.
    """
    if selector is None:
        if isinstance(output, Tensor):
            return output
        raise InvalidArgumentError(
            f"The model returned {_describe(output)}, not a tensor: say which "
            f"tensor the loss is computed from with {_example(output)} (or a "
            "function of the model's output, output=lambda out: ...)."
        )
    if callable(selector):
        selected, what = selector(output), "output=<function>"
    else:
        selected, what = _field(output, selector), f"output={selector!r}"
    if not isinstance(selected, Tensor):
        raise InvalidArgumentError(
            f"{what} selected {_describe(selected)} from the model's output "
            f"({_describe(output)}); it must select the output tensor."
        )
    return selected


def _field(output: object, key: str | int) -> object:
    """``output[key]`` of a mapping or sequence, else ``output.key``."""
    if isinstance(output, Mapping):
        if key in output:
            return output[key]
    elif isinstance(key, int) and isinstance(output, (tuple, list)):
        if -len(output) <= key < len(output):
            return output[key]
    elif isinstance(key, str) and hasattr(output, key):
        return getattr(output, key)
    raise InvalidArgumentError(
        f"output={key!r} names no field of the model's output, "
        f"{_describe(output)}: pass {_example(output)} or a function of it."
    )


def _fields(output: object) -> list[str]:
    """The keys or named fields of a structured output."""
    if isinstance(output, Mapping):
        return [str(key) for key in output]
    if dataclasses.is_dataclass(output):
        return [f.name for f in dataclasses.fields(output)]
    return [str(name) for name in getattr(output, "_fields", ())]


def _describe(output: object) -> str:
    """``a tuple of 2 entries``, ``a dict with fields ['logits', 'loss']``, ..."""
    cls = type(output)
    name = cls.__name__ if cls.__module__ == "builtins" else cls.__qualname__
    if fields := _fields(output):
        return f"a {name} with fields {fields}"
    if isinstance(output, (tuple, list)):
        return f"a {name} of {len(output)} entries"
    return f"a {name}"


def _example(output: object) -> str:
    """``output='logits'`` for a structured output, ``output=0`` for a tuple."""
    if fields := _fields(output):
        return f"output={'logits' if 'logits' in fields else fields[0]!r}"
    if isinstance(output, (tuple, list)):
        return "output=0 (the position in the returned tuple)"
    return "output='logits' (a key or attribute)"


def graph_nodes(tensor: Tensor) -> Iterator[object]:
    """Every node of the autograd graph of ``tensor``, once."""
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            yield node
            stack.extend(child for child, _ in node.next_functions)


def check_scalar_loss(loss: Tensor) -> Tensor:
    """``loss``; an :class:`~vivit.errors.InvalidArgumentError` unless a scalar."""
    if loss.numel() != 1:
        raise InvalidArgumentError(
            f"The loss has shape {tuple(loss.shape)}; the GGN is defined for a "
            "scalar loss: use reduction='mean' or 'sum'."
        )
    return loss


def model_loss(
    loss_func: Module, output: Tensor, targets: Tensor
) -> tuple[Tensor, LossCurvature]:
    """The scalar loss of a finite ``output`` and its curvature (targets checked)."""
    check_finite(output, "model output")
    curvature = LossCurvature(loss_func, output, targets)
    return check_scalar_loss(loss_func(output, targets)), curvature


@dataclass(frozen=True)
class BatchInfo:
    """How the mini-batch and the loss define the scaling of ``V``.

    Attributes:
        normalization: The loss's reduction and per-sample weights (``R``).
        ggn_samples: Samples whose columns ``V`` holds (all, or the subsampling).
        columns_per_sample: ``C`` (``C·T`` on ``[N, C, *T]``) or ``M`` (``M·T``).
        mc_samples: ``0`` for the exact loss Hessian, else ``M``.
    """

    normalization: LossNormalization
    ggn_samples: tuple[int, ...]
    columns_per_sample: int
    mc_samples: int

    @classmethod
    def of(
        cls, curvature: LossCurvature, output: Tensor, request: CurvatureRequest
    ) -> BatchInfo:
        """The batch of a loss on ``output`` (GramTooLargeError unless Grams fit)."""
        mc, subsampling = request.mc_samples, request.subsampling
        samples = tuple(range(output.shape[0]) if subsampling is None else subsampling)
        columns = curvature.columns_per_sample(mc, request.mc_per)
        dtype, rows = request.gram_dtype or output.dtype, len(samples) * columns
        check_gram_fits(rows, request.grams_formed, dtype, output.device)
        return cls(curvature.normalization, samples, columns, mc)

    @property
    def reduction(self) -> str:
        """The loss function's reduction, ``"mean"`` or ``"sum"``."""
        return self.normalization.reduction

    @property
    def batch_size(self) -> int:
        """Number of samples ``N`` in the mini-batch."""
        return self.normalization.batch_size

    def reduction_factor(self, samples: Sequence[int] | None = None) -> float:
        """``R`` of the loss on ``samples`` alone (``None``: all samples)."""
        return self.normalization.reduction_factor(samples)

    @property
    def per_sample_gradient_scale(self) -> float:
        """``1/R`` of the whole batch: turns ``∂L/∂z_n`` into ``∂ℓ_n/∂z_n``."""
        return 1.0 / self.reduction_factor()

    @property
    def ggn_reduction_factor(self) -> float:
        """``R`` of the GGN's samples (the loss on them alone)."""
        return self.reduction_factor(self.ggn_samples)


@dataclass
class ParamContribution:
    """One parameter's columns of ``V``, per-sample gradients (or ``None``), batch."""

    ggn: ParamFactors
    grad: ParamFactors | None
    batch: BatchInfo


@dataclass(frozen=True)
class CurvatureRequest:
    """What a front door asks an engine for.

    Attributes:
        param_groups: Disjoint lists of parameters, one GGN block each.
        mc_samples, mc_per, subsampling, generator, gram_dtype: As the options
            of :class:`~vivit.options.CurvatureOptions`.
        output: Selects the output tensor (:func:`select_output`).
        compute_gradients: Also hand out per-sample-gradient factors.
        num_grams: Gram matrices the caller forms after the backward pass
            (``None``: one per group); refused before it if they cannot fit.
        samples_per_pass: Most samples per backward pass (``None``: all), from
            :attr:`Engine.memory_budget`.
    """

    param_groups: list[list[Parameter]]
    mc_samples: int = 0
    mc_per: str = "token"
    subsampling: list[int] | None = None
    generator: torch.Generator | None = None
    compute_gradients: bool = True
    num_grams: int | None = None
    gram_dtype: torch.dtype | None = None
    output: OutputSelector = None
    samples_per_pass: int | None = None

    @property
    def grams_formed(self) -> int:
        """Gram matrices formed right after the backward pass (memory check)."""
        return len(self.param_groups) if self.num_grams is None else self.num_grams

    @property
    def params(self) -> list[Parameter]:
        """Every requested parameter, group by group."""
        return [p for group in self.param_groups for p in group]


class ContributionSink(Protocol):
    """Receives the contributions of an engine (the group pipeline)."""

    def add(self, param: Parameter, contribution: ParamContribution) -> None:
        """Consume one parameter's contribution."""


@dataclass
class EngineOutput:
    """The loss (detached) and ``∇L`` in request order (zero where unused)."""

    loss: Tensor
    gradients: list[Tensor]


class Engine(ABC):
    """Computes the per-parameter factors of ``V`` of one mini-batch.

    ``name``: ``"backpack"`` or ``"func"``; ``memory_budget``: tensor entries one
    backward pass may hold, for an engine that splits a part's samples (or ``None``).
    """

    name: str
    memory_budget: int | None = None

    @abstractmethod
    def run(
        self,
        model: Module,
        loss_func: Module,
        data: tuple[ModelInputs, Tensor],
        request: CurvatureRequest,
        sink: ContributionSink,
    ) -> EngineOutput:
        """Evaluate the loss of ``data`` and pass each parameter's factors to ``sink``.

        The parameters' ``.grad`` are left as they were.
        """
