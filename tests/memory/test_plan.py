"""The plan of a request (``vivit.memory.plan``; ``docs/math.rst``, "Choosing the
route"): the route ``solver="auto"`` runs for a mini-batch and a loader, the
reasons, the refusals, the estimate's same decision, and the exactness of the result.

Eigenvalues of the implicit route are block Krylov's, within ``tol·λ_max`` of the
dense float64 reference (``EIGVAL_RTOL``, :ref:`math-test-tolerances`).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import vivit.memory.plan
import vivit.memory.profile
from benchmarks.problems import PROBLEMS as BENCHMARKS
from benchmarks.problems import make_problem
from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.func_problems import FUNC_PROBLEMS, TOKEN_VOCAB, TokenModel
from tests.fixtures.memory import available, smallest_basis_memory
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn
from vivit import LowRankGGN
from vivit.errors import InvalidArgumentError, ProductsTooLargeError
from vivit.gram.memory import format_bytes
from vivit.memory import Plan, estimate_data_set_memory, estimate_memory, largest_batch
from vivit.memory.plan import ESTIMATE_FACTOR, RECORDING_FRACTION, ROUTE_TOP_K

PROBLEMS = {p.name: p for p in FUNC_PROBLEMS}
VOCAB, T, N = TOKEN_VOCAB, 8, 3
GIB = 2**30


def _vocabulary_problem(samples=N):
    torch.manual_seed(0)
    model = TokenModel().double()
    X = torch.randint(0, VOCAB, (samples, T))
    y = torch.randint(0, VOCAB, (samples, T))
    return model, nn.CrossEntropyLoss(), X, y


def _classifier(samples=12):
    torch.manual_seed(0)
    model = mlp(5, 4, 3).double()
    X, y = torch.randn(samples, 5, dtype=torch.float64), torch.randint(0, 3, (samples,))
    return model, nn.CrossEntropyLoss(), X, y


def _assert_exact(ggn, model, loss_func, X, y, top_k=3):
    evals, _ = ggn.eigh(top_k=top_k)
    G = dense_ggn(model, loss_func, X, y)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


def _costs(monkeypatch, gram, implicit):
    """The plan's costs replaced: the Gram route's and the implicit route's."""
    costs = {"gram": gram, "passes": gram, "solve": 0.0, "implicit": implicit}
    monkeypatch.setattr(
        Plan, "costs", lambda self, measure=True: costs | {"measured": measure}
    )
    monkeypatch.setattr(Plan, "_gram_stopped", lambda self: None)  # measured whole


def test_large_vocabulary_runs_implicit_and_is_exact():
    """``K = C·T`` = 1600 columns per sample cost more than the products.

    The Gram route's measurement stops there: its cost when stopped, of a pass
    over fewer samples, is above the implicit route's and below its passes'.
    """
    model, loss_func, X, y = _vocabulary_problem()
    ggn = LowRankGGN(model, loss_func, (X, y))
    assert ggn.plan.route == "implicit" and ggn.engine == "implicit"
    assert "stopped there" in ggn.plan.reason
    assert "gram" not in ggn.plan.profile.__dict__  # not measured whole
    stopped = float(re.search(r"more than (\S+) multiply-adds", ggn.plan.reason)[1])
    costs = ggn.plan.costs()  # now measured whole
    assert costs["gram"] > costs["implicit"] and costs["measured"]
    rounding = 0.05  # the reason's two digits
    assert costs["implicit"] < stopped * (1 + rounding)
    assert stopped * (1 - rounding) <= costs["passes"]
    evals, _ = ggn.eigh(top_k=3)
    assert ggn.solver_report().solver == "ggn_krylov"
    G = dense_ggn(model, loss_func, X, y)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


def test_a_stopped_measurement_is_kept_for_the_same_request(monkeypatch):
    """The same request again gets the stop without measuring; a larger one
    (a larger budget) measures again."""
    model, loss_func, X, y = _vocabulary_problem()
    first = LowRankGGN(model, loss_func, (X, y)).plan
    measured = []
    profile_type = type(first.profile)
    original = profile_type._gram_profile

    def counted(self, *args):
        measured.append(args)
        return original(self, *args)

    monkeypatch.setattr(profile_type, "_gram_profile", counted)
    again = LowRankGGN(model, loss_func, (X, y)).plan
    assert again.profile is first.profile and not measured
    assert again.route == "implicit" and again.reason == first.reason
    LowRankGGN(model, loss_func, (torch.cat([X, X]), torch.cat([y, y])))
    assert measured  # a pass over more samples may cost more: measured again


@pytest.mark.parametrize("name", ["transformer-ce-mean", "lstm-ce-sum"])
def test_few_columns_run_the_gram_route(name):
    s = PROBLEMS[name].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.plan.route == "gram" and ggn.engine in ("backpack", "func")
    assert "multiply-adds" in ggn.plan.reason


def test_the_gram_route_does_not_measure_the_implicit_one_it_need_not(monkeypatch):
    """Where the Gram route costs less than the implicit products could (a plain
    forward and backward pass a vector), those are not measured."""
    model, loss_func, X, y = _classifier()
    ggn = LowRankGGN(model, loss_func, (X, y))
    assert ggn.plan.route == "gram" and "at least" in ggn.plan.reason
    assert "implicit" not in ggn.plan.profile.__dict__  # a cached property, unset


def test_a_request_is_measured_once_per_shape(monkeypatch):
    """A training loop's mini-batches of one shape share one profile."""
    made = []
    profile = vivit.memory.profile.Profile

    def counted(*args, **kwargs):
        made.append(1)
        return profile(*args, **kwargs)

    monkeypatch.setattr(vivit.memory.profile, "Profile", counted)
    model, loss_func, X, y = _classifier()
    for start in (0, 4):
        LowRankGGN(model, loss_func, (X[start : start + 4], y[start : start + 4]))
    assert len(made) == 1
    LowRankGGN(model, loss_func, (X[:4], y[:4]), mc_samples=1)  # another request
    assert len(made) == 2


def test_memory_that_does_not_fit_runs_implicit(monkeypatch):
    """Gram factors beyond the memory, implicit products within it."""
    monkeypatch.setattr(Plan, "_gram_stopped", lambda self: None)  # measured whole
    model, loss_func, X, y = _vocabulary_problem()
    products = estimate_memory(model, X, N, loss_func=loss_func, route="implicit")
    gram = estimate_memory(model, X, N, loss_func=loss_func, solver="factor_krylov")
    assert gram.passes > ESTIMATE_FACTOR * products.total
    available(monkeypatch, products.total)
    ggn = LowRankGGN(model, loss_func, (X, y))
    assert ggn.plan.route == "implicit"
    assert f"{format_bytes(products.total)} are available" in ggn.plan.reason
    _assert_exact(ggn, model, loss_func, X, y, top_k=2)


def test_neither_route_fits_is_refused_up_front(monkeypatch):
    s = PROBLEMS["lstm-ce-mean"].setup()
    args = (s.model, s.inputs, len(s.inputs))
    products = estimate_memory(*args, loss_func=s.loss_func, route="implicit")
    gram = estimate_memory(*args, loss_func=s.loss_func, solver="factor_krylov")
    needed = min(products.total, gram.passes) / ESTIMATE_FACTOR
    available(monkeypatch, int(needed * 0.99))
    with pytest.raises(ProductsTooLargeError) as error:
        LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    message = str(error.value)
    for says in ("Neither exact route fits", "Krylov basis", "top_k", "subsampling"):
        assert says in message
    assert "chunk_size" in message and "mc_samples=1" in message


def test_implicit_products_that_do_not_fit_keep_the_gram_route(monkeypatch):
    """Cheaper by work, but its products do not fit: the Gram route, saying so."""
    s = PROBLEMS["lstm-ce-mean"].setup()
    args = (s.model, s.inputs, len(s.inputs))
    products = estimate_memory(*args, loss_func=s.loss_func, route="implicit")
    gram = estimate_memory(*args, loss_func=s.loss_func, solver="factor_krylov")
    assert gram.passes < products.total  # a small LSTM: a basis of 184-vectors
    _costs(monkeypatch, gram=1.0, implicit=0.0)
    memory = int(-(-gram.passes // ESTIMATE_FACTOR))  # the Gram route's just fits
    size = sum(p.numel() for p in s.model.parameters())
    _, least = smallest_basis_memory(products, ROUTE_TOP_K, torch.float64, size)
    assert least > ESTIMATE_FACTOR * memory  # not even the smallest basis does
    available(monkeypatch, memory)
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.plan.route == "gram" and "Krylov basis" in ggn.plan.reason


def test_solver_implicit_refuses_before_the_first_product(monkeypatch):
    s = PROBLEMS["lstm-ce-mean"].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets), route="implicit")
    passes = ggn._source.passes
    available(monkeypatch, 1)
    with pytest.raises(ProductsTooLargeError, match="Refused before the first"):
        ggn.eigh(top_k=2)
    assert ggn._source.passes == passes  # no product ran


def test_the_costs_add_up_and_are_reported(monkeypatch):
    monkeypatch.setattr(Plan, "_gram_stopped", lambda self: None)  # measured whole
    model, loss_func, X, y = _vocabulary_problem()
    ggn = LowRankGGN(model, loss_func, (X, y))
    costs = ggn.plan.costs()
    assert costs["gram"] == costs["passes"] + costs["solve"]
    assert min(costs["passes"], costs["solve"], costs["implicit"]) > 0
    assert f"about {costs['gram']:.2g} multiply-adds" in ggn.plan.reason
    assert f"route {costs['implicit']:.2g} for {ROUTE_TOP_K}" in ggn.plan.reason


def test_an_unmeasurable_request_runs_the_gram_route(monkeypatch):
    monkeypatch.setattr(vivit.memory.request, "profile", lambda *a, **k: None)
    s = PROBLEMS["lstm-ce-mean"].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
    assert ggn.plan.route == "gram" and "could not be measured" in ggn.plan.reason


@pytest.mark.parametrize(
    ("options", "name", "says"),
    [
        ({"route": "implicit"}, "implicit", "route='implicit' was asked for"),
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
    assert ggn.plan.route == name and says in ggn.plan.reason


def test_the_choice_compares_the_costs(monkeypatch):
    """A little more or less implicit work than the Gram route's flips it."""
    s = PROBLEMS["lstm-ce-mean"].setup()
    for implicit, name in ((0.99, "implicit"), (1.01, "gram")):
        _costs(monkeypatch, gram=1.0, implicit=implicit)
        ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets))
        assert ggn.plan.route == name, ggn.plan.reason


# --------------------------------------------------------------------------------
# Data loaders: the Gram route's memory and work over all batches, the implicit
# route's per largest batch
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
    model, loss_func, X, y = _vocabulary_problem(4)
    return model, loss_func, X, y, [(X[:2], y[:2]), (X[2:], y[2:])]


def _classifier_loader():
    model, loss_func, X, y = _classifier()
    return model, loss_func, X, y, [(X[i : i + 4], y[i : i + 4]) for i in (0, 4, 8)]


def test_a_classifier_loader_runs_the_gram_route():
    model, loss_func, X, y, loader = _classifier_loader()
    ggn = LowRankGGN(model, loss_func, Counting(loader))
    assert ggn.plan.route == "gram" and ggn.engine in ("backpack", "func")
    assert ggn.plan.reason.startswith(
        "a data loader of about 12 samples (3 batches of the first batch's 4): "
    )
    _assert_exact(ggn, model, loss_func, X, y)


def test_a_list_of_batches_is_judged_on_every_batch_size():
    """A list's batch sizes are at hand: an uneven split counts all 12 samples."""
    model, loss_func, X, y, _ = _classifier_loader()
    ggn = LowRankGGN(model, loss_func, [(X[:1], y[:1]), (X[1:], y[1:])])
    assert ggn.plan.sizes.part == 11 and ggn.plan.sizes.samples == 12
    assert ggn.plan.reason.startswith(
        "a list of 2 batches of 12 samples (the largest 11)"
    )
    _assert_exact(ggn, model, loss_func, X, y)


def test_a_language_model_loader_runs_implicit_and_is_exact():
    model, loss_func, X, y, loader = _vocabulary_loader()
    ggn = LowRankGGN(model, loss_func, loader)
    assert ggn.plan.route == "implicit" and ggn.engine == "implicit"
    _assert_exact(ggn, model, loss_func, X, y)


def test_a_loader_whose_gram_factors_do_not_fit_runs_implicit(monkeypatch):
    """Cheaper on the Gram route (made so), but the factors of all samples do
    not fit where one batch's products and the basis do."""
    model, loss_func, X, y, loader = _vocabulary_loader()
    _costs(monkeypatch, gram=0.0, implicit=1.0)
    assert LowRankGGN(model, loss_func, loader).plan.route == "gram"  # memory aside
    products = estimate_data_set_memory(
        model, X, 4, 2, loss_func=loss_func, route="implicit"
    )
    available(monkeypatch, products.total)
    ggn = LowRankGGN(model, loss_func, loader)
    assert ggn.plan.route == "implicit"
    assert "need at least" in ggn.plan.reason
    assert f"but {format_bytes(products.total)} are available" in ggn.plan.reason
    _assert_exact(ggn, model, loss_func, X, y)


def test_a_loader_that_fits_no_route_is_refused_before_its_pass(monkeypatch):
    """Neither fits: refused after reading the first batch, before a pass."""
    model, loss_func, _, _, loader = _vocabulary_loader()
    available(monkeypatch, 1024)
    counting = Counting(loader)
    with pytest.raises(ProductsTooLargeError) as error:
        LowRankGGN(model, loss_func, counting)
    assert counting.taken == 1
    message = str(error.value)
    for says in ("Neither exact route fits into the 1.0 KiB available", "Krylov",
                 "smaller batches", "StreamingGGN", "mc_samples=1"):  # fmt: skip
        assert says in message, message


def test_a_loader_without_length_is_judged_on_its_first_batch():
    model, loss_func, X, y, loader = _vocabulary_loader()
    ggn = LowRankGGN(model, loss_func, DataLoader(Unsized(loader), batch_size=None))
    assert ggn.plan.route == "implicit"
    assert ggn.plan.reason.startswith(
        "a data loader without len(), judged on its first batch of 2 samples"
    )
    _assert_exact(ggn, model, loss_func, X, y)


def test_an_iterator_keeps_the_gram_route():
    """A generator can be passed over once: no products."""
    model, loss_func, X, y, loader = _vocabulary_loader()
    ggn = LowRankGGN(model, loss_func, iter(loader))
    assert ggn.plan.route == "gram" and "can be passed over once" in ggn.plan.reason
    _assert_exact(ggn, model, loss_func, X, y)


def test_solver_implicit_checks_a_loader_before_its_first_product(monkeypatch):
    """The basis cut for a loader follows its largest batch (the second here);
    a byte less than the factor 1.5 allows is refused before the first product."""
    model, loss_func, X, y = _vocabulary_problem(4)
    loader, top_k = [(X[:1], y[:1]), (X[1:], y[1:])], 2
    default = estimate_memory(
        model, X, 3, loss_func=loss_func, route="implicit", top_k=top_k
    )
    params = sum(p.numel() for p in model.parameters())
    least, bytes_ = smallest_basis_memory(default, top_k, torch.float64, params)
    available(monkeypatch, bytes_)
    ggn = LowRankGGN(model, loss_func, loader, route="implicit")
    evals, _ = ggn.eigh(top_k=top_k)
    assert ggn.solver_report().basis_columns == least < default.basis_columns
    G = dense_ggn(model, loss_func, X, y)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])
    available(monkeypatch, int(bytes_ / ESTIMATE_FACTOR) - 1)
    ggn = LowRankGGN(model, loss_func, loader, route="implicit")
    passes = ggn._source.passes
    with pytest.raises(ProductsTooLargeError, match="Refused before the first"):
        ggn.eigh(top_k=top_k)
    assert ggn._source.passes == passes


def test_max_batches_counts_the_batches_of_a_loader_without_length():
    model, loss_func, X, y, loader = _vocabulary_loader()
    longer = DataLoader(Unsized(loader * 50), batch_size=None)
    ggn = LowRankGGN(model, loss_func, longer, max_batches=2)
    assert ggn.plan.reason.startswith("a data loader of about 4 samples (2 batches")
    _assert_exact(ggn, model, loss_func, X, y)


# --------------------------------------------------------------------------------
# The estimate of a request reads the same plan
# --------------------------------------------------------------------------------


def _gpt2():
    return make_problem("gpt2-2l-64-v128", 4, 0, torch.device("cpu"))


def _func_problem(name):
    s = PROBLEMS[name].setup()
    return s.model, s.loss_func, s.inputs, s.targets


MODELS = {
    "mlp-classifier": (_classifier, "gram"),
    "vocabulary": (_vocabulary_problem, "implicit"),
    "transformer-ce-mean": (lambda: _func_problem("transformer-ce-mean"), "gram"),
    "lstm-ce-sum": (lambda: _func_problem("lstm-ce-sum"), "gram"),
    "gpt2-2l-64-v128": (_gpt2, "implicit"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_estimate_takes_the_runs_route(monkeypatch, name):
    """Route and reason of ``estimate_memory`` are ``LowRankGGN(...).plan``'s."""
    available(monkeypatch, 64 * GIB)
    build, expected = MODELS[name]
    model, loss_func, X, y = build()
    estimate = estimate_memory(model, X[:1], len(X), loss_func=loss_func)
    run = LowRankGGN(model, loss_func, (X, y)).plan
    assert (estimate.route, estimate.reason) == (run.route, run.reason)
    assert run.route == expected and estimate.total > 0


def test_the_estimate_of_a_loader_takes_the_runs_route(monkeypatch):
    available(monkeypatch, 64 * GIB)
    for build, expected in (MODELS["mlp-classifier"], MODELS["vocabulary"]):
        model, loss_func, X, y = build()
        loader = [(X[i : i + 2], y[i : i + 2]) for i in range(0, len(X) - 1, 2)]
        samples = sum(len(b[1]) for b in loader)
        estimate = estimate_data_set_memory(
            model, X[:1], samples, 2, loss_func=loss_func
        )
        run = LowRankGGN(model, loss_func, loader).plan
        assert estimate.route == run.route == expected


def test_memory_decides_for_the_estimate_as_for_the_run(monkeypatch):
    monkeypatch.setattr(Plan, "_gram_stopped", lambda self: None)  # measured whole
    model, loss_func, X, y = _vocabulary_problem()
    products = estimate_memory(model, X, N, loss_func=loss_func, route="implicit")
    available(monkeypatch, products.total)
    estimate = estimate_memory(model, X[:1], N, loss_func=loss_func)
    run = LowRankGGN(model, loss_func, (X, y)).plan
    assert estimate.route == run.route == "implicit"
    assert "are available" in run.reason and estimate.reason == run.reason
    available(monkeypatch, products.total // 4)  # neither route fits
    with pytest.raises(ProductsTooLargeError, match="Neither exact route fits"):
        estimate_memory(model, X[:1], N, loss_func=loss_func)
    with pytest.raises(ProductsTooLargeError, match="Neither exact route fits"):
        LowRankGGN(model, loss_func, (X, y))


def test_gpt2_with_its_vocabulary_is_estimated_on_the_implicit_route(monkeypatch):
    """``gpt2-4l-128-v50257`` at ``N = 8``: the Gram route's factors of
    ``N·C·T`` = 25.7 M columns are too large to measure and to fit into 24 GiB;
    the implicit route's estimate, its basis cut to those 24 GiB, fits."""
    available(monkeypatch, 24 * GIB)
    problem = BENCHMARKS["gpt2-4l-128-v50257"]
    torch.manual_seed(0)
    model = problem.build()
    X = torch.randint(0, problem.num_classes, (1, *problem.input_shape))
    estimate = estimate_memory(model, X, 8, loss_func=nn.CrossEntropyLoss())
    assert estimate.route == "implicit" and estimate.total <= 24 * GIB
    assert "(25731584 columns of V) need at least" in estimate.reason
    assert estimate.solver == "ggn_krylov" and estimate.engine == "implicit"
    assert 16 <= estimate.basis_columns <= estimate.default_columns == 64
    gram = estimate_memory(model, X, 8, loss_func=nn.CrossEntropyLoss(), solver="dense")
    assert gram.route == "gram" and gram.total > 10_000 * GIB


def test_solver_implicit_by_name_gives_the_implicit_estimate():
    model, loss_func, X, _ = _classifier()
    estimate = estimate_memory(
        model, X[:1], 64, loss_func=loss_func, top_k=3, route="implicit"
    )
    assert estimate.route == "implicit"
    assert estimate.reason == "route='implicit' was asked for"
    with pytest.raises(InvalidArgumentError, match="pass top_k"):
        estimate_memory(model, X[:1], 64, top_k=None, route="implicit")


def test_the_implicit_estimate_of_a_loader_grows_only_by_recordings_that_fit(
    monkeypatch,
):
    """Its batches' recordings take at most ``RECORDING_FRACTION`` of the memory
    (``docs/math.rst``, "Linearized products"); the rest does not grow."""
    model, loss_func, X, _ = _vocabulary_problem()

    def estimate(samples, **options):
        return estimate_data_set_memory(
            model, X[:1], samples, 2, loss_func=loss_func, route="implicit", **options
        )

    bound = 200 * 2**20
    available(monkeypatch, int(bound / RECORDING_FRACTION))
    small, large = estimate(4), estimate(4000)
    assert small.solve == large.solve
    assert small.passes < large.passes <= small.passes + bound
    assert large.passes > small.passes + bound / 2  # as many as fit
    monkeypatch.setattr(vivit.memory.plan, "RECORDING_FRACTION", 0.0)
    small, large = estimate(4), estimate(4000)
    assert small.total == large.total  # one batch's pass and the solve
    assert estimate(4000, chunk_size=1).passes < small.passes


def test_all_eigenvalues_on_the_implicit_route_are_refused():
    model, loss_func, X, _ = _vocabulary_problem()
    with pytest.raises(InvalidArgumentError, match="takes the implicit route") as e:
        estimate_memory(model, X[:1], 4, loss_func=loss_func, top_k=None)
    assert "solver='dense'" in str(e.value)
    assert estimate_memory(model, X[:1], 4, top_k=None, solver="dense").route == "gram"


def test_largest_batch_under_auto_is_that_of_some_exact_route():
    """Under "auto" a batch fits where either route's estimate does."""
    model, loss_func, X, _ = _vocabulary_problem()
    search = {"loss_func": loss_func, "top_k": 3, "count_resident": False}
    budget = 64 * 2**20
    auto = largest_batch(model, X[:1], budget, **search)
    implicit = largest_batch(model, X[:1], budget, route="implicit", **search)
    gram = largest_batch(model, X[:1], budget, solver="factor_krylov", **search)
    assert auto == implicit > 100 * max(gram, 1)
    # held to the Gram route by an option the implicit route cannot honour
    mc = {"mc_samples": 1, "mc_per": "sequence"}
    held = largest_batch(model, X[:1], budget, **mc, **search)
    assert held > 0
    estimate = estimate_memory(model, X[:1], held, loss_func=loss_func, top_k=3, **mc)
    assert estimate.route == "gram" and estimate.total <= budget


def test_groups_of_equal_length_are_measured_on_the_implicit_route():
    """The largest group is found by its parameters' count, not by comparing groups
    (``list.index`` compared tensors elementwise and failed on two groups of two)."""
    torch.manual_seed(0)
    model = mlp(5, 4, 8, 3).double()
    first, _, second = (layer for layer in model if isinstance(layer, nn.Linear))
    groups = [list(first.parameters()), list(second.parameters())]
    X = torch.randn(1, 5, dtype=torch.float64)
    estimate = estimate_memory(
        model, X, 4, loss_func=nn.CrossEntropyLoss(), param_groups=groups,
        route="implicit",
    )  # fmt: skip
    assert estimate.route == "implicit" and estimate.total > 0
