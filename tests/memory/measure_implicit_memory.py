"""Worker of ``test_memory.py``: the implicit route's peak memory in a fresh process.

Run as ``python tests/memory/measure_implicit_memory.py``; prints one JSON line per
request with the measured increase of resident memory (as ``measure_memory.py``
measures it) and :func:`vivit.memory.estimate.implicit_estimate`.
"""

import json
from functools import partial

import torch
from measure_memory import cnn3c3d, peak_increase, prepare_measurement
from torch import nn

from vivit import LowRankGGN
from vivit.memory.estimate import implicit_estimate
from vivit.options import CurvatureOptions


class CharLSTM(nn.Module):
    """Embedding → LSTM → Linear per position, ``[N, 10, T]`` (the benchmark's)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.lstm(self.embedding(x))[0]).transpose(1, 2)


def images(N):
    return torch.randn(N, 3, 32, 32), torch.randint(0, 10, (N,))


def tokens(N):
    return torch.randint(0, 10, (N, 16)), torch.randint(0, 10, (N, 16))


#: (name, model, batch, N, top_k, options)
REQUESTS = [
    ("3c3d-like", cnn3c3d, images, 256, 5, {}),
    ("3c3d-like-chunked", cnn3c3d, images, 256, 5, {"chunk_size": 64}),
    ("char-lstm", CharLSTM, tokens, 256, 10, {}),
]


def run_request(model, data, top_k, options) -> None:
    ggn = LowRankGGN(model, nn.CrossEntropyLoss(), data, solver="implicit", **options)
    ggn.eigh(top_k=top_k)


def main() -> None:
    prepare_measurement()
    for name, build, batch, N, top_k, options in REQUESTS:
        model = build()
        X, y = batch(N)
        run_request(model, (X[:4], y[:4]), top_k, options)
        measured = peak_increase(partial(run_request, model, (X, y), top_k, options))
        estimate = implicit_estimate(
            model,
            X,
            [list(model.parameters())],
            CurvatureOptions(**options),
            top_k,
        )
        print(
            json.dumps(
                {
                    "request": name,
                    "measured": measured,
                    "estimate": estimate.total,
                    "parts": [estimate.activations, estimate.products, estimate.krylov],
                }
            )
        )


if __name__ == "__main__":
    main()
