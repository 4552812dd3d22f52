"""Worker of ``test_data_loader_memory.py``: a loader's stored factors, measured.

Run as ``python tests/memory/measure_loader_memory.py``; prints one JSON line per loader
with the measured peak increase of resident memory while ``LowRankGGN`` passes
over it (``measure_memory.peak_increase``: every allocation of 128 KiB or more
served by its own ``mmap``) and the estimate the library refuses with, taken
from the refusal when no memory is available (after the first batch).
"""

import json
import re
from functools import partial

import torch
from measure_memory import cnn, mlp, peak_increase, prepare_measurement
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vivit.memory.budget
from vivit import FactorsTooLargeError, LowRankGGN

#: (name, model, input shape, samples, batch size, LowRankGGN options)
LOADERS = [
    ("mlp", mlp, (784,), 1024, 64, {}),
    ("mlp-float64-gram", mlp, (784,), 512, 64, {"gram_dtype": torch.float64}),
    ("cnn", cnn, (3, 32, 32), 128, 16, {}),
    ("cnn-mc", cnn, (3, 32, 32), 256, 32, {"mc_samples": 1}),
]


def estimate(model, loss_func, loader, options) -> int:
    """The estimate in the refusal with no memory available, in bytes."""
    original = vivit.memory.budget.available_bytes
    vivit.memory.budget.available_bytes = lambda device: 0
    try:
        LowRankGGN(model, loss_func, loader, **options)
    except FactorsTooLargeError as error:
        mib = float(re.search(r"need about ([\d.]+) MiB", str(error)).group(1))
        return int(mib * 2**20)
    finally:
        vivit.memory.budget.available_bytes = original
    raise RuntimeError("not refused")


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
                    "loader": name,
                    "measured": measured,
                    "estimate": estimate(model, loss_func, loader, options),
                }
            )
        )


if __name__ == "__main__":
    main()
