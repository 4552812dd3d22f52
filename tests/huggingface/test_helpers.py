"""The Hugging Face helpers: next-token targets, token logits, labels taken out of
collated batches (no transformers).

The models themselves are tested in ``tests/huggingface/test_models.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vivit import InvalidArgumentError, LowRankGGN
from vivit.huggingface import (
    IGNORE_INDEX,
    causal_lm_targets,
    split_batch,
    split_labels,
    token_logits,
)

I = IGNORE_INDEX  # noqa: E741


def test_causal_lm_targets_shift_and_ignore_padding_on_either_side():
    input_ids = torch.tensor([[1, 2, 3, 4], [7, 7, 5, 6], [8, 9, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]])
    expected = torch.tensor([[2, 3, 4, I], [I, I, 6, I], [9, I, I, I]])
    assert torch.equal(causal_lm_targets(input_ids, attention_mask), expected)
    no_mask = torch.tensor([[2, 3, 4, I], [7, 5, 6, I], [9, 0, 0, I]])
    assert torch.equal(causal_lm_targets(input_ids), no_mask)
    assert torch.equal(
        causal_lm_targets(input_ids[:1], ignore_index=-1), torch.tensor([[2, 3, 4, -1]])
    )


@pytest.mark.parametrize(
    "input_ids, attention_mask, message",
    [
        (torch.zeros(2, 3), None, "integer tensor"),
        (torch.zeros(6).long(), None, r"shape \(6,\)"),
        (torch.zeros(2, 3).long(), torch.ones(2, 4), r"shape of input_ids \(2, 3\)"),
    ],
)
def test_causal_lm_targets_refuse_malformed_ids(input_ids, attention_mask, message):
    with pytest.raises(InvalidArgumentError, match=message):
        causal_lm_targets(input_ids, attention_mask)


def test_token_logits_put_the_classes_on_dim_one():
    logits = torch.randn(2, 5, 3)  # [N, T, C]
    moved = token_logits({"logits": logits, "past_key_values": None})
    assert moved.shape == (2, 3, 5)
    assert torch.equal(moved[:, :, 4], logits[:, 4, :])


def test_token_logits_refuse_per_sample_logits_and_missing_fields():
    with pytest.raises(InvalidArgumentError, match="output='logits'"):
        token_logits({"logits": torch.randn(2, 3)})
    with pytest.raises(InvalidArgumentError, match=r"fields \['scores'\]"):
        token_logits({"scores": torch.randn(2, 5, 3)})


def _collated(labels):
    """A batch as Hugging Face collators return it, labels inside."""
    return {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "labels": labels}


def test_split_batch_shifts_a_causal_lm_s_labels_and_keeps_aligned_ones():
    """``shift=True``: position t's target is label t+1 (as the model's own loss)."""
    labels = torch.tensor([[1, 2, 3], [4, 5, I]])
    inputs, targets = split_batch(_collated(labels), shift=True)
    assert list(inputs) == ["input_ids"]
    assert torch.equal(targets, torch.tensor([[2, 3, I], [5, I, I]]))
    assert targets.dtype == torch.long
    inputs, targets = split_batch(_collated(labels), shift=False)
    assert targets is labels and list(inputs) == ["input_ids"]
    named = {"input_ids": labels, "y": torch.tensor([0, 1])}
    assert torch.equal(split_batch(named, shift=False, key="y")[1], named["y"])
    _, last = split_batch(_collated(labels), shift=True, ignore_index=-1)
    assert torch.equal(last[:, -1], torch.tensor([-1, -1]))


@pytest.mark.parametrize(
    "batch, options, message",
    [
        (_collated(torch.zeros(2, 3).long()), {"key": "y"}, r"under 'y'.*\['input_"),
        ((torch.zeros(2, 3), torch.zeros(2)), {}, "got tuple"),
        (_collated(torch.zeros(2).long()), {}, r"shape \(2,\).*shift=False"),
        (_collated(torch.zeros(2, 3)), {}, "torch.float32.*shift=False"),
    ],
)
def test_split_batch_refuses_what_it_cannot_split(batch, options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        split_batch(batch, shift=True, **options)


@pytest.mark.parametrize("shift", [1, None, "yes"])
def test_split_labels_want_shift_said_as_a_bool(shift):
    batch = _collated(torch.zeros(2, 3).long())
    with pytest.raises(InvalidArgumentError, match="shift must be True"):
        split_labels([batch], shift=shift)
    with pytest.raises(InvalidArgumentError, match="shift must be True"):
        split_batch(batch, shift=shift)


def test_split_labels_is_a_loader_of_pairs_passed_over_again():
    batches = [_collated(torch.tensor([[1, 2, 3], [4, 5, I]]))] * 2
    loader = split_labels(batches, shift=True)
    assert len(loader) == 2
    first, second = list(loader), list(loader)
    assert len(first) == len(second) == 2
    assert torch.equal(first[0][1], second[1][1])
    with pytest.raises(TypeError, match="generator has no len"):
        len(split_labels((b for b in batches), shift=True))


def test_a_loader_of_collated_batches_is_refused_with_split_labels_named():
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6))
    batch = _collated(torch.tensor([[1, 2, 3], [4, 5, I]]))
    with pytest.raises(InvalidArgumentError, match=r"split_labels\(loader, shift="):
        LowRankGGN(model, nn.CrossEntropyLoss(), [batch])
