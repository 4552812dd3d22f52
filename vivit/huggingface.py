"""Hugging Face models: token logits for cross-entropy, next-token targets, imports.

Nothing here imports ``transformers``: a Hugging Face model is an ``nn.Module``
whose structured output the ``output`` option selects from
(:func:`~vivit.engines.base.select_output`) and whose dict of inputs a batch
carries as ``(inputs, targets)`` (:mod:`vivit.model_inputs`). See the guide's
"Hugging Face models".
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import Tensor

from vivit.engines.base import select_output
from vivit.errors import InvalidArgumentError

logger = logging.getLogger("vivit")

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


def hide_broken_torchvision() -> bool:
    """Let ``transformers`` import beside a torchvision that cannot load.

    PyPI's torchvision wheel (which BackPACK requires) does not load beside
    PyTorch's CPU build (``RuntimeError: operator torchvision::nms does not
    exist``), and ``transformers`` imports torchvision whenever it is installed.
    Call this before importing ``transformers``: if torchvision loads, nothing
    changes; if it fails with that error, torchvision is marked as absent in
    this process (``sys.modules["torchvision"] = None``), so ``transformers``
    runs without it (its text and vision models do; only torchvision-backed
    image processors are missing). The clean alternative is a torchvision built
    for the installed torch (e.g. from PyTorch's CPU wheel index).

    Returns:
        Whether torchvision was hidden.
    """
    try:
        import torchvision  # noqa: F401
    except RuntimeError as error:
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        logger.warning(
            "torchvision does not load beside this torch (%s): hidden from "
            "transformers in this process.",
            error,
        )
        return True
    except ImportError:
        return False
    return False


def _summary(value: object) -> str:
    """A tensor's shape and dtype, else the type's name."""
    if isinstance(value, Tensor):
        return f"shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
