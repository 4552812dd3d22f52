"""The route ``solver="auto"`` runs (``vivit.sources.route``, ``docs/math.rst``,
"Choosing the route"): the rules, the reasons, and the exactness of the result.

Eigenvalues of the implicit route are block Krylov's, within ``tol·λ_max`` of the
dense float64 reference (``EIGVAL_RTOL``, :ref:`math-test-tolerances`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.func_problems import FUNC_PROBLEMS
from tests.fixtures.reference import dense_ggn
from vivit import LowRankGGN
from vivit.errors import ProductsTooLargeError
from vivit.gram.memory import format_bytes
from vivit.memory.estimate import ESTIMATE_FACTOR, implicit_estimate, kept_bytes
from vivit.options import CurvatureOptions
from vivit.sources import route
from vivit.sources.route import ROUTE_TOP_K, RouteCosts, choose_route

PROBLEMS = {p.name: p for p in FUNC_PROBLEMS}
VOCAB, T, N = 200, 8, 3


class TokenModel(nn.Module):
    """Embedding → Linear to a vocabulary at every position: ``[N, VOCAB, T]``."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, x):
        return self.head(torch.tanh(self.embedding(x))).transpose(1, 2)


def _vocabulary_problem():
    torch.manual_seed(0)
    model = TokenModel().double()
    X = torch.randint(0, VOCAB, (N, T))
    y = torch.randint(0, VOCAB, (N, T))
    return model, nn.CrossEntropyLoss(), X, y


def test_large_vocabulary_runs_implicit_and_is_exact():
    """``K = C·T`` = 1600 columns per sample cost more than the products."""
    model, loss_func, X, y = _vocabulary_problem()
    costs = _costs(model, loss_func, X, y)
    assert costs.gram > costs.products
    ggn = LowRankGGN(model, loss_func, (X, y))
    assert ggn.route.name == "implicit" and ggn.engine == "implicit"
    assert f"{VOCAB * T} columns of V per sample" in ggn.route.reason
    evals, _ = ggn.eigh(top_k=3)
    assert ggn.solver_report().solver == "implicit"
    G = dense_ggn(model, loss_func, X, y)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


@pytest.mark.parametrize("name", ["transformer-ce-mean", "lstm-ce-sum"])
def test_few_columns_run_the_gram_route(name):
    s = PROBLEMS[name].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.route.name == "gram" and ggn.engine in ("backpack", "func")
    assert "columns of V per sample" in ggn.route.reason


def test_the_gram_route_probes_the_batch_once(monkeypatch):
    """The choice's memory estimate is the one the Gram route's check uses."""
    from vivit.memory import estimate

    s = PROBLEMS["transformer-ce-mean"].setup()
    calls, probe = [], estimate.batch_estimate

    def counted(*args):
        calls.append(args)
        return probe(*args)

    monkeypatch.setattr(route, "batch_estimate", counted)
    monkeypatch.setattr(estimate, "batch_estimate", counted)
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.route.name == "gram" and len(calls) == 1


def _estimates(s):
    """The Gram route's estimate and the implicit one of a problem's batch."""
    groups = [list(s.model.parameters())]
    choice = choose_route(
        s.model, s.loss_func, (s.inputs, s.targets), groups, CurvatureOptions()
    )
    products = implicit_estimate(
        s.model, s.inputs, groups, CurvatureOptions(), ROUTE_TOP_K
    )
    return choice.estimate, products


def _costs(model, loss_func, X, y):
    groups = [list(model.parameters())]
    choice = choose_route(model, loss_func, (X, y), groups, CurvatureOptions())
    size = sum(p.numel() for p in model.parameters())
    return RouteCosts.of(choice.estimate, len(X), size, ROUTE_TOP_K)


def _available(monkeypatch, bytes_):
    from vivit.memory import estimate

    monkeypatch.setattr(route, "available_bytes", lambda device: bytes_)
    monkeypatch.setattr(estimate, "available_bytes", lambda device: bytes_)


def test_memory_that_does_not_fit_runs_implicit(monkeypatch):
    """Gram factors beyond the memory, implicit products within it."""
    s = PROBLEMS["lstm-ce-mean"].setup()
    _, products = _estimates(s)
    # this small LSTM's factors are tiny: twice the products' bytes stand for many
    monkeypatch.setattr(route, "kept_bytes", lambda estimate: 2 * products.total)
    _available(monkeypatch, products.total)
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.route.name == "implicit"
    assert f"{format_bytes(products.total)} are available" in ggn.route.reason
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    evals, _ = ggn.eigh(top_k=2)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


def test_neither_route_fits_is_refused_up_front(monkeypatch):
    s = PROBLEMS["lstm-ce-mean"].setup()
    gram, products = _estimates(s)
    needed = min(products.total, kept_bytes(gram)) / ESTIMATE_FACTOR
    _available(monkeypatch, int(needed * 0.99))
    with pytest.raises(ProductsTooLargeError) as error:
        LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    message = str(error.value)
    for says in ("Neither exact route fits", "Krylov basis", "top_k", "subsampling"):
        assert says in message
    assert "chunk_size" in message and "mc_samples=1" in message


def test_implicit_products_that_do_not_fit_keep_the_gram_route(monkeypatch):
    """Cheaper by passes, but its products do not fit: the Gram route, saying so."""
    s = PROBLEMS["lstm-ce-mean"].setup()
    gram, products = _estimates(s)
    assert kept_bytes(gram) < products.total  # a small LSTM: basis of 184-vectors
    monkeypatch.setattr(route, "IMPLICIT_PASSES", -1e9)
    _available(monkeypatch, kept_bytes(gram))
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.route.name == "gram" and "Krylov basis" in ggn.route.reason


def test_solver_implicit_refuses_before_the_first_product(monkeypatch):
    from vivit.memory import estimate

    s = PROBLEMS["lstm-ce-mean"].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets), solver="implicit")
    passes = ggn._source.passes
    monkeypatch.setattr(estimate, "available_bytes", lambda device: 1)
    with pytest.raises(ProductsTooLargeError, match="Refused before the first"):
        ggn.eigh(top_k=2)
    assert ggn._source.passes == passes  # no product ran


def test_the_costs_add_up_and_are_reported():
    model, loss_func, X, y = _vocabulary_problem()
    costs = _costs(model, loss_func, X, y)
    assert costs.gram == costs.engine + costs.formation + costs.solve
    assert costs.products == costs.implicit + costs.basis
    assert min(costs.engine, costs.formation, costs.solve, costs.basis) > 0
    ggn = LowRankGGN(model, loss_func, (X, y))
    assert f"about {costs.gram:.0f} passes" in ggn.route.reason
    assert f"about {costs.products:.0f} for" in ggn.route.reason


def test_unestimable_model_runs_the_gram_route(monkeypatch):
    s = PROBLEMS["lstm-ce-mean"].setup()
    monkeypatch.setattr(route, "batch_estimate", lambda *args: None)
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.route.name == "gram" and "could not be estimated" in ggn.route.reason


@pytest.mark.parametrize(
    ("options", "name", "says"),
    [
        ({"solver": "implicit"}, "implicit", "solver='implicit' was asked for"),
        ({"solver": "dense"}, "gram", "solver='dense' was asked for"),
        ({"mc_samples": 1}, "gram", "Monte-Carlo sampling saves nothing"),
        ({"engine": "backpack"}, "gram", "runs no engine"),
        ({"gram_dtype": torch.float64}, "gram", "gram_dtype"),
    ],
)
def test_requests_the_implicit_route_cannot_honour(options, name, says):
    model, loss_func, X, y = _vocabulary_problem()
    if options.get("engine") == "backpack":
        model, loss_func = nn.Sequential(nn.Linear(4, 3)).double(), nn.MSELoss()
        X, y = torch.randn(N, 4).double(), torch.randn(N, 3).double()
    ggn = LowRankGGN(model, loss_func, (X, y), **options)
    assert ggn.route.name == name and says in ggn.route.reason


def test_a_loader_runs_the_gram_route():
    model, loss_func, X, y = _vocabulary_problem()
    ggn = LowRankGGN(model, loss_func, [(X[:2], y[:2]), (X[2:], y[2:])])
    assert ggn.route.name == "gram" and "data loader" in ggn.route.reason


def test_the_choice_compares_passes(monkeypatch):
    """One percent more or less implicit passes than the Gram route's flips it."""
    s = PROBLEMS["lstm-ce-mean"].setup()
    costs = _costs(s.model, s.loss_func, s.inputs, s.targets)
    even = costs.gram - costs.basis
    for scale, name in ((0.99, "implicit"), (1.01, "gram")):
        monkeypatch.setattr(route, "IMPLICIT_PASSES", scale * even)
        ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
        assert ggn.route.name == name, ggn.route.reason
