"""The route ``solver="auto"`` runs (``vivit.memory.route``, from the data by
``vivit.sources.route``; ``docs/math.rst``, "Choosing the route"): the rules for
a mini-batch and a data loader, the reasons, the refusals, and the exactness of
the result.

Eigenvalues of the implicit route are block Krylov's, within ``tol·λ_max`` of the
dense float64 reference (``EIGVAL_RTOL``, :ref:`math-test-tolerances`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.func_problems import FUNC_PROBLEMS, TOKEN_VOCAB, TokenModel
from tests.fixtures.implicit_basis import smallest_basis_memory
from tests.fixtures.reference import dense_ggn
from vivit import LowRankGGN
from vivit.errors import ProductsTooLargeError
from vivit.gram.memory import format_bytes
from vivit.memory import estimate
from vivit.memory import route as decision
from vivit.memory.estimate import ESTIMATE_FACTOR, implicit_estimate, kept_bytes
from vivit.memory.route import ROUTE_TOP_K, RouteCosts
from vivit.options import CurvatureOptions
from vivit.sources import route
from vivit.sources.route import choose_route

PROBLEMS = {p.name: p for p in FUNC_PROBLEMS}
VOCAB, T, N = TOKEN_VOCAB, 8, 3


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
    """The memory the run sees: the route choice, the implicit route's estimate
    and check, and a loader's budget on the Gram route."""
    import vivit.memory.budget

    monkeypatch.setattr(route, "available_bytes", lambda device: bytes_)
    monkeypatch.setattr(estimate, "available_bytes", lambda device: bytes_)
    monkeypatch.setattr(vivit.memory.budget, "available_bytes", lambda device: bytes_)


def test_memory_that_does_not_fit_runs_implicit(monkeypatch):
    """Gram factors beyond the memory, implicit products within it."""
    s = PROBLEMS["lstm-ce-mean"].setup()
    _, products = _estimates(s)
    # this small LSTM's factors are tiny: twice the products' bytes stand for many
    monkeypatch.setattr(decision, "kept_bytes", lambda estimate: 2 * products.total)
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
    monkeypatch.setattr(decision, "IMPLICIT_PASSES", -1e9)
    _available(monkeypatch, kept_bytes(gram))
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.route.name == "gram" and "Krylov basis" in ggn.route.reason


def test_solver_implicit_refuses_before_the_first_product(monkeypatch):
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


def test_the_choice_compares_passes(monkeypatch):
    """One percent more or less implicit passes than the Gram route's flips it."""
    s = PROBLEMS["lstm-ce-mean"].setup()
    costs = _costs(s.model, s.loss_func, s.inputs, s.targets)
    even = costs.gram - costs.basis
    for scale, name in ((0.99, "implicit"), (1.01, "gram")):
        monkeypatch.setattr(decision, "IMPLICIT_PASSES", scale * even)
        ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
        assert ggn.route.name == name, ggn.route.reason


# --------------------------------------------------------------------------------
# Data loaders: the Gram route's memory and work over all batches, the implicit
# route's per largest batch (docs/math.rst, "Choosing the route")
# --------------------------------------------------------------------------------


class Counting:
    """A loader with a length that counts the batches taken from it."""

    def __init__(self, batches):
        self.batches, self.taken = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.taken += 1
            yield batch


class Unsized(IterableDataset):
    """The batches of a list, as a dataset without ``len``."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


def _vocabulary_loader():
    """The vocabulary problem's model over 4 samples in batches of 2."""
    torch.manual_seed(0)
    model = TokenModel().double()
    X = torch.randint(0, VOCAB, (4, T))
    y = torch.randint(0, VOCAB, (4, T))
    return model, nn.CrossEntropyLoss(), X, y, [(X[:2], y[:2]), (X[2:], y[2:])]


def _classifier_loader():
    """An MLP classifier with 3 classes over 12 samples in 3 batches of 4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    loader = [(X[i : i + 4], y[i : i + 4]) for i in range(0, 12, 4)]
    return model, nn.CrossEntropyLoss(), X, y, loader


def _assert_exact(ggn, model, loss_func, X, y, top_k=3):
    """The leading eigenvalues of the loss on all samples, within ``tol·λ_max`` of
    the dense float64 reference (the iterative solvers' bound, ``EIGVAL_RTOL``)."""
    evals, _ = ggn.eigh(top_k=top_k)
    G = dense_ggn(model, loss_func, X, y)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


def test_a_classifier_loader_runs_the_gram_route():
    """``K = 3`` columns per sample over 12 samples: a few passes of the loader."""
    model, loss_func, X, y, loader = _classifier_loader()
    ggn = LowRankGGN(model, loss_func, Counting(loader))
    assert ggn.route.name == "gram" and ggn.engine in ("backpack", "func")
    reason = ggn.route.reason
    assert reason.startswith("a data loader of about 12 samples (3 batches of the ")
    assert "passes over its 3 batches (3 columns of V per sample" in reason
    _assert_exact(ggn, model, loss_func, X, y)


def test_a_list_of_batches_is_judged_on_every_batch_size():
    """A list's batch sizes are at hand: an uneven split counts all 12 samples
    and its largest batch, not the first batch's size times the count."""
    model, loss_func, X, y, _ = _classifier_loader()
    uneven = [(X[:1], y[:1]), (X[1:], y[1:])]
    ggn = LowRankGGN(model, loss_func, uneven)
    reason = ggn.route.reason
    assert reason.startswith("a list of 2 batches of 12 samples (the largest 11)")
    assert "passes over its 2 batches" in reason
    _assert_exact(ggn, model, loss_func, X, y)


def test_a_language_model_loader_runs_implicit_and_is_exact():
    """``K = C·T = 1600`` columns per sample: the Gram route's backward pass and
    Gram matrix over all 4 samples cost more passes than the implicit products,
    which pass over both batches; the result is the GGN of the loss on all."""
    model, loss_func, X, y, loader = _vocabulary_loader()
    ggn = LowRankGGN(model, loss_func, loader)
    assert ggn.route.name == "implicit" and ggn.engine == "implicit"
    assert "passes over its 2 batches (1600 columns of V per sample" in (
        ggn.route.reason
    )
    _assert_exact(ggn, model, loss_func, X, y)


def test_a_loader_whose_gram_factors_do_not_fit_runs_implicit(monkeypatch):
    """Cheaper by passes on the Gram route (made so), but the factors of all
    samples do not fit where one batch's products and the basis do."""
    model, loss_func, X, y, loader = _vocabulary_loader()
    monkeypatch.setattr(decision, "IMPLICIT_PASSES", 1e12)
    groups = [list(model.parameters())]
    products = implicit_estimate(
        model, X, groups, CurvatureOptions(), ROUTE_TOP_K, block=2
    )
    whole = estimate.gram_estimate(
        model,
        X[:1],
        estimate.Blocks.of_loader(4, 2, None),
        loss_func=loss_func,
        options=CurvatureOptions(),
        param_groups=groups,
        top_k=1,
    )
    available = products.total
    assert kept_bytes(whole) / ESTIMATE_FACTOR > available  # the set's factors
    assert LowRankGGN(model, loss_func, loader).route.name == "gram"  # memory aside
    _available(monkeypatch, available)
    ggn = LowRankGGN(model, loss_func, loader)
    assert ggn.route.name == "implicit"
    reason = ggn.route.reason
    assert "(1600 columns per sample, 4 samples) need at least" in reason
    assert f"but {format_bytes(available)} are available" in reason
    _assert_exact(ggn, model, loss_func, X, y)


def test_a_loader_that_fits_no_route_is_refused_before_its_pass(monkeypatch):
    """Neither the set's factors nor one batch's products fit: refused after
    reading the first batch (the probe), before a pass, with both estimates."""
    model, loss_func, _, _, loader = _vocabulary_loader()
    _available(monkeypatch, 1024)
    counting = Counting(loader)
    with pytest.raises(ProductsTooLargeError) as error:
        LowRankGGN(model, loss_func, counting)
    assert counting.taken == 1
    message = str(error.value)
    for says in (
        "Neither exact route fits into the 1.0 KiB available (a data loader",
        "the Gram route's factors of V need an estimated",
        "Krylov basis",
        "smaller batches",
        "StreamingGGN",
        "mc_samples=1",
    ):
        assert says in message, message
    assert "subsampling" not in message  # a loader takes none


def test_a_loader_without_length_is_judged_on_its_first_batch():
    model, loss_func, X, y, loader = _vocabulary_loader()
    ggn = LowRankGGN(model, loss_func, DataLoader(Unsized(loader), batch_size=None))
    assert ggn.route.name == "implicit"
    assert ggn.route.reason.startswith(
        "a data loader without len(), judged on its first batch of 2 samples"
    )
    _assert_exact(ggn, model, loss_func, X, y)


def test_an_iterator_keeps_the_gram_route():
    """A generator can be passed over once: no probe, no products."""
    model, loss_func, X, y, loader = _vocabulary_loader()
    ggn = LowRankGGN(model, loss_func, iter(loader))
    assert ggn.route.name == "gram" and "can be passed over once" in ggn.route.reason
    _assert_exact(ggn, model, loss_func, X, y)


def test_the_loader_choice_compares_passes_over_all_batches(monkeypatch):
    """The costs of a loader are those of all its samples, one pass overhead per
    batch: one percent more or less implicit passes flips the choice."""
    model, loss_func, _, _, loader = _classifier_loader()
    groups = [list(model.parameters())]
    whole = estimate.gram_estimate(
        model,
        loader[0][0][:1],
        estimate.Blocks.of_loader(12, 4, None),
        loss_func=loss_func,
        options=CurvatureOptions(),
        param_groups=groups,
        top_k=1,
    )
    size = sum(p.numel() for p in groups[0])
    costs = RouteCosts.of(whole, 12, size, ROUTE_TOP_K, batches=3)
    assert costs.batches == 3
    one_batch = RouteCosts.of(whole, 12, size, ROUTE_TOP_K)
    assert costs.engine < one_batch.engine  # overhead of 3 batches in a pass
    even = costs.gram - costs.basis
    for scale, name in ((0.99, "implicit"), (1.01, "gram")):
        monkeypatch.setattr(decision, "IMPLICIT_PASSES", scale * even)
        ggn = LowRankGGN(model, loss_func, loader)
        assert ggn.route.name == name, ggn.route.reason


def test_solver_implicit_checks_a_loader_before_its_first_product(monkeypatch):
    """The memory check and the basis cut of the implicit route work for a loader,
    with its largest batch (the second here): memory for the products of 3
    samples and ``k + 2·b`` basis columns cuts the basis to those; a byte less
    than the factor 1.5 allows is refused before the first product."""
    torch.manual_seed(0)
    model = TokenModel().double()
    X = torch.randint(0, VOCAB, (4, T))
    y = torch.randint(0, VOCAB, (4, T))
    loader, loss_func = [(X[:1], y[:1]), (X[1:], y[1:])], nn.CrossEntropyLoss()
    groups, top_k = [list(model.parameters())], 2
    default = implicit_estimate(
        model, X, groups, CurvatureOptions(), top_k, block=3, available=2**50
    )
    least, available = smallest_basis_memory(default, top_k, torch.float64)
    _available(monkeypatch, available)
    ggn = LowRankGGN(model, loss_func, loader, solver="implicit")
    evals, _ = ggn.eigh(top_k=top_k)
    report = ggn.solver_report()
    assert report.basis_columns == least < default.basis_columns
    G = dense_ggn(model, loss_func, X, y)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])

    _available(monkeypatch, int(available / ESTIMATE_FACTOR) - 1)
    ggn = LowRankGGN(model, loss_func, loader, solver="implicit")
    passes = ggn._source.passes
    with pytest.raises(ProductsTooLargeError, match="Refused before the first"):
        ggn.eigh(top_k=top_k)
    assert ggn._source.passes == passes


def test_max_batches_counts_the_batches_of_a_loader_without_length():
    """``max_batches`` bounds the batches the choice counts."""
    model, loss_func, X, y, loader = _vocabulary_loader()
    longer = DataLoader(Unsized(loader * 50), batch_size=None)
    ggn = LowRankGGN(model, loss_func, longer, max_batches=2)
    assert ggn.route.reason.startswith("a data loader of about 4 samples (2 batches")
    _assert_exact(ggn, model, loss_func, X, y)
