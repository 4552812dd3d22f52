"""Top-10 GGN eigenpairs of a small GPT-like causal transformer, solver="implicit".

Times ``LowRankGGN(..., solver="implicit").eigh(top_k=10)`` and one forward and
backward pass of the same batch, each in a fresh process (peak RSS from
``resource.getrusage``), one thread. Usage::

    python benchmarks/implicit_gpt.py            # both measurements
    python benchmarks/implicit_gpt.py --what fb  # one of them (the child run)
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from torch import nn

from vivit import LowRankGGN

VOCAB, WIDTH, HEADS, LAYERS, T, N = 500, 64, 4, 2, 64, 8


class TinyGPT(nn.Module):
    """Token and position embeddings, causal pre-norm blocks, a vocabulary head."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(T, WIDTH)
        layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, x):
        h = self.tokens(x) + self.positions.weight[: x.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h)).transpose(1, 2)  # [N, C, T]


def run(what: str) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyGPT().eval()
    tokens = torch.randint(0, VOCAB, (N, T + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss_func = nn.CrossEntropyLoss()
    start = time.perf_counter()
    if what == "fb":
        loss_func(model(inputs), targets).backward()
        result = {}
    else:
        ggn = LowRankGGN(model, loss_func, (inputs, targets), solver="implicit")
        evals, _ = ggn.eigh(top_k=10)
        report = ggn.solver_report()
        result = {
            "top_eigenvalues": evals.tolist(),
            "products": report.products,
            "residual": report.residual,
        }
    result["seconds"] = time.perf_counter() - start
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["params"] = sum(p.numel() for p in model.parameters())
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--what", choices=["fb", "implicit"])
    args = parser.parse_args()
    if args.what:
        print(json.dumps(run(args.what)))
    else:
        for what in ("fb", "implicit"):
            out = subprocess.run(
                [sys.executable, __file__, "--what", what],
                capture_output=True,
                text=True,
                check=True,
            )
            print(what, out.stdout.strip())
