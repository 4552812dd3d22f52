"""Worker of ``test_memory.py``: the implicit route's peak memory in a fresh process.

Run as ``python tests/memory/measure_implicit_memory.py``; prints one JSON line per
request with the measured increase of resident memory (as ``measure_memory.py``
measures it) and the estimate of the route the request takes
(:func:`vivit.memory.estimate_memory`, :func:`vivit.memory.estimate_data_set_memory`).
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch
from measure_memory import cnn3c3d, peak_increase, prepare_measurement
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks

from benchmarks.problems import make_problem  # noqa: E402
from vivit import LowRankGGN  # noqa: E402
from vivit.memory import estimate_data_set_memory, estimate_memory  # noqa: E402


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


def gpt2_tokens(N):
    """``gpt2-2l-64-v128``'s tokens and next tokens (its model: :func:`gpt2`)."""
    _, _, X, y = make_problem("gpt2-2l-64-v128", N, 0, torch.device("cpu"))
    return X, y


def gpt2():
    return make_problem("gpt2-2l-64-v128", 1, 0, torch.device("cpu"))[0]


#: Under ``solver="auto"``: (name, model, batch, N, loader's batch size or
#: ``None`` for one mini-batch, top_k); both take the implicit route by cost
AUTO_REQUESTS = [
    ("char-lstm-loader-auto", CharLSTM, tokens, 256, 64, 10),
    ("gpt2-2l-64-v128-auto", gpt2, gpt2_tokens, 4, None, 10),
]


def run_request(model, data, top_k, options, route="implicit") -> None:
    ggn = LowRankGGN(model, nn.CrossEntropyLoss(), data, route=route, **options)
    ggn.eigh(top_k=top_k)


def _batches(X, y, size):
    return [(X[i : i + size], y[i : i + size]) for i in range(0, len(X), size)]


def measure_auto() -> None:
    """The requests under ``"auto"``, against the estimate of their route."""
    loss_func = nn.CrossEntropyLoss()
    for name, build, batch, N, loader_batch, top_k in AUTO_REQUESTS:
        model = build()
        X, y = batch(N)
        data = (X, y) if loader_batch is None else _batches(X, y, loader_batch)
        # the same request first: the plan's measurement on a copy of the model
        # (a stopped one is kept per request, at most MEASURE_FRACTION of the
        # memory) is the first request's, not in the estimate of the route's
        run_request(model, data, top_k, {}, route="auto")
        measured = peak_increase(
            partial(run_request, model, data, top_k, {}, route="auto")
        )
        request = {"loss_func": loss_func, "top_k": top_k}
        estimate = (
            estimate_memory(model, X[:1], N, **request)
            if loader_batch is None
            else estimate_data_set_memory(model, X[:1], N, loader_batch, **request)
        )
        print(
            json.dumps(
                {
                    "request": name,
                    "measured": measured,
                    "estimate": estimate.total,
                    "route": estimate.route,
                    "parts": [estimate.passes, estimate.solve],
                }
            )
        )


def main() -> None:
    prepare_measurement()
    for name, build, batch, N, top_k, options in REQUESTS:
        model = build()
        X, y = batch(N)
        run_request(model, (X[:4], y[:4]), top_k, options)
        measured = peak_increase(partial(run_request, model, (X, y), top_k, options))
        estimate = estimate_memory(
            model, X[:1], N, loss_func=nn.CrossEntropyLoss(), top_k=top_k,
            route="implicit", **options,
        )  # fmt: skip
        print(
            json.dumps(
                {
                    "request": name,
                    "measured": measured,
                    "estimate": estimate.total,
                    "route": estimate.route,
                    "parts": [estimate.passes, estimate.solve],
                }
            )
        )
    measure_auto()


if __name__ == "__main__":
    main()
