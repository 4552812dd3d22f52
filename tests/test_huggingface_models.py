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

from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.reference import dense_ggn
from vivit import InvalidTargetsError, LowRankGGN
from vivit.huggingface import causal_lm_targets, hide_broken_torchvision, token_logits

hide_broken_torchvision()
transformers = pytest.importorskip("transformers")

#: torch.func has no batching rule for SDPA's CPU backward: slower, still exact
pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop:UserWarning"
)
RTOL = EIGVAL_RTOL[torch.float64]
EXAMPLE = Path(__file__).parents[1] / "exp" / "huggingface.py"
N, T, VOCAB, CLASSES = 3, 5, 7, 3


def _gpt2():
    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB, n_positions=8
    )
    return transformers.GPT2LMHeadModel(config)


def _bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=8,
        num_labels=CLASSES,
    )
    return transformers.BertForSequenceClassification(config)


def _vit():
    config = transformers.ViTConfig(
        image_size=4,
        patch_size=2,
        num_channels=1,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        num_labels=CLASSES,
    )
    return transformers.ViTForImageClassification(config)


def _resnet():
    config = transformers.ResNetConfig(
        num_channels=1,
        embedding_size=4,
        hidden_sizes=[4],
        depths=[1],
        layer_type="basic",
        num_labels=CLASSES,
    )
    return transformers.ResNetForImageClassification(config)


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
        return _gpt2(), inputs, targets, token_logits
    targets = torch.randint(0, CLASSES, (N,))
    if name == "bert":
        return _bert(), _padded_tokens(), targets, "logits"
    pixel_values = torch.randn(N, 1, 4, 4, dtype=torch.float64)
    model = _vit() if name == "vit" else _resnet()
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


def test_example_script_runs_every_model(capsys):
    """``exp/huggingface.py`` (the guide's example) runs all four models."""
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["GPT-2", "BERT", "ViT", "ResNet"]
    assert all("engine func" in line for line in lines)
