"""The Hugging Face helpers: next-token targets and token logits (no transformers).

The models themselves are tested in ``tests/test_huggingface_models.py``.
"""

from __future__ import annotations

import pytest
import torch

from vivit import InvalidArgumentError
from vivit.huggingface import IGNORE_INDEX, causal_lm_targets, token_logits

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
