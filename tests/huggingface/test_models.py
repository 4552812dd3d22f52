"""Hugging Face models (randomly initialised tiny configs) against the dense reference.

GPT-2 (causal LM, padded, tied embeddings), BERT (sequence classification with an
attention mask), ViT and ResNet (image classification) in float64: the GGN's
eigenvalues equal those of the dense float64 reference called the same way
(``EIGVAL_RTOL``, ``docs/math.rst``, "Precision and the numerical zero"). Skipped
without ``transformers`` (``pip install ".[transformers]"``).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    REORDERED_REL,
    REORDERED_REL32,
    assert_top_eigvals,
)
from tests.fixtures.optional_packages import installed
from tests.fixtures.reference import dense_ggn
from vivit import InvalidTargetsError, LowRankGGN
from vivit.huggingface import (
    IGNORE_INDEX,
    causal_lm_targets,
    split_labels,
    token_logits,
)

hf_models = installed("tests.fixtures.hf_models")

#: torch.func has no batching rule for SDPA's CPU backward: slower, still exact
pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop:UserWarning"
)
RTOL = EIGVAL_RTOL[torch.float64]
EXAMPLE = Path(__file__).parents[2] / "exp" / "huggingface.py"
N, T, VOCAB, CLASSES = 3, 5, hf_models.VOCAB, hf_models.CLASSES


def _padded_tokens():
    input_ids = torch.randint(0, VOCAB, (N, T))
    attention_mask = torch.ones(N, T, dtype=torch.long)
    attention_mask[1, 3:] = 0
    attention_mask[2, :1] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _problem(name: str):
    """Model (float64, eval), inputs, targets, output selector."""
    torch.manual_seed(0)
    if name == "gpt2":
        inputs = _padded_tokens()
        targets = causal_lm_targets(**inputs)
        return hf_models.gpt2(), inputs, targets, token_logits
    targets = torch.randint(0, CLASSES, (N,))
    if name == "bert":
        return hf_models.bert(), _padded_tokens(), targets, "logits"
    pixel_values = torch.randn(N, 1, 4, 4, dtype=torch.float64)
    model = hf_models.vit() if name == "vit" else hf_models.resnet()
    return model, {"pixel_values": pixel_values}, targets, "logits"


def _as_function(output):
    """The reference's selector: a function of the model's output."""
    return output if callable(output) else lambda out: out[output]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "vit", "resnet"])
def test_hugging_face_models_give_the_reference_ggn(name, reduction):
    model, inputs, targets, output = _problem(name)
    model = model.double().eval()
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    ggn = LowRankGGN(model, loss_func, (inputs, targets), output=output)
    assert ggn.engine == "func"
    reference = dense_ggn(
        model, loss_func, inputs, targets, output=_as_function(output)
    )
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(reference), RTOL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "vit", "resnet"])
def test_hugging_face_models_on_the_implicit_route(name, reduction):
    """Keyword inputs, padding and tied weights through JVP/VJP products: the
    leading eigenvalues within the iterative solvers' bound ``tol·λ_max``."""
    model, inputs, targets, output = _problem(name)
    model = model.double().eval()
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    ggn = LowRankGGN(
        model, loss_func, (inputs, targets), output=output, route="implicit"
    )
    assert ggn.plan.route == "implicit"
    evals, _ = ggn.eigh(top_k=3)
    reference = dense_ggn(
        model, loss_func, inputs, targets, output=_as_function(output)
    )
    assert_top_eigvals(evals, torch.linalg.eigvalsh(reference), RTOL)


def test_gpt2_ties_its_embedding_and_head_and_chunks_exactly():
    """``lm_head.weight`` is ``wte.weight``: one parameter, both uses in its V."""
    model, inputs, targets, output = _problem("gpt2")
    model = model.double().eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    loss_func = nn.CrossEntropyLoss()
    ggn = LowRankGGN(model, loss_func, (inputs, targets), output=output, chunk_size=2)
    reference = dense_ggn(model, loss_func, inputs, targets, output=output)
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(reference), RTOL)


def test_token_logits_are_needed_for_language_model_logits():
    """Logits ``[N, T, C]`` with targets ``[N, T]`` are refused, not transposed."""
    model, inputs, targets, _ = _problem("gpt2")
    with pytest.raises(InvalidTargetsError, match=r"output of shape \(3, 5, 7\)"):
        LowRankGGN(
            model.eval(), nn.CrossEntropyLoss(), (inputs, targets), output="logits"
        )


def test_language_model_logits_refused_with_token_logits_named():
    model, inputs, targets, _ = _problem("gpt2")
    with pytest.raises(InvalidTargetsError, match=r"output=vivit\.huggingface\.token"):
        LowRankGGN(
            model.eval(), nn.CrossEntropyLoss(), (inputs, targets), output="logits"
        )


def _collated_batches(name: str) -> list[dict[str, torch.Tensor]]:
    """Two batches as Hugging Face collators return them, the labels inside.

    GPT-2: a causal language model's labels, the token ids with padding (left
    and right) ``-100``, not shifted; BERT: one class per sequence.
    """
    batches = []
    for _ in range(2):
        batch = _padded_tokens()
        if name == "gpt2":
            padding = batch["attention_mask"] == 0
            batch["labels"] = batch["input_ids"].masked_fill(padding, IGNORE_INDEX)
        else:
            batch["labels"] = torch.randint(0, CLASSES, (N,))
        batches.append(batch)
    return batches


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_split_labels_give_the_model_s_own_loss_and_the_reference_ggn(name, reduction):
    """The targets are those of the loss the model computes from its labels.

    HF's loss is a mean over the counted targets: equal to ours up to the order
    of the same sums (``REORDERED_REL``; ``REORDERED_REL32`` for a causal LM,
    whose loss HF computes from float32 logits); the GGN of the loader's two
    batches equals the dense reference of their union (``EIGVAL_RTOL``,
    ``docs/math.rst``, "Precision and the numerical zero").
    """
    torch.manual_seed(0)
    model = (hf_models.gpt2() if name == "gpt2" else hf_models.bert()).double().eval()
    batches = _collated_batches(name)
    shift, output = (True, token_logits) if name == "gpt2" else (False, "logits")
    loader = split_labels(batches, shift=shift)
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    mean = nn.CrossEntropyLoss()
    for batch, (inputs, targets) in zip(batches, loader, strict=True):
        assert "labels" not in inputs
        returned = model(**inputs)
        logits = token_logits(returned) if shift else returned.logits
        own = model(**batch).loss  # a causal LM's in float32 (HF upcasts to it)
        rtol = REORDERED_REL if own.dtype == torch.float64 else REORDERED_REL32
        ours = mean(logits, targets).to(own.dtype)
        torch.testing.assert_close(ours, own, rtol=rtol, atol=0)
    ggn = LowRankGGN(model, loss_func, loader, output=output)
    union = {
        key: torch.cat([inputs[key] for inputs, _ in loader])
        for key in batches[0]
        if key != "labels"
    }
    targets = torch.cat([targets for _, targets in loader])
    reference = dense_ggn(model, loss_func, union, targets, output=_as_function(output))
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(reference), RTOL)


def test_split_labels_agree_with_causal_lm_targets_on_right_padding():
    """Right padding: the model's own targets skip exactly what
    ``causal_lm_targets`` skips (left padding differs: see ``split_batch``)."""
    torch.manual_seed(0)
    (batch, _) = _collated_batches("gpt2")
    batch["attention_mask"][2, :1] = 1  # only right padding left
    batch["labels"] = batch["input_ids"].masked_fill(
        batch["attention_mask"] == 0, IGNORE_INDEX
    )
    ((inputs, targets),) = split_labels([batch], shift=True)
    assert torch.equal(targets, causal_lm_targets(**inputs))


def test_example_script_runs_every_model(capsys):
    """``exp/huggingface.py`` (the guide's example) runs all four models."""
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    models, reasons = lines[::2], lines[1::2]
    assert [line.split()[0] for line in models] == ["GPT-2", "BERT", "ViT", "ResNet"]
    # GPT-2's 20·12 columns per sample cost more than the implicit products
    assert "implicit route (engine implicit)" in models[0]
    assert all("gram route (engine func)" in line for line in models[1:])
    assert all(line.split()[0] == "why:" for line in reasons)
