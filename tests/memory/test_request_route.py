"""The estimate of a request follows the route the run takes (``vivit.memory.request``;
``docs/math.rst``, "Choosing the route", "Memory of a request").

The estimate and ``LowRankGGN`` take one decision (``vivit.memory.route``): the
same route, for the same reason, on mini-batches and loaders; its estimate is
that route's (the implicit route's for a language model, whose Gram route's
factors run to hundreds of thousands of GiB); ``largest_batch`` finds the
largest batch some exact route fits. Shapes only where no run is compared.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vivit.memory.budget
import vivit.memory.estimate
import vivit.memory.request
import vivit.memory.route
import vivit.sources.route
from benchmarks.problems import PROBLEMS as BENCHMARKS
from benchmarks.problems import make_problem
from tests.fixtures.func_problems import FUNC_PROBLEMS, TOKEN_VOCAB, TokenModel
from vivit import LowRankGGN
from vivit.errors import InvalidArgumentError, ProductsTooLargeError
from vivit.memory import (
    ImplicitEstimate,
    MemoryEstimate,
    estimate_data_set_memory,
    estimate_memory,
    largest_batch,
)
from vivit.memory.estimate import implicit_estimate
from vivit.options import CurvatureOptions

PROBLEMS = {p.name: p for p in FUNC_PROBLEMS}
GIB = 2**30
VOCAB, T = TOKEN_VOCAB, 8


def _available(monkeypatch, bytes_):
    """One memory for the run, the estimate and the implicit route's basis."""
    for module in (
        vivit.sources.route,
        vivit.memory.request,
        vivit.memory.estimate,
        vivit.memory.budget,
    ):
        monkeypatch.setattr(module, "available_bytes", lambda device: bytes_)


def _classifier():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    return model, nn.CrossEntropyLoss(), X, y


def _vocabulary():
    torch.manual_seed(0)
    model = TokenModel().double()
    X, y = torch.randint(0, VOCAB, (4, T)), torch.randint(0, VOCAB, (4, T))
    return model, nn.CrossEntropyLoss(), X, y


def _func_problem(name):
    def build():
        s = PROBLEMS[name].setup()
        return s.model, s.loss_func, s.inputs, s.targets

    return build


def _gpt2():
    return make_problem("gpt2-2l-64-v128", 4, 0, torch.device("cpu"))


MODELS = {
    "mlp-classifier": (_classifier, "gram"),
    "vocabulary": (_vocabulary, "implicit"),
    "transformer-ce-mean": (_func_problem("transformer-ce-mean"), "gram"),
    "lstm-ce-sum": (_func_problem("lstm-ce-sum"), "gram"),
    "causal-lm-ce-mean": (_func_problem("causal-lm-ce-mean"), None),
    "gpt2-2l-64-v128": (_gpt2, "implicit"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_estimate_takes_the_runs_route(monkeypatch, name):
    """Route and reason of ``estimate_memory`` are ``LowRankGGN(...).route``'s."""
    _available(monkeypatch, 64 * GIB)
    build, expected = MODELS[name]
    model, loss_func, X, y = build()
    estimate = estimate_memory(model, X[:1], len(X), loss_func=loss_func)
    run = LowRankGGN(model, loss_func, (X, y)).route
    assert (estimate.route, estimate.reason) == (run.name, run.reason)
    assert expected in (None, run.name)
    kind = MemoryEstimate if run.name == "gram" else ImplicitEstimate
    assert isinstance(estimate, kind) and estimate.total > 0


@pytest.mark.parametrize("name", ["mlp-classifier", "vocabulary"])
def test_the_estimate_of_a_loader_takes_the_runs_route(monkeypatch, name):
    """``estimate_data_set_memory`` decides as ``LowRankGGN`` over such a loader:
    the same route, the same numbers compared (the data described in words of
    their own: the run knows the loader's length and its first batch)."""
    _available(monkeypatch, 64 * GIB)
    model, loss_func, X, y = MODELS[name][0]()
    loader = [(X[i : i + 2], y[i : i + 2]) for i in range(0, len(X), 2)]
    estimate = estimate_data_set_memory(model, X[:1], len(X), 2, loss_func=loss_func)
    run = LowRankGGN(model, loss_func, loader).route
    assert estimate.route == run.name == MODELS[name][1]
    assert estimate.reason.startswith(f"a data loader of {len(X)} samples in batches")
    assert estimate.reason.split(": ", 1)[1] == run.reason.split(": ", 1)[1]


def test_memory_decides_for_the_estimate_as_for_the_run(monkeypatch):
    """The Gram route's factors do not fit, the implicit products do: both take
    the implicit route for that reason (one function, not a copy)."""
    model, loss_func, X, y = _classifier()
    groups = [list(model.parameters())]
    products = implicit_estimate(model, X, groups, CurvatureOptions(), 10)
    monkeypatch.setattr(
        vivit.memory.route, "kept_bytes", lambda estimate: 2 * products.total
    )
    _available(monkeypatch, products.total)
    estimate = estimate_memory(model, X[:1], len(X), loss_func=loss_func)
    run = LowRankGGN(model, loss_func, (X, y)).route
    assert estimate.route == run.name == "implicit"
    assert "are available" in run.reason and estimate.reason == run.reason
    _available(monkeypatch, products.total // 4)  # neither route fits
    with pytest.raises(ProductsTooLargeError, match="Neither exact route fits"):
        estimate_memory(model, X[:1], len(X), loss_func=loss_func)
    with pytest.raises(ProductsTooLargeError, match="Neither exact route fits"):
        LowRankGGN(model, loss_func, (X, y))


def test_gpt2_with_its_vocabulary_is_estimated_on_the_implicit_route(monkeypatch):
    """``gpt2-4l-128-v50257`` at ``N = 8``: the Gram route's factors of
    ``N·C·T`` = 25.7 M columns (hundreds of thousands of GiB, the estimate's
    answer before) do not fit into 24 GiB; the implicit route's estimate, its
    basis cut to those 24 GiB, does. Shapes only."""
    _available(monkeypatch, 24 * GIB)
    problem = BENCHMARKS["gpt2-4l-128-v50257"]
    torch.manual_seed(0)
    model = problem.build()
    X = torch.randint(0, problem.num_classes, (1, *problem.input_shape))
    estimate = estimate_memory(model, X, 8, loss_func=nn.CrossEntropyLoss())
    assert estimate.route == "implicit" and isinstance(estimate, ImplicitEstimate)
    assert estimate.reason.startswith(
        "the Gram route's factors of V (3216448 columns per sample, 8 samples) "
        "need at least "
    )
    assert estimate.total <= 24 * GIB
    assert estimate.solver == estimate.engine == "implicit"
    gram = estimate_memory(model, X, 8, loss_func=nn.CrossEntropyLoss(), solver="dense")
    assert gram.route == "gram" and gram.total > 10_000 * GIB


def test_solver_implicit_by_name_gives_the_implicit_estimate():
    model, loss_func, X, _ = _classifier()
    estimate = estimate_memory(
        model, X[:1], 64, loss_func=loss_func, top_k=3, solver="implicit"
    )
    groups = [list(model.parameters())]
    expected = implicit_estimate(
        model, X, groups, CurvatureOptions(solver="implicit"), 3, block=64
    )
    assert estimate == expected and estimate.reason == "solver='implicit' was asked for"
    with pytest.raises(InvalidArgumentError, match="pass top_k"):
        estimate_memory(model, X[:1], 64, top_k=None, solver="implicit")


def test_the_implicit_estimate_of_a_loader_does_not_grow_with_its_samples():
    """One batch's activations and tangents and the basis, whatever the set."""
    model, loss_func, X, _ = _vocabulary()
    small, large = (
        estimate_data_set_memory(model, X[:1], samples, 2, loss_func=loss_func)
        for samples in (4, 4000)
    )
    assert small.route == large.route == "implicit"
    assert small.total == large.total
    chunked = estimate_data_set_memory(
        model, X[:1], 4000, 2, loss_func=loss_func, chunk_size=1
    )
    assert chunked.activations == small.activations // 2


def test_all_eigenvalues_on_the_implicit_route_are_refused():
    """``top_k=None`` where the request runs the implicit route: no number."""
    model, loss_func, X, _ = _vocabulary()
    with pytest.raises(InvalidArgumentError, match="takes the implicit route") as e:
        estimate_memory(model, X[:1], 4, loss_func=loss_func, top_k=None)
    assert "solver='dense'" in str(e.value)
    assert estimate_memory(model, X[:1], 4, top_k=None, solver="dense").route == "gram"


def test_largest_batch_under_auto_is_that_of_some_exact_route():
    """Under "auto" a batch fits where either route's estimate does: for this
    language model the implicit route's, far beyond the Gram route's."""
    model, loss_func, X, _ = _vocabulary()
    search = {"loss_func": loss_func, "top_k": 3, "count_resident": False}
    budget = 64 * 2**20
    auto = largest_batch(model, X[:1], budget, **search)
    implicit = largest_batch(model, X[:1], budget, solver="implicit", **search)
    gram = largest_batch(model, X[:1], budget, solver="matrix_free", **search)
    assert auto == implicit > 100 * max(gram, 1)
    # held to the Gram route by an option the implicit route cannot honour
    held = largest_batch(
        model, X[:1], budget, mc_samples=1, mc_per="sequence", **search
    )
    assert 0 < held < auto
    assert estimate_memory(model, X[:1], auto, loss_func=loss_func, top_k=3).route == (
        "implicit"
    )
