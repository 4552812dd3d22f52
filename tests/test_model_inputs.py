"""Inputs given as a dict of tensors: ``model(**inputs)``, sliced per sample.

A model taking keyword tensors (a Hugging Face model's ``input_ids`` and
``attention_mask``) gets the GGN of ``loss_func(model(**inputs), targets)``, equal
to the dense float64 reference called the same way (``EIGVAL_RTOL``,
``docs/math.rst``, "Precision and the numerical zero"), with chunks,
subsampling, loaders and streamed passes, each of which slices every tensor of
the dict along its first axis. Monte-Carlo draws are those of the same model fed
the same tensor positionally (bit for bit: the same run).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn
from vivit import InvalidArgumentError, LowRankGGN, StreamingGGN
from vivit.huggingface import causal_lm_targets, token_logits

N, T, VOCAB, WIDTH = 4, 5, 6, 3
RTOL = EIGVAL_RTOL[torch.float64]


class TinyLM(nn.Module):
    """A causal token model with keyword inputs, returning ``{"logits": [N,T,C]}``.

    Padded positions are zeroed after the embedding and the positions mix
    causally (cumulative sum), as in a decoder: a real position never sees a
    later one.
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, attention_mask):
        hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        hidden = torch.tanh(self.mix(hidden)).cumsum(dim=1)
        return {"logits": self.head(hidden)}


def _lm_problem(reduction: str = "mean"):
    """Right- and left-padded sequences with their next-token targets."""
    torch.manual_seed(0)
    model = TinyLM().double()
    input_ids = torch.randint(0, VOCAB, (N, T))
    attention_mask = torch.ones(N, T, dtype=torch.long)
    attention_mask[1, 3:] = 0  # right padding
    attention_mask[2, :2] = 0  # left padding
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    targets = causal_lm_targets(input_ids, attention_mask)
    return model, nn.CrossEntropyLoss(reduction=reduction), inputs, targets


def _reference_on_counted_positions(model, loss_func, inputs, samples=None):
    """The dense GGN of the loss on the real next-token pairs alone.

    Built from the mask, not from the library's targets: position ``t`` of
    sample ``n`` (of ``samples``) is an output iff tokens ``t`` and ``t + 1`` are
    real; its target is token ``t + 1``. Padding and last positions are absent
    from the function, not ignored by the loss.
    """
    input_ids, real = inputs["input_ids"], inputs["attention_mask"].bool()
    counted = torch.zeros_like(real)
    counted[:, :-1] = real[:, :-1] & real[:, 1:]
    if samples is not None:
        keep = torch.zeros(len(real), dtype=torch.bool)
        keep[list(samples)] = True
        counted &= keep.unsqueeze(1)
    next_tokens = input_ids.roll(-1, dims=1)
    ggn = dense_ggn(
        model,
        loss_func,
        inputs,
        next_tokens[counted],
        output=lambda out: out["logits"][counted],
    )
    return torch.linalg.eigvalsh(ggn)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
@pytest.mark.parametrize("subsampling", [None, [0, 2]])
def test_padded_positions_are_excluded_exactly(reduction, chunk_size, subsampling):
    model, loss_func, inputs, targets = _lm_problem(reduction)
    ggn = LowRankGGN(
        model,
        loss_func,
        (inputs, targets),
        output=token_logits,
        chunk_size=chunk_size,
        subsampling=subsampling,
    )
    assert ggn.engine == "func"
    reference = _reference_on_counted_positions(model, loss_func, inputs, subsampling)
    assert_top_eigvals(ggn.eigvalsh(), reference, RTOL)


def test_padded_positions_change_the_ggn_when_counted():
    """The check above can fail: counting the padded positions changes the GGN."""
    model, loss_func, inputs, targets = _lm_problem()
    unmasked = causal_lm_targets(inputs["input_ids"])
    ggn = LowRankGGN(model, loss_func, (inputs, unmasked), output=token_logits)
    reference = _reference_on_counted_positions(model, loss_func, inputs)
    with pytest.raises(AssertionError, match="eigenvalue error"):
        assert_top_eigvals(ggn.eigvalsh(), reference, RTOL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loader_and_stream_of_dict_batches_give_the_reference(reduction):
    model, loss_func, inputs, targets = _lm_problem(reduction)
    halves = [
        ({key: value[part] for key, value in inputs.items()}, targets[part])
        for part in (slice(0, 2), slice(2, N))
    ]
    reference = _reference_on_counted_positions(model, loss_func, inputs)
    stored = LowRankGGN(model, loss_func, halves, output=token_logits)
    assert_top_eigvals(stored.eigvalsh(), reference, RTOL)
    streamed = StreamingGGN(model, loss_func, halves, output=token_logits)
    top, _ = streamed.eigh(top_k=3)
    assert_top_eigvals(top, reference, RTOL)


class Keyword(nn.Module):
    """An MLP whose input is the keyword ``features`` (or the first argument)."""

    def __init__(self):
        super().__init__()
        self.net = mlp(3, 4, 2)

    def forward(self, features):
        return self.net(features)


@pytest.mark.parametrize("engine", ["func", "backpack"])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_dict_inputs_draw_the_same_monte_carlo_samples(engine, chunk_size):
    torch.manual_seed(1)
    model = Keyword().double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    grams = [
        LowRankGGN(
            model,
            nn.CrossEntropyLoss(),
            (inputs, y),
            engine=engine,
            mc_samples=1,
            chunk_size=chunk_size,
            generator=torch.Generator().manual_seed(3),
        ).gram()
        for inputs in (X, {"features": X})
    ]
    assert torch.equal(grams[0], grams[1])


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"features": torch.zeros(5, 3), "flag": True}, "'flag': 'bool'"),
        ({}, "must map names to tensors"),
        (
            {"features": torch.zeros(5, 3), "mask": torch.ones(4, 3)},
            "differ in their first axis, {'features': 5, 'mask': 4}",
        ),
    ],
)
def test_malformed_dict_inputs_are_refused_by_name(inputs, message):
    model = Keyword()
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(")):
        LowRankGGN(model, nn.CrossEntropyLoss(), (inputs, torch.zeros(5).long()))


def test_dict_inputs_of_another_dtype_are_named():
    model = Keyword().double()
    inputs = {"features": torch.zeros(5, 3)}
    with pytest.raises(InvalidArgumentError, match=r"inputs\['features'\]\.to"):
        LowRankGGN(model, nn.CrossEntropyLoss(), (inputs, torch.zeros(5).long()))
