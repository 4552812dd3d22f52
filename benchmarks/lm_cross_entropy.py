"""Exact GGN of a small causal transformer language model: time and peak memory.

Cross-entropy on logits ``[N, C, T]`` (vocabulary ``C``, ``T`` positions): the
exact Gram matrix has ``N·C·T`` rows, and the exact loss-Hessian root ``C·T``
columns per sample, each non-zero at one position (``docs/math.rst``, "Losses").
Times ``LowRankGGN(...)`` followed by ``eigh(top_k=10)`` (or the construction
alone, ``--construct-only``) in this process and reports the peak growth of its
resident memory (:class:`benchmarks.measure.PeakMemory`)::

    python benchmarks/lm_cross_entropy.py                       # vocab 128, T=16, N=4
    python benchmarks/lm_cross_entropy.py --mc-samples 1        # per token
    python benchmarks/lm_cross_entropy.py --vocab 256 --width 16 --batch 2 \\
        --construct-only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import PeakMemory  # noqa: E402
from vivit import LowRankGGN  # noqa: E402


class CausalLM(nn.Module):
    """Token and position embeddings, pre-norm causal encoder blocks, unembedding."""

    def __init__(self, vocab: int, width: int, layers: int, length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.02 * torch.randn(length, width))
        block = nn.TransformerEncoderLayer(
            width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.unembed = nn.Linear(width, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        self.register_buffer("mask", mask)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, C, T]``."""
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        hidden = self.blocks(hidden, mask=self.mask, is_causal=True)
        return self.unembed(self.norm(hidden)).movedim(-1, 1)


def main() -> None:
    """Parse the options, run once, print one line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mc-samples", type=int, default=0)
    parser.add_argument("--mc-per", default="token")
    parser.add_argument("--construct-only", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = CausalLM(args.vocab, args.width, args.layers, args.length).eval()
    tokens = torch.randint(args.vocab, (args.batch, args.length))
    targets = torch.randint(args.vocab, (args.batch, args.length))
    with PeakMemory(torch.device("cpu")) as memory:
        start = time.perf_counter()
        ggn = LowRankGGN(
            model,
            nn.CrossEntropyLoss(),
            (tokens, targets),
            mc_samples=args.mc_samples,
            mc_per=args.mc_per,
        )
        top = [] if args.construct_only else ggn.eigh(top_k=10)[0].tolist()
        seconds = time.perf_counter() - start
    print(
        f"{vars(args)} engine={ggn.engine} time={seconds:.1f} s "
        f"peak={memory.peak_mib:.0f} MiB top3={[round(v, 6) for v in top[-3:]]}"
    )


if __name__ == "__main__":
    main()
