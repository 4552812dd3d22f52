"""The memory of a pass over a data loader: estimate, refusal, measured peak."""

from pathlib import Path

import pytest
import torch

from tests.fixtures.checks import REORDERED_REL, assert_rel
from tests.fixtures.memory import available
from tests.fixtures.problems import prepare, select
from tests.memory.measure_memory import run_worker
from tests.sources.test_data_loader import split
from vivit import FactorsTooLargeError, GramTooLargeError, LowRankGGN
from vivit.memory import estimate_data_set_memory
from vivit.memory.plan import ESTIMATE_FACTOR as FACTOR


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc"
)
def test_estimate_against_measured_peak():
    worker = Path(__file__).with_name("measure_loader_memory.py")
    results = run_worker(worker)
    assert len(results) == 4
    for result in results:
        ratio = result["measured"] / result["estimate"]
        assert 1 / FACTOR <= ratio <= FACTOR, result


class Counting:
    """A loader that counts the batches taken from it."""

    def __init__(self, batches, sized=True):
        self.batches, self.taken, self.sized = batches, 0, sized

    def __len__(self):
        if not self.sized:
            raise TypeError("no length")
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.taken += 1
            yield batch


@pytest.fixture
def loader_setup():
    (problem,) = select(architecture="cnn", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [1, 1, 1, 1])
    return model, loss_func, batches


def passes_bytes(model, loss_func, batches, **options):
    """The estimate of a pass over the loader (its factors kept)."""
    samples = sum(len(y) for _, y in batches)
    return estimate_data_set_memory(
        model, batches[0][0], samples, len(batches[0][1]), loss_func=loss_func,
        top_k=1, solver="factor_krylov", **options,
    ).passes  # fmt: skip


def test_refused_before_the_pass_when_the_length_is_known(loader_setup, monkeypatch):
    """A loader with a length: its pass is estimated before it runs."""
    model, loss_func, batches = loader_setup
    needed = passes_bytes(model, loss_func, batches)
    available(monkeypatch, int(needed / FACTOR / 2))
    loader = Counting(batches)
    with pytest.raises(FactorsTooLargeError) as error:
        LowRankGGN(model, loss_func, loader, solver="factor_krylov")
    assert loader.taken == 1  # the first batch, measured
    message = str(error.value)
    for hint in ("passes over these 4 samples", "mc_samples=1", "StreamingGGN"):
        assert hint in message, message
    available(monkeypatch, 2**40)
    LowRankGGN(model, loss_func, Counting(batches))


def test_refused_before_the_batch_that_does_not_fit_without_length(
    loader_setup, monkeypatch
):
    """Without a length the pass is judged on its first batch, then watched:
    the factors stored so far are extrapolated to one more batch."""
    model, loss_func, batches = loader_setup
    ggn = LowRankGGN(model, loss_func, Counting(batches, sized=False))
    assert ggn.gram().shape == (12, 12)
    one = passes_bytes(model, loss_func, batches[:1])
    two = passes_bytes(model, loss_func, batches[:2])
    # the first batch fits, two batches' factors and a pass do not
    available(monkeypatch, int((one + two) / 2 / FACTOR))
    loader = Counting(batches, sized=False)
    with pytest.raises(FactorsTooLargeError, match="one more batch") as error:
        LowRankGGN(model, loss_func, loader, solver="factor_krylov")
    assert "first 1 of an unknown number" in str(error.value)
    assert loader.taken < 4


def test_dense_solver_refused_before_the_pass_when_its_gram_cannot_fit(
    loader_setup, monkeypatch
):
    """solver="dense" forms the Gram of all samples: refused before the pass."""
    model, loss_func, batches = loader_setup
    batches = batches * 25  # 100 batches of 1 sample, C = 3
    passes = passes_bytes(model, loss_func, batches)
    gram = 4 * 300**2 * 8  # the 300 x 300 float64 Gram and LAPACK's workspace
    assert passes < gram
    available(monkeypatch, gram - 1)
    loader = Counting(batches)
    with pytest.raises(GramTooLargeError, match="300 x 300"):
        LowRankGGN(model, loss_func, loader, solver="dense")
    assert loader.taken == 1
    LowRankGGN(model, loss_func, Counting(batches), solver="factor_krylov")


def test_a_loader_in_chunks_is_checked_too(loader_setup, monkeypatch):
    """chunk_size skipped the check once: a loader that cannot fit ran to the end."""
    model, loss_func, batches = loader_setup
    batches = [(torch.cat([x] * 3), torch.cat([y] * 3)) for x, y in batches]
    needed = passes_bytes(model, loss_func, batches, chunk_size=1)
    available(monkeypatch, int(needed / FACTOR / 2))
    loader = Counting(batches)
    with pytest.raises(FactorsTooLargeError, match="passes over these 12 samples"):
        LowRankGGN(model, loss_func, loader, chunk_size=1, solver="factor_krylov")
    assert loader.taken == 1
    available(monkeypatch, 2**40)
    chunked = LowRankGGN(model, loss_func, Counting(batches), chunk_size=1)
    whole = LowRankGGN(model, loss_func, Counting(batches))
    assert_rel(chunked.gram(), whole.gram(), REORDERED_REL)  # sums in other chunks
