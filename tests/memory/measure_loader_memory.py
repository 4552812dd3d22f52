"""Worker of ``test_data_loader_memory.py``: a loader's stored factors, measured.

Run as ``python tests/memory/measure_loader_memory.py``; prints one JSON line per loader
with the measured peak increase of resident memory while ``LowRankGGN`` passes
over it (``measure_memory.peak_increase``: every allocation of 128 KiB or more
served by its own ``mmap``) and the estimate of that pass, the one the library
checks before it (:func:`vivit.memory.estimate_data_set_memory`).
"""

import json
from functools import partial

import torch
from measure_memory import cnn, mlp, peak_increase, prepare_measurement
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from vivit import LowRankGGN
from vivit.memory import estimate_data_set_memory

#: (name, model, input shape, samples, batch size, LowRankGGN options)
LOADERS = [
    ("mlp", mlp, (784,), 1024, 64, {}),
    ("mlp-float64-gram", mlp, (784,), 512, 64, {"gram_dtype": torch.float64}),
    ("cnn", cnn, (3, 32, 32), 128, 16, {}),
    ("cnn-mc", cnn, (3, 32, 32), 256, 32, {"mc_samples": 1}),
]


def estimate(model, loss_func, example, samples, batch_size, options) -> int:
    """The estimate of the pass over the loader (its factors kept), in bytes."""
    return estimate_data_set_memory(
        model, example, samples, batch_size, loss_func=loss_func, top_k=1,
        solver="factor_krylov", **options,
    ).passes  # fmt: skip


def main() -> None:
    prepare_measurement()
    for name, build, shape, samples, batch_size, options in LOADERS:
        model, loss_func = build(), nn.CrossEntropyLoss()
        X, y = torch.randn(samples, *shape), torch.randint(0, 10, (samples,))
        loader = DataLoader(TensorDataset(X, y), batch_size=batch_size)
        warm_up = [(X[:batch_size], y[:batch_size])] * 2
        LowRankGGN(model, loss_func, warm_up, **options)
        measured = peak_increase(
            partial(LowRankGGN, model, loss_func, loader, **options)
        )
        print(
            json.dumps(
                {
                    "request": name,
                    "measured": measured,
                    "estimate": estimate(
                        model, loss_func, X[:1], samples, batch_size, options
                    ),
                }
            )
        )


if __name__ == "__main__":
    main()
