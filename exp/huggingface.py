"""Top GGN eigenvalues of Hugging Face GPT-2, BERT, ViT and ResNet (tiny, random).

Run: ``pip install ".[transformers]" && python exp/huggingface.py``. Nothing is
downloaded: every model is built from a small config with random weights. Each
shows one way in (see the guide's "Hugging Face models"):

* GPT-2: padded token batches as a dict, next-token targets with the padding
  ignored (``causal_lm_targets``), logits ``[N, T, C]`` moved to ``[N, C, T]``
  (``output=token_logits``); its head shares the embedding's weight;
* BERT: a sequence classifier with an attention mask, ``output="logits"``;
* ViT and ResNet: ``pixel_values`` (ResNet in eval mode for its BatchNorm).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from vivit import LowRankGGN
from vivit.huggingface import causal_lm_targets, hide_broken_torchvision, token_logits

hide_broken_torchvision()  # PyPI's torchvision does not load beside the CPU torch
import transformers  # noqa: E402

N, T, VOCAB, CLASSES = 8, 12, 20, 4


def token_batch() -> dict[str, torch.Tensor]:
    """Token ids with right padding of random length."""
    input_ids = torch.randint(0, VOCAB, (N, T))
    lengths = torch.randint(T // 2, T + 1, (N,))
    attention_mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def problems():
    """``(name, model, inputs, targets, output)`` of each model."""
    tokens = token_batch()
    labels = torch.randint(0, CLASSES, (N,))
    pixels = {"pixel_values": torch.randn(N, 3, 16, 16)}
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=T
        )
    )
    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=T,
            num_labels=CLASSES,
        )
    )
    vit = transformers.ViTForImageClassification(
        transformers.ViTConfig(
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=CLASSES,
        )
    )
    resnet = transformers.ResNetForImageClassification(
        transformers.ResNetConfig(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=CLASSES,
        )
    )
    return [
        ("GPT-2", gpt2, tokens, causal_lm_targets(**tokens), token_logits),
        ("BERT", bert, tokens, labels, "logits"),
        ("ViT", vit, pixels, labels, "logits"),
        ("ResNet", resnet, pixels, labels, "logits"),
    ]


def main():
    """Print each model's size, Gram size, top-5 eigenvalues and time."""
    torch.manual_seed(0)
    for name, model, inputs, targets, output in problems():
        model.eval()  # dropout off, BatchNorm on its running statistics
        start = time.perf_counter()
        ggn = LowRankGGN(model, nn.CrossEntropyLoss(), (inputs, targets), output=output)
        evals, _ = ggn.eigh(top_k=5)
        seconds = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        top = ", ".join(f"{v:.3g}" for v in evals.flip(0).tolist())
        print(
            f"{name:7s} {params:7,d} parameters, {ggn.plan.route} route "
            f"(engine {ggn.engine}), {seconds:5.2f} s: top-5 eigenvalues {top}"
        )
        print(f"        why: {ggn.plan.reason}")


if __name__ == "__main__":
    main()
