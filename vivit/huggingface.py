"""Hugging Face models: token logits for cross-entropy, next-token targets, labels.

Nothing here imports ``transformers``; see the guide, "Hugging Face models".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sized

import torch
from torch import Tensor

from vivit.engines.base import select_output
from vivit.errors import InvalidArgumentError
from vivit.optional_packages import (  # re-exported: its documented path
    hide_broken_torchvision as hide_broken_torchvision,
)

#: The targets ``CrossEntropyLoss`` skips by default (and Hugging Face's labels).
IGNORE_INDEX = -100


def token_logits(output: object) -> Tensor:
    """The ``logits`` ``[N, T, C]`` of a model's ``output`` as ``[N, C, T]`` (a view).

    For ``CrossEntropyLoss``: pass ``output=vivit.huggingface.token_logits``.

    Raises:
        InvalidArgumentError: If the output has no ``logits`` or they have no
            position axis (``[N, C]`` logits take ``output="logits"``).
    """
    logits = select_output(output, "logits")
    if logits.dim() < 3:
        raise InvalidArgumentError(
            f"token_logits expects logits [N, T, C] with a position axis, got shape "
            f"{tuple(logits.shape)}: logits [N, C] (one prediction per sample) are "
            "selected as they are, with output='logits'."
        )
    return logits.movedim(-1, 1)


def causal_lm_targets(
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Next-token targets of a causal language model, padding excluded.

    ``targets[:, t] = input_ids[:, t+1]`` where both tokens are real, else
    ``ignore_index`` (the last position too).

    Args:
        input_ids: Token ids ``[N, T]``.
        attention_mask: ``[N, T]``, 0 for padding (either side); ``None``: none.
        ignore_index: The loss's ``ignore_index``.

    Returns:
        Targets ``[N, T]`` (int64).

    Raises:
        InvalidArgumentError: If ``input_ids`` is not an integer ``[N, T]`` tensor
            or the mask has another shape.
    """
    if not _are_token_ids(input_ids):
        raise InvalidArgumentError(
            "input_ids must be an integer tensor [N, T] of token ids, got "
            f"{_summary(input_ids)}."
        )
    if attention_mask is not None and (
        not isinstance(attention_mask, Tensor)
        or attention_mask.shape != input_ids.shape
    ):
        raise InvalidArgumentError(
            f"attention_mask must have the shape of input_ids "
            f"{tuple(input_ids.shape)}, got {_summary(attention_mask)}."
        )
    targets = torch.full_like(input_ids, ignore_index, dtype=torch.long)
    targets[:, :-1] = input_ids[:, 1:]
    if attention_mask is not None:
        real = attention_mask != 0
        targets[:, :-1][~(real[:, :-1] & real[:, 1:])] = ignore_index
    return targets


def split_batch(
    batch: Mapping[str, Tensor],
    *,
    shift: bool,
    key: str = "labels",
    ignore_index: int = IGNORE_INDEX,
) -> tuple[dict[str, Tensor], Tensor]:
    """A Hugging Face batch dict as ``(inputs, targets)``: the labels taken out.

    ``shift`` has no default: a wrong choice silently gives another loss's
    curvature (the guide, "Hugging Face models").

    Args:
        batch: The collator's batch: the model's keyword inputs and the labels.
        shift: ``True`` for a causal language model's labels ``[N, T]``, shifted
            as the model does inside (``targets[:, t] = labels[:, t + 1]``).
            ``False`` for labels aligned with the logits (``[N]`` or ``[N, T]``).
        key: The labels' key in the batch.
        ignore_index: The loss's ``ignore_index``.

    Returns:
        The inputs (every entry but the labels) and the targets (int64).

    Raises:
        InvalidArgumentError: If the batch is not a dict with the labels, or
            ``shift=True`` for labels that are not integer ``[N, T]``.
    """
    if not isinstance(batch, Mapping) or key not in batch:
        found = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise InvalidArgumentError(
            f"split_batch expects a dict batch with its labels under {key!r} (as "
            f"Hugging Face collators return), got {found}: name the labels' key "
            "with key=...."
        )
    _check_shift(shift)
    inputs = {name: value for name, value in batch.items() if name != key}
    labels = batch[key]
    if not shift:
        return inputs, labels
    if not _are_token_ids(labels):
        raise InvalidArgumentError(
            f"shift=True shifts a causal language model's labels, integer [N, T], "
            f"got {_summary(labels)}: labels that line up with the logits (a "
            "classifier's [N], a token classifier's [N, T]) take shift=False."
        )
    return inputs, causal_lm_targets(labels, ignore_index=ignore_index)


class SplitLabels:
    """A re-iterable loader of Hugging Face batch dicts as ``(inputs, targets)``.

    Each batch of ``loader`` goes through :func:`split_batch` as it is drawn.

    Raises:
        InvalidArgumentError: If ``shift`` is not a bool.
    """

    def __init__(
        self,
        loader: Iterable[Mapping[str, Tensor]],
        *,
        shift: bool,
        key: str = "labels",
        ignore_index: int = IGNORE_INDEX,
    ):
        _check_shift(shift)
        self.loader, self.shift, self.key = loader, shift, key
        self.ignore_index = ignore_index

    def __iter__(self) -> Iterator[tuple[dict[str, Tensor], Tensor]]:
        """The loader's batches as ``(inputs, targets)``."""
        for batch in self.loader:
            yield split_batch(
                batch, shift=self.shift, key=self.key, ignore_index=self.ignore_index
            )

    def __len__(self) -> int:
        """The loader's number of batches (a ``TypeError`` if it has none)."""
        if not isinstance(self.loader, Sized):
            raise TypeError(f"{type(self.loader).__name__} has no len()")
        return len(self.loader)


def split_labels(
    loader: Iterable[Mapping[str, Tensor]],
    *,
    shift: bool,
    key: str = "labels",
    ignore_index: int = IGNORE_INDEX,
) -> SplitLabels:
    """The :class:`SplitLabels` of the arguments: batches as ``(inputs, targets)``."""
    return SplitLabels(loader, shift=shift, key=key, ignore_index=ignore_index)


def _check_shift(shift: object) -> None:
    """``shift`` is a bool: no truthy stand-ins for a choice without a default."""
    if not isinstance(shift, bool):
        raise InvalidArgumentError(
            f"shift must be True (a causal language model's labels, shifted here) "
            f"or False (labels aligned with the logits), got {shift!r}."
        )


def _are_token_ids(value: object) -> bool:
    """Whether ``value`` is an integer tensor ``[N, T]``."""
    return (
        isinstance(value, Tensor) and value.dim() == 2 and not value.is_floating_point()
    )


def _summary(value: object) -> str:
    """A tensor's shape and dtype, else the type's name."""
    if isinstance(value, Tensor):
        return f"shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
