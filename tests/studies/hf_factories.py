"""Tiny Hugging Face models for ``--model PATH:FACTORY`` (random, nothing downloaded).

Vocabulary, sequence length and image size match the data of
``tests/studies/test_study_huggingface.py``.
"""

from vivit.huggingface import hide_broken_torchvision

hide_broken_torchvision()
import transformers  # noqa: E402

VOCAB, POSITIONS, CLASSES = 7, 5, 3


def gpt2():
    """A causal language model; its head shares the token embedding's weight."""
    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB, n_positions=POSITIONS
    )
    return transformers.GPT2LMHeadModel(config)


def bert():
    """A sequence classifier of ``CLASSES`` classes."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=POSITIONS,
        num_labels=CLASSES,
    )
    return transformers.BertForSequenceClassification(config)


def vit():
    """An image classifier of 1x4x4 images."""
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
