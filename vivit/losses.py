"""Loss modules and targets validated; their normalization ``R`` and roots ``√R·S_n``.

From the model output alone, with the module's exact scaling (``docs/math.rst``,
"Losses"; supported options: the guide, "Loss functions and targets").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import (
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    Module,
    MSELoss,
    NLLLoss,
)

from vivit._validation import check_finite
from vivit.errors import InvalidArgumentError, InvalidTargetsError, UnsupportedLossError
from vivit.loss_roots import (
    LossRoot,
    draw_columns,
    exact_columns,
    position_columns,
    sampled_unit_roots,
)

#: Loss modules whose GGN the library computes.
SUPPORTED_LOSSES = (MSELoss, CrossEntropyLoss, BCEWithLogitsLoss)
_SUPPORTED_NAMES = ", ".join(f"torch.nn.{cls.__name__}" for cls in SUPPORTED_LOSSES)


#: Losses on probabilities whose supported twin takes the logits, and what to do.
_ON_LOGITS = {
    NLLLoss: (
        " NLLLoss after log_softmax is CrossEntropyLoss on the logits: drop the "
        "log_softmax (nn.LogSoftmax) and pass the logits to "
        "torch.nn.CrossEntropyLoss, the same loss with the same weight, "
        "ignore_index and reduction."
    ),
    BCELoss: (
        " BCELoss after a sigmoid is BCEWithLogitsLoss on the logits: drop the "
        "sigmoid and pass the logits to torch.nn.BCEWithLogitsLoss, the same loss "
        "with the same weight and reduction."
    ),
}


def check_loss_function(loss_func: object) -> None:
    """Check, before the forward pass, that a loss function is supported.

    Raises:
        UnsupportedLossError: If it is not a supported module (e.g. a function),
            or has a reduction other than ``"mean"``/``"sum"`` or a negative weight.
        NonFiniteError: If a weight is NaN or infinite.
    """
    kind = type(loss_func).__name__
    if not isinstance(loss_func, Module):
        name = getattr(loss_func, "__qualname__", None) or kind
        raise UnsupportedLossError(
            f"loss_func must be a torch.nn loss module, got {name!s} ({kind}). "
            f"Use one of {_SUPPORTED_NAMES} (e.g. torch.nn.CrossEntropyLoss() "
            "instead of torch.nn.functional.cross_entropy)."
        )
    if type(loss_func) not in SUPPORTED_LOSSES:
        raise UnsupportedLossError(
            f"The loss function {kind} is not supported; supported: "
            f"{_SUPPORTED_NAMES}.{_ON_LOGITS.get(type(loss_func), '')}"
        )
    if loss_func.reduction not in ("mean", "sum"):
        raise UnsupportedLossError(
            f"{kind} has reduction={loss_func.reduction!r}; the "
            "GGN is defined for a scalar loss: use reduction='mean' or 'sum'."
        )
    for name in ("weight", "pos_weight"):
        weight = getattr(loss_func, name, None)
        if weight is None:
            continue
        check_finite(weight, f"{kind}.{name}")
        if (weight < 0).any():
            raise UnsupportedLossError(
                f"{kind}.{name} has negative entries ({weight.min().item():g}): the "
                "loss Hessian is then not positive semi-definite and has no square "
                "root. Use non-negative weights."
            )


@dataclass(frozen=True)
class LossNormalization:
    """How a loss module normalizes: ``L_S = R_S Σ_{n∈S} ℓ_n`` (the one place of ``R``).

    Attributes:
        reduction: ``"mean"`` or ``"sum"``.
        sample_weights: ``w_n`` of every sample of the mini-batch.
    """

    reduction: str
    sample_weights: tuple[float, ...]

    @property
    def batch_size(self) -> int:
        """Number of samples ``N`` of the mini-batch."""
        return len(self.sample_weights)

    def reduction_factor(self, samples: Sequence[int] | None = None) -> float:
        """``R_S`` of ``samples`` (``None``: all): ``1 / Σ w_n`` (or 0), sum: ``1``."""
        if self.reduction == "sum":
            return 1.0
        weights = self.sample_weights
        if samples is not None:
            weights = [weights[n] for n in samples]
        total = math.fsum(weights)
        return 1.0 / total if total > 0 else 0.0


#: A loss's ``kind`` (``"mse"``, ``"bce"``: elementwise; ``"ce"``: softmax over
#: axis 1), Hessian scales ``κ c_np`` relative to its unit loss (``[N, *out]``, or
#: ``[N, *T]`` for ``"ce"``) and normalization.
_Structure = tuple[str, Tensor, LossNormalization]


class LossCurvature:
    """The validated loss of a mini-batch ``loss_func(output, targets)``: its roots.

    Attributes:
        normalization: The loss's reduction and per-sample weights.

    Raises:
        UnsupportedLossError: If the loss module or an option is not supported.
        InvalidArgumentError: If the output has no sample, or no entry per sample.
        InvalidTargetsError: If the targets do not fit the output or the loss
            (shape, type, class range, negative probabilities, every target
            ignored).
        NonFiniteError: If the output or a floating target is NaN or infinite.
    """

    def __init__(self, loss_func: Module, output: Tensor, targets: Tensor):
        check_loss_function(loss_func)
        if output.dim() < 1 or output.shape[0] == 0:
            raise InvalidArgumentError(
                f"The model output has shape {tuple(output.shape)}: the loss needs a "
                "batch axis with at least one sample."
            )
        if not isinstance(targets, Tensor):
            raise InvalidTargetsError(
                f"targets must be a tensor, got {type(targets).__name__}."
            )
        if output[0].numel() == 0:
            raise InvalidArgumentError(
                f"The model output has shape {tuple(output.shape)}: no entries per "
                "sample, so the loss has no curvature (its mean is 0/0). Return at "
                "least one output per sample."
            )
        check_finite(output, "model output")
        self.loss_func = loss_func
        self.output = output.detach()
        self.targets = targets.detach()
        if isinstance(loss_func, CrossEntropyLoss):
            structure = _cross_entropy(loss_func, self.output, self.targets)
        else:
            structure = _elementwise(loss_func, self.output, self.targets)
        self._kind, self._scale, self.normalization = structure

    def columns_per_sample(self, mc_samples: int = 0, mc_per: str = "sequence") -> int:
        """``K`` of :meth:`root` (same arguments): ``output[0].numel()`` or ``M·P``."""
        if not mc_samples:
            return self.output[0].numel()
        return mc_samples * self._positions_per_draw(mc_per)

    def _positions_per_draw(self, mc_per: str) -> int:
        """``P`` if each position of a cross-entropy output draws its own column."""
        if self._kind == "ce" and mc_per == "token":
            return self.output[0, 0].numel()
        return 1

    def root(
        self,
        samples: Sequence[int] | None = None,
        mc_samples: int = 0,
        generator: torch.Generator | None = None,
        mc_per: str = "sequence",
    ) -> LossRoot:
        """``√R_S · S_n`` for the samples ``S``, formed a column block at a time.

        ``mc_samples``: ``0`` for the exact root, else ``M`` draws per datum from
        ``generator``; ``mc_per``: a column per draw and position (``"token"``,
        entry ``m·P + p``) or per draw (``"sequence"``; ``docs/math.rst``, "Losses").

        Returns:
            The root ``[K, |S|, *output.shape[1:]]``: exact, or an unbiased
            estimate of ``S_n S_nᵀ``.
        """
        output, scale = self.output, self._scale
        if samples is not None:
            index = torch.as_tensor(list(samples), dtype=torch.long)
            output, scale = output[index.to(output.device)], scale[index]
        root_r = math.sqrt(self.normalization.reduction_factor(samples))
        scale = scale.to(device=output.device, dtype=output.dtype)
        positions = scale.unsqueeze(1) if self._kind == "ce" else scale
        factor = root_r * positions.sqrt()
        if not mc_samples:
            unit = exact_columns(self._kind, output)
        else:
            draws = sampled_unit_roots(self._kind, output, mc_samples, generator)
            unit = (
                draw_columns(draws)
                if self._positions_per_draw(mc_per) == 1
                else position_columns(draws)
            )
        num_columns = self.columns_per_sample(mc_samples, mc_per)
        return LossRoot(unit, num_columns, output.shape, factor)

    def sqrt_hessian(
        self,
        samples: Sequence[int] | None = None,
        mc_samples: int = 0,
        generator: torch.Generator | None = None,
        mc_per: str = "sequence",
    ) -> Tensor:
        """The whole root of :meth:`root` (same arguments) as one tensor."""
        return self.root(samples, mc_samples, generator, mc_per)[:]


def _kappa(reduction: str, positions: int) -> float:
    """Per-sample normalization ``κ`` inside ``ℓ_n``: ``1/P`` (mean) or ``1`` (sum)."""
    return 1.0 / positions if reduction == "mean" else 1.0


def _uniform(reduction: str, batch_size: int) -> LossNormalization:
    return LossNormalization(reduction, (1.0,) * batch_size)


def _check_same_shape(loss_func: Module, output: Tensor, targets: Tensor) -> None:
    name = type(loss_func).__name__
    if targets.shape != output.shape:
        hint = (
            " They hold as many entries: if they pair up one to one, pass "
            "targets.view_as(output) (PyTorch would broadcast "
            f"{tuple(targets.shape)} against {tuple(output.shape)}, pairing every "
            "output with every target)."
            if targets.numel() == output.numel()
            else ""
        )
        raise InvalidTargetsError(
            f"{name} got targets of shape {tuple(targets.shape)} for a model output "
            f"of shape {tuple(output.shape)}; they must have the same shape (no "
            f"broadcasting).{hint}"
        )
    if not targets.is_floating_point():
        raise InvalidTargetsError(
            f"{name} needs floating-point targets, got dtype {targets.dtype}."
        )
    check_finite(targets, "targets")


def _elementwise(loss_func: Module, output: Tensor, targets: Tensor) -> _Structure:
    """``MSELoss`` (scales ``2κ``) or ``BCEWithLogitsLoss`` (``κ`` times weights)."""
    _check_same_shape(loss_func, output, targets)
    kappa = _kappa(loss_func.reduction, output[0].numel())
    normalization = _uniform(loss_func.reduction, output.shape[0])
    if isinstance(loss_func, MSELoss):
        scale = torch.full(output.shape, 2.0 * kappa, dtype=torch.float64)
        return "mse", scale, normalization
    for name in ("weight", "pos_weight"):
        weight = getattr(loss_func, name)
        if weight is not None and not _broadcasts(weight.shape, output.shape):
            per_sample = weight.dim() == output.dim() and _broadcasts(
                weight.shape[1:], output.shape[1:]
            )
            hint = (
                " A weight per sample does not follow a split of the batch into "
                "chunks (chunk_size) or a data loader's batches: if you split it, "
                "pass the whole batch at once."
                if per_sample
                else ""
            )
            raise UnsupportedLossError(
                f"BCEWithLogitsLoss.{name} has shape {tuple(weight.shape)}, which "
                f"does not broadcast to the output shape {tuple(output.shape)}.{hint}"
            )
    scale = torch.full(output.shape, kappa, dtype=torch.float64)
    y = targets.to(torch.float64).cpu()
    if loss_func.pos_weight is not None:
        # ∇²ℓ = weight · (1 + (pos_weight - 1) y) · σ(1-σ)
        pos_weight = loss_func.pos_weight.detach().to(torch.float64).cpu()
        factor = 1 + (pos_weight - 1) * y
        if (factor < 0).any():
            n = _first_sample(factor < 0)
            raise InvalidTargetsError(
                f"BCEWithLogitsLoss with pos_weight has a negative loss Hessian for "
                f"targets outside [0, 1] (first at sample {n}): use targets in [0, 1]."
            )
        scale = scale * factor
    if loss_func.weight is not None:
        scale = scale * loss_func.weight.detach().to(torch.float64).cpu()
    return "bce", scale.expand(output.shape), normalization


#: Class-index dtypes ``CrossEntropyLoss`` accepts.
_INDEX_DTYPES = (torch.int64, torch.uint8)


def _first_sample(mask: Tensor) -> int:
    return int(mask.reshape(len(mask), -1).any(1).nonzero()[0])


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _cross_entropy(
    loss_func: CrossEntropyLoss, output: Tensor, targets: Tensor
) -> _Structure:
    if output.dim() < 2:
        raise InvalidTargetsError(
            f"CrossEntropyLoss needs a model output [N, C] or [N, C, *T] with a batch "
            f"axis, got shape {tuple(output.shape)}: PyTorch reads it as the logits "
            "of one sample without a batch axis, which leaves no samples for the "
            "GGN. Give it a batch axis (output.unsqueeze(0), targets.unsqueeze(0)); "
            "for one logit per sample (a binary classifier) use "
            "torch.nn.BCEWithLogitsLoss with float targets of the output's shape."
        )
    num_classes = output.shape[1]
    positions = output[0, 0].numel()
    reduction = loss_func.reduction
    weight = (
        torch.ones(num_classes, dtype=torch.float64)
        if loss_func.weight is None
        else loss_func.weight.detach().to(torch.float64).cpu()
    )
    if weight.shape != (num_classes,):
        raise UnsupportedLossError(
            f"CrossEntropyLoss.weight has shape {tuple(weight.shape)}, expected one "
            f"weight per class, ({num_classes},)."
        )
    smoothing = float(loss_func.label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise UnsupportedLossError(
            f"CrossEntropyLoss.label_smoothing must lie in [0, 1], got {smoothing}."
        )
    kappa = _kappa(reduction, positions)
    if targets.is_floating_point():
        # probability targets ∈ [N, C, *T]: ℓ = -Σ_c w_c q'_c log p_c,
        # q' = (1 - ε) q + ε / C; mean divides by N·T whatever the weights.
        indices_shape = (output.shape[0], *output.shape[2:])
        if targets.shape != output.shape and targets.shape == indices_shape:
            raise InvalidTargetsError(
                f"CrossEntropyLoss got floating-point targets of shape "
                f"{tuple(targets.shape)}, the shape of class indices for a model "
                f"output of shape {tuple(output.shape)}: class indices must be "
                f"integers (targets.long()); floating-point targets are class "
                f"probabilities of the output's shape {tuple(output.shape)}."
            )
        _check_same_shape(loss_func, output, targets)
        q = targets.to(torch.float64).cpu()
        if (q < 0).any():
            n = _first_sample(q < 0)
            raise InvalidTargetsError(
                "CrossEntropyLoss got probability targets with negative entries "
                f"(first at sample {n}): soft targets must be non-negative (they "
                "need not sum to one; their sum scales the loss Hessian)."
            )
        q = (1 - smoothing) * q + smoothing / num_classes
        mass = torch.einsum("c,nc...->n...", weight, q)
        return "ce", kappa * mass, _uniform(reduction, output.shape[0])

    if targets.dtype not in _INDEX_DTYPES:
        raise InvalidTargetsError(
            f"CrossEntropyLoss needs class-index targets (torch.long) or "
            f"probability targets (floating dtype), got dtype {targets.dtype}: "
            "convert them with targets.long()."
        )
    expected = (output.shape[0], *output.shape[2:])
    if tuple(targets.shape) != expected:
        raise InvalidTargetsError(
            f"CrossEntropyLoss got class-index targets of shape "
            f"{tuple(targets.shape)} for a model output of shape "
            f"{tuple(output.shape)}; expected {expected} (or probability targets "
            f"of shape {tuple(output.shape)}).{_unit_axes(targets, expected)}"
            f"{_flattened_positions(output, targets)}{_classes_last(output, targets)}"
        )
    y = targets.cpu().long()
    counted = y != loss_func.ignore_index
    outside = counted & ((y < 0) | (y >= num_classes))
    if outside.any():
        n = _first_sample(outside)
        bad = y[n][outside[n]][0].item()
        raise InvalidTargetsError(
            f"CrossEntropyLoss got the class index {bad} at sample {n}, outside [0, "
            f"{num_classes}) and not the ignore_index ({loss_func.ignore_index})."
        )
    if reduction == "mean" and not counted.any():
        raise InvalidTargetsError(
            f"Every target equals ignore_index={loss_func.ignore_index}: the loss is "
            "0/0 (NaN) and has no curvature. Pass a batch with at least one counted "
            "target."
        )
    # ℓ_np = -(1 - ε) w_y log p_y - (ε / C) Σ_c w_c log p_c on counted positions;
    # mean divides by the weight of the counted targets Σ w_y.
    target_weight = torch.where(counted, weight[y.clamp(0, num_classes - 1)], 0.0)
    mass = (1 - smoothing) * target_weight + smoothing * weight.mean() * counted
    sample_weights = target_weight.reshape(len(y), -1).sum(1) / positions
    if reduction == "mean":
        total = float(sample_weights.sum())
        if total <= 0:
            raise InvalidTargetsError(
                "Every counted target has class weight 0: the mean loss is 0/0 "
                "(NaN). Give the classes present in the batch a positive weight."
            )
        normalization = LossNormalization(reduction, tuple(sample_weights.tolist()))
    else:
        normalization = _uniform(reduction, output.shape[0])
    return "ce", kappa * mass, normalization


def _unit_axes(targets: Tensor, expected: tuple[int, ...]) -> str:
    """Advice for class indices with extra axes of size one (``[N, 1]`` for ``[N]``)."""
    if targets.numel() != math.prod(expected) or [
        size for size in targets.shape if size != 1
    ] != [size for size in expected if size != 1]:
        return ""
    fix = (
        "targets.squeeze(1) (or targets.view(-1))"
        if tuple(targets.shape) == (*expected, 1) and len(expected) == 1
        else f"targets.reshape({', '.join(map(str, expected))})"
    )
    return (
        " The targets hold one class index per sample (and position), with an "
        f"extra axis of size one: remove it, {fix}; the logits stay as they are."
    )


def _flattened_positions(output: Tensor, targets: Tensor) -> str:
    """Advice for logits ``[N·T, C]`` of sequences ``[N, T]`` (else ``""``)."""
    if (
        output.dim() != 2
        or targets.dim() < 2
        or targets.numel() != output.shape[0]
        or targets.shape[1:].numel() == 1  # an axis of one: _unit_axes advises
    ):
        return ""
    samples, positions = targets.shape[0], tuple(targets.shape[1:])
    sizes = ", ".join(map(str, positions))
    return (
        f" The output looks like the logits of {samples} samples with "
        f"{'×'.join(map(str, positions))} positions each, flattened into its "
        "first axis: the first axis must be the samples (the GGN's per-sample "
        "structure, and the mean over positions, follow it). Return the logits "
        f"as [N, C, *T], e.g. logits.reshape({samples}, {sizes}, "
        f"{output.shape[1]}).movedim(-1, 1), with targets {tuple(targets.shape)}."
    )


def _classes_last(output: Tensor, targets: Tensor) -> str:
    """Advice for logits ``[N, *T, C]`` (Hugging Face's) of targets ``[N, *T]``."""
    if output.dim() < 3 or tuple(targets.shape) != tuple(output.shape[:-1]):
        return ""
    return (
        " The output looks like logits with the classes on the last axis, as "
        "Hugging Face models return them: move them to dim 1 with "
        "output=vivit.huggingface.token_logits (or logits.movedim(-1, 1))."
    )
