"""The sink of every engine: parameter contributions into each group's curvature."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._param_groups import param_group_lists
from vivit._validation import check_model, check_params, check_subsampling
from vivit.engines.base import BatchInfo, ParamContribution
from vivit.gram import ParamFactors
from vivit.losses import check_loss_function


@dataclass
class GroupCurvature:
    """What a backward pass leaves for one parameter group.

    Attributes:
        factor_dtype: Type the engine computed ``V``'s factors in (the model's).
        gram: ``Vᵀ V``, ``[N·C, N·C]``, sample-major, in the collector's
            ``gram_dtype`` (``None``: not formed).
        vt_grads: ``Vᵀ ∇ℓ_n`` of the gradient samples, ``[N·C, N_grad]``, or ``None``.
        ggn_factors: Per-parameter factors of ``V``, if kept.
        grad_factors: Per-parameter per-sample-gradient factors, if kept.
    """

    params: list[Parameter]
    batch: BatchInfo
    factor_dtype: torch.dtype
    gram: Tensor | None
    vt_grads: Tensor | None = None
    ggn_factors: list[ParamFactors] | None = None
    grad_factors: list[ParamFactors] | None = None
    _vt_grads: dict = field(default_factory=dict, repr=False)

    def gradient_products(self, samples: Sequence[int] | None) -> Tensor:
        """``Vᵀ∇ℓ_n`` ``[N·C, N_grad]`` of ``samples`` (``None``: all), cached."""
        key = None if samples is None else tuple(samples)
        if key not in self._vt_grads:
            self._vt_grads[key] = sum(
                gradient_cross_gram(ggn, grad, samples)
                for ggn, grad in zip(self.ggn_factors, self.grad_factors, strict=True)
            )
        return self._vt_grads[key]

    def in_param_dtypes(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """:func:`in_param_dtypes` of the group's parameters."""
        return in_param_dtypes(tensors, self.params)


def in_param_dtypes(
    tensors: Sequence[Tensor], params: Sequence[Parameter]
) -> list[Tensor]:
    """Parameter-space results (eigenvectors, a step) in their parameters' dtypes.

    Always copies: what a caller receives is not a cache of the library's.
    """
    return [t.to(p.dtype, copy=True) for t, p in zip(tensors, params, strict=True)]


def gradient_cross_gram(
    ggn: ParamFactors, grad: ParamFactors, samples: Sequence[int] | None
) -> Tensor:
    """``Vᵀ∇ℓ_n`` ``[N·C, N_grad]`` of a parameter's factors (``samples=None``: all)."""
    return ggn.gram(grad if samples is None else grad.select(samples))


@dataclass
class _Partial:
    batch: BatchInfo | None = None
    factor_dtype: torch.dtype | None = None
    gram: Tensor | None = None
    vt_grads: Tensor | None = None
    ggn: dict[int, ParamFactors] = field(default_factory=dict)
    grad: dict[int, ParamFactors] = field(default_factory=dict)


class GroupCollector:
    """Sums Gram blocks per parameter group: the sink of every engine.

    A complete group goes to ``on_complete(index, curvature)`` and is reset (one
    collector serves any number of passes); other or repeated parameters are ignored.

    Args:
        groups: Parameter groups (disjoint lists of parameters).
        keep_factors: Keep every parameter's factors of ``V`` (and, with
            ``keep_gradient_factors``, its per-sample-gradient factors).
        keep_gram: Form the group's Gram matrix (else the caller may, from factors).
        vt_grads: Accumulate ``Vᵀ∇ℓ_n`` of ``gradient_samples`` (positions in
            the mini-batch; ``None``: all) during the backward pass.
        gram_dtype: Type of the Gram matrix, ``Vᵀ∇ℓ_n`` and every later product
            with the kept factors (``None``: the factors'; ``docs/math.rst``,
            "Precision and the numerical zero").
    """

    def __init__(
        self,
        groups: Sequence[Sequence[Parameter]],
        on_complete: Callable[[int, GroupCurvature], None],
        keep_factors: bool = False,
        keep_gradient_factors: bool = False,
        vt_grads: bool = False,
        gradient_samples: Sequence[int] | None = None,
        gram_dtype: torch.dtype | None = None,
        keep_gram: bool = True,
    ):
        self._groups = [list(group) for group in groups]
        self._group_of = {
            id(p): g for g, group in enumerate(self._groups) for p in group
        }
        self._on_complete = on_complete
        self._keep_factors = keep_factors
        self._keep_gradient_factors = keep_gradient_factors
        self._vt_grads = vt_grads
        self._gradient_samples = gradient_samples
        self._gram_dtype = gram_dtype
        self._keep_gram = keep_gram
        self._missing = {g: self._param_ids(g) for g in range(len(self._groups))}
        self._partial = {g: _Partial() for g in range(len(self._groups))}

    def _param_ids(self, group: int) -> set[int]:
        return {id(p) for p in self._groups[group]}

    def add(self, param: Parameter, contribution: ParamContribution) -> None:
        """Consume one parameter's contribution (its factors and batch context)."""
        group = self._group_of.get(id(param))
        if group is None or id(param) not in self._missing[group]:
            return
        partial = self._partial[group]
        ggn, grad = contribution.ggn, contribution.grad
        partial.factor_dtype = ggn.dtype
        if self._gram_dtype is not None:
            ggn = ggn.to(self._gram_dtype)
            grad = None if grad is None else grad.to(self._gram_dtype)
        if self._keep_gram:
            gram = ggn.gram()
            partial.gram = gram if partial.gram is None else partial.gram.add_(gram)
        partial.batch = contribution.batch
        if self._vt_grads:
            samples = check_subsampling(
                self._gradient_samples, partial.batch.batch_size, "subsampling_grad"
            )
            vt_grads = gradient_cross_gram(ggn, grad, samples)
            old = partial.vt_grads
            partial.vt_grads = vt_grads if old is None else old.add_(vt_grads)
        if self._keep_factors:
            partial.ggn[id(param)] = ggn
        if self._keep_gradient_factors:
            partial.grad[id(param)] = grad
        self._missing[group].discard(id(param))
        if not self._missing[group]:
            self._complete(group)

    def _complete(self, group: int) -> None:
        partial = self._partial[group]
        self._partial[group] = _Partial()
        self._missing[group] = self._param_ids(group)
        params = self._groups[group]
        curvature = GroupCurvature(
            params=params,
            batch=partial.batch,
            factor_dtype=partial.factor_dtype,
            gram=partial.gram,
            vt_grads=partial.vt_grads,
        )
        if self._keep_factors:
            curvature.ggn_factors = [partial.ggn[id(p)] for p in params]
        if self._keep_gradient_factors:
            curvature.grad_factors = [partial.grad[id(p)] for p in params]
        self._on_complete(group, curvature)

    def num_missing(self, group: int) -> int:
        """Number of group ``group``'s parameters that have not contributed yet."""
        return len(self._missing[group])


def checked_param_groups(
    model: Module, loss_func: Module, param_groups: object
) -> tuple[list[list[Parameter]], dict[int, str]]:
    """Check the model and the loss; the groups as lists, each parameter's name.

    ``param_groups=None``: every trainable parameter; names are keyed by ``id``.

    Raises:
        VivitError: For a model or loss function the library cannot use, or
            malformed, 16-bit or non-finite parameters.
    """
    check_model(model)
    check_loss_function(loss_func)
    groups = param_group_lists(param_groups, model)
    names = {id(p): f"parameter {n!r}" for n, p in model.named_parameters()}
    check_params([p for group in groups for p in group], names)
    return groups, names
