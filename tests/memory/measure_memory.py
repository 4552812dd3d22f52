"""Worker of ``test_memory.py``: measure the peak memory of requests in a fresh process.

Run as ``python tests/memory/measure_memory.py``; prints one JSON line per request with
the measured increase of resident memory and the estimate.

Measurement: glibc's malloc is told to serve every allocation of at least 128 KiB
with its own ``mmap`` (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, which also turns off
the threshold's dynamic growth), so freed tensors go back to the kernel at once
and the resident set follows the live allocations. Before each request the
garbage collector runs, ``malloc_trim(0)`` returns free heap memory, and writing
``5`` to ``/proc/self/clear_refs`` resets the high-water mark ``VmHWM`` to the
current ``VmRSS``; the peak increase is ``VmHWM`` after minus ``VmRSS`` before.
Each request runs once on a few samples before it is measured (libraries paged
in, thread pools).
"""

import ctypes
import gc
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

from vivit import LowRankGGN
from vivit.memory import estimate_data_set_memory, estimate_memory

M_MMAP_THRESHOLD = -3


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_increase(function) -> int:
    """Bytes the resident set grows at most while ``function()`` runs."""
    libc = ctypes.CDLL("libc.so.6")
    gc.collect()
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _status("VmRSS")
    function()
    return _status("VmHWM") - before


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 12 * 12, 10),
    )


def cnn3c3d() -> nn.Module:
    """3c3d's layout (``benchmarks/problems.py``) with fewer channels and units."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(16, 24, 3),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(24, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(32 * 3 * 3, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def layer_norm_mlp() -> nn.Module:
    """LayerNorm has no BackPACK extension: ``engine="auto"`` runs func."""
    return nn.Sequential(
        nn.Linear(784, 128),
        nn.LayerNorm(128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.LayerNorm(64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


GRAM64 = {"gram_dtype": torch.float64}


#: (name, model, input shape, N, loader batch size or None, options, solvers); the
#: options go by the same names to LowRankGGN and the estimate
class TiedTransformer(nn.Module):
    """Tokens from the inputs, a tied table as the output layer (10 classes)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.tokens = nn.Embedding(10, d)
        self.block = nn.TransformerEncoderLayer(
            d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, x):
        tokens = (x.abs() * 10).long() % 10  # [N, 16]
        h = self.block(self.tokens(tokens)).mean(1)
        return nn.functional.linear(h, self.tokens.weight)


class SequenceFirstConv1D(nn.Module):
    """Sequence-first attention and Hugging Face's Conv1D (torch.addmm)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attention = nn.MultiheadAttention(d, 4)
        self.weight = nn.Parameter(torch.randn(d, 10) / d**0.5)
        self.bias = nn.Parameter(torch.zeros(10))

    def forward(self, x):
        h = self.norm(x.reshape(len(x), -1, self.weight.shape[0])).transpose(0, 1)
        h = (h + self.attention(h, h, h, need_weights=False)[0]).transpose(0, 1)
        rows = torch.addmm(self.bias, h.reshape(-1, h.shape[-1]), self.weight)
        return rows.reshape(len(x), -1, 10).mean(1)


REQUESTS = [
    ("cnn", cnn, (3, 32, 32), 32, None, {}, ["dense", "factor_krylov"]),
    ("cnn-mc", cnn, (3, 32, 32), 32, None, {"mc_samples": 1}, ["auto"]),
    (
        "cnn-subsampled",
        cnn,
        (3, 32, 32),
        32,
        None,
        {"subsampling": list(range(16))},
        ["factor_krylov"],
    ),
    ("3c3d-like", cnn3c3d, (3, 32, 32), 128, None, {}, ["factor_krylov"]),
    (
        "3c3d-like-chunked",
        cnn3c3d,
        (3, 32, 32),
        128,
        None,
        {"chunk_size": 16},
        ["factor_krylov", "dense"],
    ),
    ("3c3d-like-chunk-1", cnn3c3d, (3, 32, 32), 64, None, {"chunk_size": 1}, ["auto"]),
    ("mlp", mlp, (784,), 128, None, {}, ["gram_krylov", "factor_krylov"]),
    ("mlp-groups", mlp, (784,), 128, None, {"groups": True}, ["dense"]),
    ("mlp-float64-gram", mlp, (784,), 128, None, GRAM64, ["dense"]),
    ("cnn-float64-gram", cnn, (3, 32, 32), 32, None, GRAM64, ["factor_krylov"]),
    ("cnn-func", cnn, (3, 32, 32), 32, None, {"engine": "func"}, ["dense"]),
    (
        "cnn-func-float64-gram",
        cnn,
        (3, 32, 32),
        32,
        None,
        {"engine": "func", **GRAM64},
        ["gram_krylov"],
    ),
    (
        "3c3d-like-func-chunked",
        cnn3c3d,
        (3, 32, 32),
        64,
        None,
        {"engine": "func", "chunk_size": 16},
        ["factor_krylov"],
    ),
    ("layer-norm-mlp", layer_norm_mlp, (784,), 128, None, {}, ["auto"]),
    ("mlp-loader", mlp, (784,), 512, 64, {}, ["auto"]),
    ("cnn-loader-float64-gram", cnn, (3, 32, 32), 64, 16, GRAM64, ["dense"]),
    ("cnn-loader-func", cnn, (3, 32, 32), 64, 16, {"engine": "func"}, ["auto"]),
    ("tied-transformer", TiedTransformer, (16,), 64, None, {}, ["auto"]),
    ("conv1d-seq-first", SequenceFirstConv1D, (16, 32), 64, None, {}, ["auto"]),
]
#: Samples of the warm-up request (same code paths, little memory).
WARM_UP = 16


def run_request(model, loss_func, data, solver, options) -> None:
    """``LowRankGGN(...)`` and the top-10 eigenpairs of every group."""
    ggn = LowRankGGN(model, loss_func, data, solver=solver, **options)
    for group in range(len(ggn.param_groups)):
        ggn.eigh(top_k=10, group=group)


def prepare_measurement() -> None:
    """Every large allocation its own ``mmap``; one thread; a fixed seed."""
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    torch.manual_seed(0)
    torch.set_num_threads(1)


def run_worker(path: Path) -> list[dict]:
    """Run a measuring worker in a fresh process; its JSON lines as dicts."""
    output = subprocess.run(
        [sys.executable, str(path)], check=True, capture_output=True, text=True
    ).stdout
    return [json.loads(line) for line in output.splitlines()]


def main() -> None:
    prepare_measurement()
    for name, build, shape, N, loader_batch, options, solvers in REQUESTS:
        model = build()
        X, y = torch.randn(N, *shape), torch.randint(0, 10, (N,))
        loss_func = nn.CrossEntropyLoss()
        options = dict(options)
        if options.pop("groups", False):
            options["param_groups"] = [
                list(m.parameters()) for m in model if list(m.parameters())
            ]
        if loader_batch is None:
            data, warm_up = (X, y), (X[:WARM_UP], y[:WARM_UP])
        else:
            data = [
                (X[i : i + loader_batch], y[i : i + loader_batch])
                for i in range(0, N, loader_batch)
            ]
            warm_up = data[:2]
        warm_options = {k: v for k, v in options.items() if k != "subsampling"}
        for solver in solvers:
            run_request(model, loss_func, warm_up, solver, warm_options)
            measured = peak_increase(
                partial(run_request, model, loss_func, data, solver, options)
            )
            request = {"loss_func": loss_func, "top_k": 10, "solver": solver}
            estimate = (
                estimate_memory(model, X[:2], N, **request, **options)
                if loader_batch is None
                else estimate_data_set_memory(
                    model, X[:2], N, loader_batch, **request, **options
                )
            )
            print(
                json.dumps(
                    {
                        "request": f"{name}-{solver}",
                        "measured": measured,
                        "estimate": estimate.total,
                        "engine": estimate.engine,
                    }
                )
            )


if __name__ == "__main__":
    main()
