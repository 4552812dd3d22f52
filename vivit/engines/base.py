"""The engine seam: what every engine hands to the group pipeline.

An engine turns "compute the loss" plus named parameter groups into one
:class:`BatchInfo` (reduction, samples, columns per sample, subsampling) and, per
parameter, a :class:`ParamContribution` (its columns of ``V`` and per-sample
gradients as :mod:`vivit.gram` factor objects). It hands each contribution to a
:class:`ContributionSink` (the group pipeline,
:class:`vivit.sources.collector.GroupCollector`) as soon as it exists, and returns
the loss and the mini-batch gradient.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit.errors import InvalidArgumentError
from vivit.gram import ParamFactors
from vivit.losses import LossNormalization
from vivit.model_inputs import ModelInputs

#: What picks the tensor the loss is computed from out of a model's output:
#: ``None`` (the model returns that tensor), the key, attribute or position of a
#: structured output (``"logits"``, ``0``), or a function applied to the output.
OutputSelector = str | int | Callable[[object], Tensor] | None


def check_output_selector(output: object) -> None:
    """Check an ``output`` option.

    Args:
        output: ``None``, a non-empty string, an int or a callable.

    Raises:
        InvalidArgumentError: If it is none of these.
    """
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


def selects_by_name(selector: OutputSelector) -> bool:
    """Whether ``selector`` picks a tensor the model returned (no computation).

    Args:
        selector: An ``output`` option.

    Returns:
        ``True`` for ``None``, a key, attribute or position; ``False`` for a
        function, which may compute from the output.
    """
    return not callable(selector)


def select_output(output: object, selector: OutputSelector = None) -> Tensor:
    """The tensor the loss is computed from, out of what the model returned.

    Args:
        output: The model's return value.
        selector: ``None``: ``output`` must be a tensor; a string: the key or
            attribute of a structured output (a dict, a ``ModelOutput``, a named
            tuple, a dataclass); an int: the position in a tuple or list; a
            callable: applied to ``output``.

    Returns:
        The selected output tensor.

    Raises:
        InvalidArgumentError: If the model returned something other than a tensor
            and no selector was given (naming its type and fields), if the
            selector names no field of it, or if the selection is not a tensor.
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
        selected = selector(output)
        what = "output=<function>"
    else:
        selected = _field(output, selector)
        what = f"output={selector!r}"
    if not isinstance(selected, Tensor):
        raise InvalidArgumentError(
            f"{what} selected {_describe(selected)} from the model's output "
            f"({_describe(output)}); it must select the output tensor."
        )
    return selected


def _field(output: object, key: str | int) -> object:
    """``output[key]`` of a mapping or sequence, else ``output.key``."""
    if isinstance(output, Mapping) and key in output:
        return output[key]
    if isinstance(key, int) and isinstance(output, (tuple, list)):
        if -len(output) <= key < len(output):
            return output[key]
    elif (
        isinstance(key, str)
        and not isinstance(output, Mapping)
        and hasattr(output, key)
    ):
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
    fields = _fields(output)
    if fields:
        return f"a {name} with fields {fields}"
    if isinstance(output, (tuple, list)):
        return f"a {name} of {len(output)} entries"
    return f"a {name}"


def _example(output: object) -> str:
    """``output='logits'`` for a structured output, ``output=0`` for a tuple."""
    fields = _fields(output)
    if fields:
        return f"output={'logits' if 'logits' in fields else fields[0]!r}"
    if isinstance(output, (tuple, list)):
        return "output=0 (the position in the returned tuple)"
    return "output='logits' (a key or attribute)"


@dataclass(frozen=True)
class BatchInfo:
    """How the mini-batch and the loss define the scaling of ``V``.

    Attributes:
        normalization: The loss's reduction and per-sample weights; gives ``R``
            of the loss on any set of samples (:mod:`vivit.losses`).
        ggn_samples: Samples whose columns ``V`` holds (all, or the subsampling).
        columns_per_sample: ``C`` (exact, ``C·T`` for cross-entropy on ``[N, C,
            *T]``) or ``M`` (Monte-Carlo samples; ``M·T`` per token).
        mc_samples: ``0`` for the exact loss Hessian, else ``M``.
    """

    normalization: LossNormalization
    ggn_samples: tuple[int, ...]
    columns_per_sample: int
    mc_samples: int

    @property
    def reduction(self) -> str:
        """The loss function's reduction, ``"mean"`` or ``"sum"``."""
        return self.normalization.reduction

    @property
    def batch_size(self) -> int:
        """Number of samples ``N`` in the mini-batch."""
        return self.normalization.batch_size

    def reduction_factor(self, samples: Sequence[int] | None = None) -> float:
        """``R`` of the loss evaluated on ``samples`` alone.

        Args:
            samples: Sample indices in the mini-batch; ``None`` for all.

        Returns:
            ``R`` (see :meth:`vivit.losses.LossNormalization.reduction_factor`).
        """
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
    """One parameter's share of a backward pass.

    Attributes:
        ggn: The parameter's columns of ``V`` (the GGN's samples).
        grad: Per-sample gradients ``∇ℓ_n`` of every sample in the mini-batch, as
            factors with one column per sample; ``None`` unless requested.
        batch: Scaling context.
    """

    ggn: ParamFactors
    grad: ParamFactors | None
    batch: BatchInfo


@dataclass(frozen=True)
class CurvatureRequest:
    """What a front door asks an engine for.

    Attributes:
        param_groups: Disjoint lists of parameters, one GGN block each.
        mc_samples: ``0`` for the exact loss Hessian, else ``M`` MC samples.
        mc_per: ``"token"`` or ``"sequence"``: what one MC draw of a
            cross-entropy output ``[N, C, *T]`` becomes
            (:class:`~vivit.options.CurvatureOptions`).
        subsampling: Samples whose curvature is used (``None``: all).
        generator: Random generator for reproducible MC sampling.
        compute_gradients: Also hand out per-sample-gradient factors.
        num_grams: How many Gram matrices of side ``N·C`` the caller forms right
            after the backward pass (``None``: one per group); a request whose
            Gram matrices cannot fit is refused before the backward pass.
        gram_dtype: Type the caller accumulates the Gram matrices in (``None``:
            the factors').
        output: Selects the output tensor from the model's return value
            (:func:`select_output`).
        samples_per_pass: Most samples per backward pass of an engine that
            splits a part (``None``: all at once); the plan decides it from the
            engine's :attr:`~Engine.memory_budget`.
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
    """What a run leaves besides the contributions.

    Attributes:
        loss: The mini-batch loss, detached.
        gradients: ``∇L`` of every requested parameter, in request order (zeros
            for parameters the loss does not depend on).
    """

    loss: Tensor
    gradients: list[Tensor]


class Engine(ABC):
    """Computes the per-parameter factors of ``V`` of one mini-batch.

    Attributes:
        name: ``"backpack"`` or ``"func"``.
        memory_budget: Tensor entries one backward pass may hold, for an engine
            that splits a part's samples into passes (``None``: it does not).
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
        """Evaluate ``loss_func(model(inputs), targets)`` and its curvature factors.

        Leaves the parameters' ``.grad`` as they were.

        Args:
            model: The network.
            loss_func: The loss module.
            data: ``(inputs, targets)`` of the mini-batch; the inputs a tensor
                or a dict of tensors (:func:`vivit.model_inputs.call_model`).
            request: Parameter groups and curvature options.
            sink: Receives every requested parameter's contribution.

        Returns:
            The loss and the mini-batch gradient.
        """
