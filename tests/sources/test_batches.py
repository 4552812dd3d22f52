"""Data checks of a part of the samples: unbatched samples are named (issue 19).

Torch layers accept one sample without a batch axis; the library reads the first
axis as the samples. A list of unbatched samples (an autoencoder's ``(x, x)``
pairs, a classifier's ``(x, label)``) used to fail deep inside the BackPACK
engine (``shape '[5, 1, -1, 5]' is invalid``) or with a coupling error from the
func engine; it is refused before any engine runs, naming the shape and what to
pass. The advice is checked: the stacked batch gives the dense float64 GGN
(``tests/fixtures/checks.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vivit.engines.backpack.engine
import vivit.engines.func.engine
from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.reference import dense_ggn
from vivit import InvalidArgumentError, LowRankGGN, StreamingGGN

D = 5


def _autoencoder():
    return nn.Sequential(nn.Linear(D, 3), nn.ReLU(), nn.Linear(3, D)).double()


def _cnn():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 3)).double()


def _samples(kind: str, reduction: str):
    """Model, loss and a list of unbatched ``(x, y)`` samples."""
    torch.manual_seed(0)
    if kind == "autoencoder":
        X = torch.randn(4, D, dtype=torch.float64)
        return _autoencoder(), nn.MSELoss(reduction=reduction), [(x, x) for x in X]
    if kind == "classifier":
        X, y = torch.randn(4, D, dtype=torch.float64), torch.randint(0, D, (4,))
        samples = list(zip(X, y, strict=True))
        return _autoencoder(), nn.CrossEntropyLoss(reduction=reduction), samples
    X, y = torch.randn(4, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    samples = list(zip(X, y, strict=True))
    return _cnn(), nn.CrossEntropyLoss(reduction=reduction), samples


@pytest.fixture
def no_engine_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an engine ran")

    monkeypatch.setattr(vivit.engines.backpack.engine.BackpackEngine, "run", refuse)
    monkeypatch.setattr(vivit.engines.func.engine.FuncEngine, "run", refuse)


@pytest.mark.parametrize("front_door", [LowRankGGN, StreamingGGN])
@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["autoencoder", "classifier", "conv2d"])
def test_unbatched_samples_are_named(
    kind, reduction, engine, front_door, no_engine_runs
):
    model, loss_func, samples = _samples(kind, reduction)
    shape = tuple(samples[0][0].shape)
    for data in (samples, samples[0]):  # a loader of samples, or one sample
        with pytest.raises(InvalidArgumentError, match="without a batch axis") as e:
            front_door(model, loss_func, data, engine=engine)
        assert f"shape {shape}" in str(e.value)
        assert "torch.stack(inputs)" in str(e.value)


@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["autoencoder", "classifier", "conv2d"])
def test_advice_for_unbatched_samples(kind, reduction, engine):
    """Stacked (or each given a batch axis of one): the GGN of all samples."""
    model, loss_func, samples = _samples(kind, reduction)
    X = torch.stack([x for x, _ in samples])
    y = torch.stack([t for _, t in samples])
    reference = torch.linalg.eigvalsh(dense_ggn(model, loss_func, X, y))
    stacked = LowRankGGN(model, loss_func, (X, y), engine=engine)
    assert_top_eigvals(stacked.eigvalsh(), reference, EIGVAL_RTOL[torch.float64])
    one_each = [(x.unsqueeze(0), t.unsqueeze(0)) for x, t in samples]
    loader = LowRankGGN(model, loss_func, one_each, engine=engine)
    assert_top_eigvals(loader.eigvalsh(), reference, EIGVAL_RTOL[torch.float64])


def test_square_batch_is_not_a_sample():
    """``N`` equal to the input features: a batch ``[N, I]``, not refused."""
    torch.manual_seed(0)
    model, X = _autoencoder(), torch.randn(D, D, dtype=torch.float64)
    ggn = LowRankGGN(model, nn.MSELoss(), (X, X))
    G = dense_ggn(model, nn.MSELoss(), X, X)
    assert_top_eigvals(
        ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
    )
