"""Hugging Face models: token logits for cross-entropy, next-token targets, imports.

Nothing here imports ``transformers``: a Hugging Face model is an ``nn.Module``
whose structured output the ``output`` option selects from
(:func:`~vivit.engines.base.select_output`) and whose dict of inputs a batch
carries as ``(inputs, targets)`` (:mod:`vivit.model_inputs`). See the guide's
"Hugging Face models".
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
    """The ``logits`` of a token-level model, class axis moved to dim 1.

    Hugging Face language models (and token classifiers) return logits
    ``[N, T, C]``; ``CrossEntropyLoss`` wants the classes on dim 1, ``[N, C, T]``,
    with targets ``[N, T]``. Pass ``output=vivit.huggingface.token_logits``.

    Args:
        output: The model's return value, with a ``logits`` key or attribute.

    Returns:
        The logits ``[N, C, T]`` (a view).

    Raises:
        InvalidArgumentError: If the output has no ``logits`` (naming its fields),
            or the logits have no position axis (a sequence classifier's
            ``[N, C]`` logits are selected with ``output="logits"``).
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

    Position ``t`` predicts token ``t + 1``: ``targets[:, t] = input_ids[:, t+1]``.
    The last position has no next token, and a position counts only if both its
    token and the next are real (``attention_mask`` 1): every other target is
    ``ignore_index``, which ``CrossEntropyLoss`` (same ``ignore_index``) leaves
    out of the loss, its mean and the GGN exactly (``docs/math.rst``, "Losses").
    The model's logits ``[N, T, C]`` go with them through
    ``output=token_logits``.

    Args:
        input_ids: Token ids ``[N, T]``.
        attention_mask: ``[N, T]``, 1 for real tokens and 0 for padding (either
            side); ``None``: every token is real.
        ignore_index: The loss's ``ignore_index``.

    Returns:
        Targets ``[N, T]`` (int64).

    Raises:
        InvalidArgumentError: If ``input_ids`` is not an integer ``[N, T]`` tensor
            or the mask has another shape.
    """
    if (
        not isinstance(input_ids, Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
    ):
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
        counted = real[:, :-1] & real[:, 1:]
        targets[:, :-1][~counted] = ignore_index
    return targets


def split_batch(
    batch: Mapping[str, Tensor],
    *,
    shift: bool,
    key: str = "labels",
    ignore_index: int = IGNORE_INDEX,
) -> tuple[dict[str, Tensor], Tensor]:
    """A Hugging Face batch dict as ``(inputs, targets)``: the labels taken out.

    Hugging Face collators put the labels into the batch beside the model's
    inputs, ``{"input_ids", "attention_mask", "labels"}``; vivit takes the pair
    ``(inputs, targets)`` and calls ``model(**inputs)`` without the labels.

    ``shift`` says how the labels line up with the logits, and has no default
    because a wrong choice gives the curvature of another loss without an error:

    * ``shift=True``: a causal language model's labels ``[N, T]`` (e.g. of
      ``DataCollatorForLanguageModeling(mlm=False)``) are *not* shifted; the
      model shifts them inside, position ``t`` predicting ``labels[:, t + 1]``.
      The targets are shifted here the same way: ``targets[:, t] = labels[:, t
      + 1]``, the last position ``ignore_index``. With ``output=token_logits``
      and ``CrossEntropyLoss()``, the loss is the one the model returns from
      the labels (``model(**batch).loss``), padding (``-100``) excluded.
    * ``shift=False``: labels that already line up with the logits, used as
      they are: a sequence or image classifier's ``[N]`` (``output="logits"``),
      a token classifier's or a masked language model's ``[N, T]``
      (``output=token_logits``).

    Targets equal to ``ignore_index`` (Hugging Face's ``-100``) are left out of
    the loss and the GGN exactly (``docs/math.rst``, "Losses"). Unlike
    :func:`causal_lm_targets`, which also skips predictions made from padding,
    ``shift=True`` keeps every position whose next label counts, as the model's
    own loss does; with right padding both agree.

    Args:
        batch: The collator's batch: the model's keyword inputs and the labels.
        shift: Whether the labels are a causal language model's (shifted here).
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
    if (
        not isinstance(labels, Tensor)
        or labels.dim() != 2
        or labels.is_floating_point()
    ):
        raise InvalidArgumentError(
            f"shift=True shifts a causal language model's labels, integer [N, T], "
            f"got {_summary(labels)}: labels that line up with the logits (a "
            "classifier's [N], a token classifier's [N, T]) take shift=False."
        )
    targets = torch.full_like(labels, ignore_index, dtype=torch.long)
    targets[:, :-1] = labels[:, 1:]
    return inputs, targets


class SplitLabels:
    """A loader of Hugging Face batch dicts as one of ``(inputs, targets)``.

    Each batch goes through :func:`split_batch` as it is drawn; passing over it
    again passes over the loader again (as :class:`~vivit.StreamingGGN` does).

    Args:
        loader: Batches with their labels inside (a ``DataLoader`` with a
            Hugging Face collator, ``Trainer.get_train_dataloader()``).
        shift: As for :func:`split_batch`.
        key: As for :func:`split_batch`.
        ignore_index: As for :func:`split_batch`.
    """

    def __init__(
        self,
        loader: Iterable[Mapping[str, Tensor]],
        *,
        shift: bool,
        key: str = "labels",
        ignore_index: int = IGNORE_INDEX,
    ):
        self.loader = loader
        self.shift = shift
        self.key = key
        self.ignore_index = ignore_index

    def __iter__(self) -> Iterator[tuple[dict[str, Tensor], Tensor]]:
        """The loader's batches as ``(inputs, targets)``."""
        for batch in self.loader:
            yield split_batch(
                batch, shift=self.shift, key=self.key, ignore_index=self.ignore_index
            )

    def __len__(self) -> int:
        """The loader's number of batches.

        Raises:
            TypeError: If the loader has no length.
        """
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
    """A loader of Hugging Face batch dicts, labels inside, for vivit.

    ``LowRankGGN(model, CrossEntropyLoss(), split_labels(loader, shift=True),
    output=token_logits)`` for a causal language model's loader; see
    :func:`split_batch` for ``shift``.

    Args:
        loader: Batches ``{"input_ids", "attention_mask", "labels", ...}``.
        shift: ``True`` for a causal language model's labels, ``False`` for
            labels aligned with the logits.
        key: The labels' key in each batch.
        ignore_index: The loss's ``ignore_index``.

    Returns:
        The loader's batches as ``(inputs, targets)``, re-iterable.

    Raises:
        InvalidArgumentError: If ``shift`` is not a bool.
    """
    _check_shift(shift)
    return SplitLabels(loader, shift=shift, key=key, ignore_index=ignore_index)


def _check_shift(shift: object) -> None:
    """``shift`` is a bool: no truthy stand-ins for a choice without a default."""
    if not isinstance(shift, bool):
        raise InvalidArgumentError(
            f"shift must be True (a causal language model's labels, shifted here) "
            f"or False (labels aligned with the logits), got {shift!r}."
        )


def _summary(value: object) -> str:
    """A tensor's shape and dtype, else the type's name."""
    if isinstance(value, Tensor):
        return f"shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
