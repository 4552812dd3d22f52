"""Loss-Hessian square roots of ``torch.nn`` loss modules, for every engine.

The GGN needs, per sample, a factor of the Hessian of the loss with respect to the
model output, with exactly the scaling the loss module applies (``docs/math.rst``,
section "Losses"). This module computes it from the loss module, the model output
and the targets alone (no BackPACK), after validating the module's options and the
targets. Supported: ``MSELoss``, ``CrossEntropyLoss`` (class-index or probability
targets, outputs ``[N, C]`` or ``[N, C, *T]``, ``weight``, ``ignore_index``,
``label_smoothing``) and ``BCEWithLogitsLoss`` (``weight``, ``pos_weight``, soft
targets), each with reduction ``"mean"`` or ``"sum"``.

Interface::

    check_loss_function(loss_func)               # before the forward pass
    curvature = LossCurvature(loss_func, output, targets)   # validates the targets
    curvature.normalization.reduction_factor(samples)       # R of the loss on samples
    curvature.root(samples, mc_samples, generator, mc_per)  # √R_S · S_n, lazily
    curvature.sqrt_hessian(samples, mc_samples, generator, mc_per)  # all at once

The root has BackPACK's layout ``[K, |S|, *output.shape[1:]]`` with
``K = output[0].numel()`` (exact; for ``[N, C, *T]`` outputs entry ``c·T + t``,
non-zero at position ``t`` only), ``K = M·T`` (Monte Carlo per token, entry
``m·T + t``) or ``K = M`` (per sequence). :meth:`LossCurvature.root` forms a
block of columns when sliced, never the whole root unless asked. Its ``R_S`` is
that of the same loss evaluated on the samples ``S`` alone, so the GGN of a
subsampling is exact, and
``L = R Σ_n ℓ_n`` holds with the per-sample losses ``ℓ_n`` of ``docs/math.rst``.
:class:`LossNormalization` is the one place where ``R`` is computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, Module, MSELoss

from vivit._validation import check_finite
from vivit.errors import InvalidArgumentError, InvalidTargetsError, UnsupportedLossError

#: Loss modules whose GGN the library computes.
SUPPORTED_LOSSES: tuple[type[Module], ...] = (
    MSELoss,
    CrossEntropyLoss,
    BCEWithLogitsLoss,
)


def _supported_names() -> str:
    return ", ".join(f"torch.nn.{cls.__name__}" for cls in SUPPORTED_LOSSES)


def check_loss_function(loss_func: object) -> None:
    """Check that a loss function is a supported module with supported options.

    Args:
        loss_func: The loss function.

    Raises:
        UnsupportedLossError: If it is not a module (e.g. a function such as
            ``torch.nn.functional.cross_entropy``), not a supported module, or
            has a reduction other than ``"mean"``/``"sum"`` or a negative or
            non-finite weight.
    """
    if not isinstance(loss_func, Module):
        raise UnsupportedLossError(
            f"loss_func must be a torch.nn loss module, got {_describe(loss_func)}. "
            f"Use one of {_supported_names()} (e.g. torch.nn.CrossEntropyLoss() "
            "instead of torch.nn.functional.cross_entropy)."
        )
    if type(loss_func) not in SUPPORTED_LOSSES:
        raise UnsupportedLossError(
            f"The loss function {type(loss_func).__name__} is not supported; "
            f"supported: {_supported_names()}."
        )
    if loss_func.reduction not in ("mean", "sum"):
        raise UnsupportedLossError(
            f"{type(loss_func).__name__} has reduction={loss_func.reduction!r}; the "
            "GGN is defined for a scalar loss: use reduction='mean' or 'sum'."
        )
    for name in ("weight", "pos_weight"):
        weight = getattr(loss_func, name, None)
        if weight is None:
            continue
        check_finite(weight, f"{type(loss_func).__name__}.{name}")
        if (weight < 0).any():
            raise UnsupportedLossError(
                f"{type(loss_func).__name__}.{name} has negative entries "
                f"({weight.min().item():g}): the loss Hessian is then not positive "
                "semi-definite and has no square root. Use non-negative weights."
            )


def _describe(obj: object) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__name__
    return f"{name!s} ({type(obj).__name__})"


@dataclass(frozen=True)
class LossNormalization:
    """How a loss module normalizes: ``L_S = R_S Σ_{n∈S} ℓ_n`` on samples ``S``.

    ``R_S = 1 / Σ_{n∈S} w_n`` for reduction ``"mean"`` and ``1`` for ``"sum"``. The
    sample weights ``w_n`` are ``1`` unless targets are ignored or classes weighted
    (``CrossEntropyLoss`` with class-index targets), where ``w_n`` is the weight of
    sample ``n``'s counted targets divided by its number of positions
    (``docs/math.rst``, "Losses"). If the samples carry no weight at all (every
    target ignored), their loss is ``0/0`` and ``R_S = 0``: they have no curvature.

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
        """``R`` of the loss evaluated on ``samples`` alone.

        Args:
            samples: Sample indices in the mini-batch; ``None`` for all.

        Returns:
            ``1 / Σ_{n∈S} w_n`` for mean reduction (``0`` if that sum is ``0``),
            ``1`` for sum reduction.
        """
        if self.reduction == "sum":
            return 1.0
        weights = (
            self.sample_weights
            if samples is None
            else [self.sample_weights[n] for n in samples]
        )
        total = math.fsum(weights)
        return 1.0 / total if total > 0 else 0.0


@dataclass(frozen=True)
class _Structure:
    """Per-position Hessian scales of a loss, relative to its unit loss.

    Attributes:
        kind: ``"mse"``, ``"bce"`` (elementwise) or ``"ce"`` (softmax over axis 1).
        scale: ``c_np ≥ 0`` such that ``∇²ℓ_n`` is ``c_np`` times the unit Hessian
            at position ``p`` (``1``, ``σ(1-σ)`` or ``diag(p) - ppᵀ``); shape
            ``[N, *output.shape[1:]]`` (elementwise) or ``[N, *T]`` (softmax).
        normalization: The loss's normalization.
    """

    kind: str
    scale: Tensor
    normalization: LossNormalization


class LossCurvature:
    """The validated loss of a mini-batch: its normalization and Hessian roots.

    Args:
        loss_func: A supported loss module (see :func:`check_loss_function`).
        output: The model output the loss function receives, ``[N, ...]``.
        targets: The targets it receives.

    Raises:
        UnsupportedLossError: If the loss module or an option is not supported.
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
        check_finite(output, "model output")
        self.loss_func = loss_func
        self.output = output.detach()
        self.targets = targets.detach()
        if isinstance(loss_func, CrossEntropyLoss):
            self._structure = _cross_entropy(loss_func, self.output, self.targets)
        elif isinstance(loss_func, BCEWithLogitsLoss):
            self._structure = _bce_with_logits(loss_func, self.output, self.targets)
        else:
            self._structure = _mse(loss_func, self.output, self.targets)

    @property
    def normalization(self) -> LossNormalization:
        """The loss's reduction and per-sample weights."""
        return self._structure.normalization

    def columns_per_sample(self, mc_samples: int = 0, mc_per: str = "sequence") -> int:
        """Columns of ``V`` per sample: ``K`` of :meth:`root`.

        Args:
            mc_samples: ``0`` (exact) or ``M``.
            mc_per: ``"token"`` or ``"sequence"`` (see :meth:`root`).

        Returns:
            ``output[0].numel()`` (exact: ``C·P`` for cross-entropy on ``[N, C,
            *T]``), ``M·P`` (cross-entropy, Monte Carlo per token) or ``M``.
        """
        if not mc_samples:
            return self.output[0].numel()
        return mc_samples * self._positions_per_draw(mc_per)

    def _positions_per_draw(self, mc_per: str) -> int:
        """``P`` if each position of a cross-entropy output draws its own column."""
        if self._structure.kind == "ce" and mc_per == "token":
            return self.output[0, 0].numel()
        return 1

    def root(
        self,
        samples: Sequence[int] | None = None,
        mc_samples: int = 0,
        generator: torch.Generator | None = None,
        mc_per: str = "sequence",
    ) -> LossRoot:
        """``√R_S · S_n`` for the samples ``S``, column block by column block.

        Args:
            samples: Sample indices (``None``: all). ``R_S`` is that of the loss on
                these samples alone.
            mc_samples: ``0`` for the exact root, else the number ``M`` of
                Monte-Carlo samples per datum.
            generator: Random generator for the Monte-Carlo samples (``None``:
                torch's global generator); drawn from here, once.
            mc_per: With Monte Carlo on a cross-entropy output ``[N, C, *T]``:
                ``"token"`` keeps each position's draw as its own column
                (``M·P`` columns, entry ``m·P + p``), ``"sequence"`` one column
                per draw over all positions (``M``). Other losses draw ``M``
                columns either way (``docs/math.rst``, "Losses").

        Returns:
            The root ``[K, |S|, *output.shape[1:]]``; ``S_n S_nᵀ`` is the Hessian
            of ``ℓ_n`` w.r.t. the output (exact) or an unbiased estimate of it.
        """
        structure = self._structure
        output, scale = self.output, structure.scale
        if samples is not None:
            index = torch.as_tensor(list(samples), dtype=torch.long)
            output, scale = output[index.to(output.device)], scale[index]
        root_r = math.sqrt(structure.normalization.reduction_factor(samples))
        scale = scale.to(device=output.device, dtype=output.dtype)
        positions = scale.unsqueeze(1) if structure.kind == "ce" else scale
        factor = root_r * positions.sqrt()
        if not mc_samples:
            unit = _exact_columns(structure.kind, output)
        else:
            draws = _sampled_unit_roots(structure.kind, output, mc_samples, generator)
            unit = (
                _draw_columns(draws)
                if self._positions_per_draw(mc_per) == 1
                else _position_columns(draws)
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
        """The whole root of :meth:`root` (same arguments) as one tensor.

        Returns:
            ``[K, |S|, *output.shape[1:]]``.
        """
        return self.root(samples, mc_samples, generator, mc_per)[:]


#: Entries of the unit root formed at once (float64 for a float32 output) when
#: many columns are asked for: 2**22, 32 MiB.
ROOT_BLOCK_ENTRIES = 2**22


class LossRoot:
    """A loss-Hessian root ``[K, |S|, *out]``, formed a block of columns at a time.

    The exact root of ``C·P`` columns per sample has each column non-zero at one
    position only: indexing it with a slice of columns forms just those, so no
    buffer of the whole root exists unless asked for (``root[:]``).

    Args:
        unit: ``(start, stop, rows) ↦`` unit-root columns ``start:stop`` of the
            samples ``rows``, ``[stop - start, len(rows), *out]``.
        num_columns: ``K``.
        samples_shape: ``[|S|, *out]``.
        factor: ``√R_S`` times the positions' scales, ``[|S|, ...]``
            broadcasting to ``samples_shape``.
        rows: The samples (of ``S``) this root holds: all, or an index.
    """

    def __init__(
        self,
        unit: _Columns,
        num_columns: int,
        samples_shape: torch.Size,
        factor: Tensor,
        rows: slice | Tensor = slice(None),
    ):
        self._unit = unit
        self._factor = factor
        self._rows = rows
        num_rows = (
            len(range(samples_shape[0])[rows]) if isinstance(rows, slice) else len(rows)
        )
        self.shape = torch.Size((num_columns, num_rows, *samples_shape[1:]))
        self._samples_shape = samples_shape

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def device(self) -> torch.device:
        """Where the columns are formed."""
        return self._factor.device

    def rows(self, index: Tensor) -> LossRoot:
        """The root of some of its samples.

        Args:
            index: Positions in ``S`` (a long tensor).

        Returns:
            Their root ``[K, len(index), *out]``, formed as lazily.
        """
        return LossRoot(self._unit, len(self), self._samples_shape, self._factor, index)

    def __getitem__(self, columns: slice) -> Tensor:
        """Columns ``columns`` (a slice with step 1), ``[len, |S|, *out]``."""
        start, stop, step = columns.indices(len(self))
        if step != 1:
            raise InvalidArgumentError(
                f"A loss root is indexed by consecutive columns, got step {step}."
            )
        stop = max(start, stop)
        factor = self._factor[self._rows].unsqueeze(0)
        per_column = max(1, self.shape[1:].numel())
        step = max(1, ROOT_BLOCK_ENTRIES // per_column)
        if stop - start <= step:
            return self._unit(start, stop, self._rows) * factor
        # many columns (BackPACK takes them all): the float64 unit root of one
        # block of columns at a time, written into the result
        root = factor.new_empty(stop - start, *self.shape[1:])
        for first in range(start, stop, step):
            last = min(stop, first + step)
            torch.mul(
                self._unit(first, last, self._rows),
                factor,
                out=root[first - start : last - start],
            )
        return root


# ----------------------------------------------------------------------------------
# Loss structures: validation, per-position scales, normalization
# ----------------------------------------------------------------------------------


def _kappa(reduction: str, positions: int) -> float:
    """Per-sample normalization ``κ`` inside ``ℓ_n``: ``1/P`` (mean) or ``1`` (sum)."""
    return 1.0 / positions if reduction == "mean" else 1.0


def _uniform(reduction: str, batch_size: int) -> LossNormalization:
    return LossNormalization(reduction, (1.0,) * batch_size)


def _check_same_shape(loss_func: Module, output: Tensor, targets: Tensor) -> None:
    name = type(loss_func).__name__
    if targets.shape != output.shape:
        raise InvalidTargetsError(
            f"{name} got targets of shape {tuple(targets.shape)} for a model output "
            f"of shape {tuple(output.shape)}; they must have the same shape (no "
            "broadcasting)."
        )
    if not targets.is_floating_point():
        raise InvalidTargetsError(
            f"{name} needs floating-point targets, got dtype {targets.dtype}."
        )
    check_finite(targets, "targets")


def _mse(loss_func: MSELoss, output: Tensor, targets: Tensor) -> _Structure:
    _check_same_shape(loss_func, output, targets)
    kappa = _kappa(loss_func.reduction, output[0].numel())
    scale = torch.full(output.shape, 2.0 * kappa, dtype=torch.float64)
    return _Structure("mse", scale, _uniform(loss_func.reduction, output.shape[0]))


def _bce_with_logits(
    loss_func: BCEWithLogitsLoss, output: Tensor, targets: Tensor
) -> _Structure:
    _check_same_shape(loss_func, output, targets)
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
    scale = torch.full(
        output.shape,
        _kappa(loss_func.reduction, output[0].numel()),
        dtype=torch.float64,
    )
    y = targets.to(torch.float64).cpu()
    if loss_func.pos_weight is not None:
        # ∇²ℓ = weight · (1 + (pos_weight - 1) y) · σ(1-σ)
        pos_weight = loss_func.pos_weight.detach().to(torch.float64).cpu()
        factor = 1 + (pos_weight - 1) * y
        if (factor < 0).any():
            n = int((factor < 0).reshape(len(y), -1).any(1).nonzero()[0])
            raise InvalidTargetsError(
                "BCEWithLogitsLoss with pos_weight has a negative loss Hessian for "
                f"targets outside [0, 1] (first at sample {n}): use targets in "
                "[0, 1]."
            )
        scale = scale * factor
    if loss_func.weight is not None:
        scale = scale * loss_func.weight.detach().to(torch.float64).cpu()
    scale = scale.expand(output.shape)
    return _Structure("bce", scale, _uniform(loss_func.reduction, output.shape[0]))


#: Class-index dtypes ``CrossEntropyLoss`` accepts.
_INDEX_DTYPES = (torch.int64, torch.uint8)


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
            f"axis, got shape {tuple(output.shape)}."
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
            n = int((q < 0).reshape(len(q), -1).any(1).nonzero()[0])
            raise InvalidTargetsError(
                "CrossEntropyLoss got probability targets with negative entries "
                f"(first at sample {n}): soft targets must be non-negative (they "
                "need not sum to one; their sum scales the loss Hessian)."
            )
        q = (1 - smoothing) * q + smoothing / num_classes
        mass = torch.einsum("c,nc...->n...", weight, q)
        return _Structure("ce", kappa * mass, _uniform(reduction, output.shape[0]))

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
            f"of shape {tuple(output.shape)}).{_flattened_positions(output, targets)}"
            f"{_classes_last(output, targets)}"
        )
    y = targets.cpu().long()
    counted = y != loss_func.ignore_index
    outside = counted & ((y < 0) | (y >= num_classes))
    if outside.any():
        n = int(outside.reshape(len(y), -1).any(1).nonzero()[0])
        bad = y.reshape(len(y), -1)[n][outside.reshape(len(y), -1)[n]][0].item()
        raise InvalidTargetsError(
            f"CrossEntropyLoss got the class index {bad} at sample {n}, outside "
            f"[0, {num_classes}) and not the ignore_index "
            f"({loss_func.ignore_index})."
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
    return _Structure("ce", kappa * mass, normalization)


def _flattened_positions(output: Tensor, targets: Tensor) -> str:
    """Advice for logits ``[N·T, C]`` of sequences ``[N, T]`` (else ``""``)."""
    if output.dim() != 2 or targets.dim() < 2 or targets.numel() != output.shape[0]:
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


# ----------------------------------------------------------------------------------
# Unit roots: S with S Sᵀ the Hessian of the unit loss at every position
# ----------------------------------------------------------------------------------


#: ``(start, stop, rows) ↦`` columns ``start:stop`` of a unit root for the samples
#: ``rows``, ``[stop - start, len(rows), *out]``.
_Columns = Callable[[int, int, "slice | Tensor"], Tensor]


def _exact_columns(kind: str, output: Tensor) -> _Columns:
    """Columns of the exact unit root, BackPACK's layout ``[K, N, *out]``.

    Each column is non-zero at one position: for the elementwise losses column
    ``k`` at output entry ``k``, for cross-entropy column ``c·P + p`` at position
    ``p`` (``diag(√p) - p √pᵀ`` there). Only the requested columns are formed.

    Computed in float64 and rounded once to the output's dtype: a float32 softmax
    root has absolute errors of about ``ε₃₂``, which break its exact null space
    (``S_nᵀ 1 = 0``) and appear as spurious eigenvalues near ``ε₃₂²`` once the
    Gram matrix is accumulated in float64 (``docs/math.rst``, "Precision and the
    numerical zero").
    """
    wide = output.double() if output.dtype == torch.float32 else output
    if kind == "ce":
        probs = wide.softmax(1)
        return _softmax_columns(probs.reshape(*probs.shape[:2], -1), output)
    if kind == "bce":
        sigma = wide.sigmoid()
        return _diagonal_columns((sigma * (1 - sigma)).sqrt().flatten(1), output)
    return _diagonal_columns(torch.ones_like(wide).flatten(1), output)


def _diagonal_columns(values: Tensor, output: Tensor) -> _Columns:
    """Columns ``k`` of ``values [N, E]`` at entry ``k``, in the output's dtype."""

    def columns(start: int, stop: int, rows: slice | Tensor) -> Tensor:
        index = torch.arange(start, stop, device=values.device)
        picked = values[rows]
        unit = picked.new_zeros(stop - start, *picked.shape)
        unit[index - start, :, index] = picked[:, index].T
        return unit.reshape(stop - start, len(picked), *output.shape[1:]).to(
            output.dtype
        )

    return columns


def _softmax_columns(probs: Tensor, output: Tensor) -> _Columns:
    """Columns ``v·P + p`` of ``diag(√p) - p √pᵀ`` per position, ``probs [N, C, P]``.

    Column ``v·P + p`` holds ``√p_c δ_vc - p_c √p_v`` at position ``p``, zeros
    elsewhere.
    """
    positions = probs.shape[2]

    def columns(start: int, stop: int, rows: slice | Tensor) -> Tensor:
        index = torch.arange(start, stop, device=probs.device)
        v, p = index // positions, index % positions
        picked = probs[rows]
        tau = picked.sqrt()
        block = -picked[:, :, p] * tau[:, v, p].unsqueeze(1)  # [N, C, k]
        block[:, v, index - start] += tau[:, v, p]
        unit = picked.new_zeros(stop - start, *picked.shape)
        unit[index - start, :, :, p] = block.permute(2, 0, 1)
        return unit.reshape(stop - start, len(picked), *output.shape[1:]).to(
            output.dtype
        )

    return columns


def _draw_columns(draws: Tensor) -> _Columns:
    """Columns of Monte-Carlo draws ``[M, N, *out]`` as they are."""
    return lambda start, stop, rows: draws[start:stop, rows]


def _position_columns(draws: Tensor) -> _Columns:
    """Columns ``m·P + p``: draw ``m`` at position ``p`` alone, zeros elsewhere.

    ``draws`` is ``[M, N, C, *T]`` (cross-entropy, ``P = T₁⋯T_k`` positions).
    """
    flat = draws.reshape(*draws.shape[:3], -1)  # [M, N, C, P]
    positions = flat.shape[3]

    def columns(start: int, stop: int, rows: slice | Tensor) -> Tensor:
        index = torch.arange(start, stop, device=draws.device)
        m, p = index // positions, index % positions
        picked = flat[:, rows]
        unit = picked.new_zeros(stop - start, *picked.shape[1:])
        unit[index - start, :, :, p] = picked[m, :, :, p]
        return unit.reshape(stop - start, picked.shape[1], *draws.shape[2:])

    return columns


def _sampled_unit_roots(
    kind: str, output: Tensor, mc_samples: int, generator: torch.Generator | None
) -> Tensor:
    """``M^{-1/2}`` times ``M`` sampled unit-loss gradients, ``[M, N, *out]``."""
    shape = (mc_samples, *output.shape)
    if kind == "mse":  # unit Hessian 1 (the 2 of (f - y)² is in the scale): ε ~ N(0, 1)
        draws = torch.randn(
            shape, dtype=output.dtype, device=output.device, generator=generator
        )
    elif kind == "bce":  # y ~ Bernoulli(σ): ∇ℓ = σ - y
        sigma = output.sigmoid().expand(shape)
        draws = sigma - torch.bernoulli(sigma, generator=generator)
    else:  # y ~ Categorical(p): ∇ℓ = p - onehot(y)
        num_classes = output.shape[1]
        probs = output.softmax(1)
        flat = probs.movedim(1, -1).reshape(-1, num_classes)
        labels = torch.multinomial(
            flat, mc_samples, replacement=True, generator=generator
        )  # [N·P, M]
        onehot = torch.nn.functional.one_hot(labels.T, num_classes).to(output.dtype)
        onehot = onehot.reshape(mc_samples, *probs.movedim(1, -1).shape).movedim(-1, 2)
        draws = probs.unsqueeze(0) - onehot
    return draws / math.sqrt(mc_samples)
