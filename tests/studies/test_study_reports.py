"""What the studies print: readable numbers, counted headers, median timings."""

import re
import statistics
from argparse import Namespace

import pytest
import torch
from backpack import extend
from studies import newton, spectrum
from studies.report import number, wrapped_values
from torch import nn

from vivit import LowRankGGN


@pytest.mark.parametrize(
    "value, text",
    [
        (1.2e-05, "1.2e-05"),
        (0.3125, "0.312"),
        (2.302585, "2.3"),
        (12345.0, "1.23e+04"),
        (0.0, "0"),
        (None, "n/a"),
        (float("nan"), "n/a"),
        (float("inf"), "n/a"),
    ],
)
def test_number_shows_every_magnitude(value, text):
    assert number(value) == text


def test_wrapped_values():
    lines = wrapped_values([float(i) for i in range(1, 24)], per_line=10)
    assert len(lines) == 3
    assert [len(line.split(", ")) for line in lines] == [10, 10, 3]
    assert wrapped_values([]) == []


def _spectrum_results(num_values: int, top_k: int, train_loss: float) -> dict:
    values = [10.0 ** -(i / 10) for i in range(num_values)]
    exact = {
        "label": "exact",
        "top_eigenvalues": values,
        "gram_sizes": [640],
        "eigenvalues": values + [0.0] * (640 - num_values),
        "zero_tolerance": 1e-12,
        "num_nonzero": num_values,
        "time_s": {"total": 0.0123},
        "max_relative_error": 0.0,
        "mean_relative_error": 0.0,
        "subspace_overlap": 1.0,
    }
    return {
        "methods": {"exact": exact},
        "metrics": {"train_loss": train_loss, "test_accuracy": 0.9},
        "training": {"steps": 100},
        "num_parameters": 3466,
        "batch_size": 64,
        "gram_dtype": "float64",
        "top_k": top_k,
    }


def test_spectrum_summary_header_counts_the_values():
    """``--top-k 500`` with 94 non-zero eigenvalues: the header says 94."""
    args = Namespace(model="mlp", checkpoint=None)
    lines = spectrum.summarize(_spectrum_results(94, 500, 1.2e-05), args)
    header = next(line for line in lines if line.startswith("Top "))
    assert header == "Top 94 eigenvalues (--top-k 500; only 94 are non-zero):"
    start = lines.index(header) + 1
    values = [v for line in lines[start : start + 10] for v in line.split(",")]
    assert len([v for v in values if re.fullmatch(r"\s*[\d.e+-]+\s*", v)]) == 94
    assert max(len(line) for line in lines[start : start + 10]) <= 100
    assert "train loss 1.2e-05" in lines[0]


def test_spectrum_summary_header_when_all_values_exist():
    args = Namespace(model="mlp", checkpoint=None)
    lines = spectrum.summarize(_spectrum_results(3, 3, 0.5), args)
    assert "Top 3 eigenvalues:" in lines


def test_newton_summary_shows_small_losses():
    evaluation = {"train_loss": 1.2e-05, "train_accuracy": 1.0, "test_accuracy": 1.0}
    results = {
        "optimizers": {
            "sgd": {
                "initial": {**evaluation, "train_loss": 2.3},
                "final": evaluation,
                "time_per_step_s": 0.0021,
                "wall_time_s": 0.17,
                "status": "completed",
            }
        }
    }
    args = Namespace(model="mlp", steps=80, batch_size=64)
    (line,) = newton.summarize(results, args)[2:]
    assert "2.3 -> 1.2e-05" in line and "0.000" not in line


def test_spectrum_times_are_medians_of_repeated_runs(monkeypatch):
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 3)))
    loss_func = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    calls = []

    def build():
        calls.append(1)
        return LowRankGGN(model, loss_func, (X, y))

    # perf_counter readings: each run's phases take the given (fake) seconds
    durations = [[1, 1, 1], [5, 5, 5], [2, 2, 2]]
    readings, now = [], 0
    for run in durations:
        readings.append(now)
        for phase in run:
            now += phase
            readings.append(now)
    ticks = iter(readings)

    def fake_clock():
        return next(ticks)

    monkeypatch.setattr(spectrum.time, "perf_counter", fake_clock)
    method = spectrum.compute("exact", build, list(model.parameters()), 2, repeats=3)
    assert len(calls) == 3
    assert method.times == {
        "backward": statistics.median([1, 5, 2]),
        "eigendecomposition": 2,
        "eigenvectors": 2,
        "total": statistics.median([3, 15, 6]),
    }
