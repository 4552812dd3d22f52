"""The caller's batches checked: pairs of tensors, batched, one shape per sample."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from itertools import islice

from torch import Tensor
from torch.nn import Conv1d, Conv2d, Conv3d, Linear, Module

from vivit._validation import check_batch, check_inputs_match
from vivit.errors import InvalidArgumentError, VivitError
from vivit.model_inputs import ModelInputs

#: Why every part needs targets of one shape per sample, and what to do.
SAMPLE_SHAPE_ADVICE = (
    "The loss on all samples together needs one shape per sample in every batch "
    "and shard: each block's mean normalizes over its own positions, so sequences "
    "of another length cannot be combined (docs/math.rst, 'Data sets and "
    "processes'). Pad every batch to one length (with CrossEntropyLoss, padding "
    "targets set to ignore_index), or compute each length on its own."
)


def iterate_batches(
    data: object, model: Module, max_batches: int | None = None
) -> Iterator[tuple[ModelInputs, Tensor]]:
    """The batches of a data loader, each checked like a mini-batch.

    Raises:
        InvalidArgumentError: If ``data`` is not an iterable of batches, or a batch
            is malformed (the message names the batch).
    """
    if isinstance(data, Mapping | Tensor | str | bytes) or not isinstance(
        data, Iterable
    ):
        mapping = isinstance(data, Mapping)
        got = _dict_summary(data) if mapping else f"got {type(data).__name__}"
        raise InvalidArgumentError(
            "data must be a pair (inputs, targets) of tensors or an iterable of such "
            f"batches (e.g. a DataLoader), {got}."
        )
    params = list(model.parameters())
    first_shape = None
    for index, batch in enumerate(islice(data, max_batches)):
        with naming_batch(index):
            batch = checked_batch(batch, model, params)
            shape = tuple(batch[1].shape[1:])
            first_shape = shape if first_shape is None else first_shape
            if shape != first_shape:
                raise InvalidArgumentError(
                    f"Its targets have the shape {shape} per sample, those of batch "
                    f"0 {first_shape}. {SAMPLE_SHAPE_ADVICE}"
                )
        yield batch


def checked_batch(
    batch: object, model: Module, params: list
) -> tuple[ModelInputs, Tensor]:
    """One batch checked: a pair, batched, with inputs that suit the model."""
    if isinstance(batch, Mapping):
        raise InvalidArgumentError(
            f"data must be a pair (inputs, targets) of tensors, {_dict_summary(batch)}."
        )
    check_batched(batch, model)
    batch = check_batch(batch)
    check_inputs_match(batch[0], params)
    return batch


#: Layers whose unbatched input is recognisable: dimensions of one sample's input.
_SAMPLE_DIMS = {Linear: 1, Conv1d: 2, Conv2d: 3, Conv3d: 4}


def check_batched(batch: object, model: Module) -> None:
    """Refuse inputs that are one unbatched sample of the first Linear or conv layer.

    Raises:
        InvalidArgumentError: For an unbatched sample, saying what to pass.
    """
    inputs = batch[0] if isinstance(batch, tuple | list) and batch else None
    if not isinstance(inputs, Tensor) or not inputs.is_floating_point():
        return
    layer = next((m for m in model.modules() if type(m) in _SAMPLE_DIMS), None)
    if layer is None or inputs.dim() != _SAMPLE_DIMS[type(layer)]:
        return
    features = layer.in_features if isinstance(layer, Linear) else layer.in_channels
    if inputs.shape[0] != features:
        return
    raise InvalidArgumentError(
        f"The inputs have shape {tuple(inputs.shape)}: one sample without a batch "
        f"axis for the model's first layer {layer}, whose batched inputs are "
        f"[N, {', '.join(map(str, inputs.shape))}]. The first axis of inputs and "
        "targets holds the samples: stack the samples into one batch "
        "(torch.stack(inputs), torch.stack(targets)), let a DataLoader(dataset, "
        "batch_size=...) do it, or give each sample a batch axis of one "
        "(x.unsqueeze(0), y.unsqueeze(0))."
    )


def _dict_summary(batch: Mapping) -> str:
    """What a batch given as a dict is, and how to pass it instead."""
    if "labels" in batch:  # a Hugging Face collator's batch
        return (
            f"got a dict with keys {list(batch)}, the labels inside as Hugging Face "
            "collators return: take them out with vivit.huggingface.split_labels("
            "loader, shift=True) for a causal language model's labels (shifted to "
            "the next token), shift=False for labels aligned with the logits (a "
            "classifier's), or split_batch(batch, shift=...) for one batch"
        )
    return (
        f"got a dict with keys {list(batch)}: pass (inputs, targets), e.g. "
        "(batch['inputs'], batch['targets']), or give the DataLoader a collate_fn "
        "that returns that pair"
    )


@contextmanager
def naming_batch(index: int | None) -> Iterator[None]:
    """Prefix a library error's message with the loader's batch (others: a note)."""
    if index is None:
        yield
        return
    try:
        yield
    except VivitError as error:
        raise type(error)(f"Batch {index} of the data loader: {error}") from None
    except Exception as error:
        if hasattr(error, "add_note"):  # Python ≥ 3.11
            error.add_note(f"(in batch {index} of the data loader)")
        raise
