"""StreamingGGN: leading eigenpairs over a loader without stored factors.

Against LowRankGGN over the same loader (stored factors) and the dense float64
reference of the concatenated batch. The Krylov solver stops at a relative
residual of ``1e-12`` (float64 default), so eigenvalues agree to ``1e-10·λ_max``
and eigenvectors are checked by their residuals with the dense GGN
(``tests/fixtures/checks.py``); products with the Gram matrix are exact sums in another
order, ``1e-10`` relative.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import vivit.options
from tests.fixtures.checks import (
    DIRECTION_REL,
    EIGVEC_PRODUCT_REL,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    layer_groups,
)
from tests.fixtures.problems import prepare, select
from tests.fixtures.reference import dense_ggn, dense_gradient
from tests.sources.test_data_loader import split
from vivit import (
    GradientContextError,
    GroupIndexError,
    InvalidArgumentError,
    LowRankGGN,
    ModelChangedError,
    NondeterministicDataError,
    RandomForwardWarning,
    SolverNotConvergedError,
    StreamingGGN,
)

REL = EIGVEC_PRODUCT_REL
PROBLEMS = [
    *select(architecture="mlp_tanh", loss="ce", reduction="mean"),
    *select(architecture="cnn", loss="mse", reduction="sum"),
    *select(architecture="residual", loss="ce", reduction="sum"),
]


@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_streaming_equals_stored_factors_and_reference(problem, engine):
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [1, 2, X.shape[0] - 3])
    streaming = StreamingGGN(model, loss_func, batches, engine=engine)
    stored = LowRankGGN(model, loss_func, batches, engine=engine)
    assert streaming.passes == 1
    assert_rel(streaming.loss, stored.loss, REL)
    gradient = torch.cat([g.flatten() for g in streaming.gradient()])
    assert_rel(gradient, dense_gradient(model, loss_func, X, y), REL)
    U = torch.randn(streaming.num_rows, 3, dtype=torch.float64)
    assert_rel(streaming.gram_matmul(U), stored.gram() @ U, REL)
    assert streaming.passes == 3  # two per product

    G = dense_ggn(model, loss_func, X, y)
    calls = []
    products = streaming._source.group(0).products  # what the solver calls
    matmul = products.gram_matmul
    products.gram_matmul = lambda *args: calls.append(1) or matmul(*args)
    evals, evecs = streaming.eigh(top_k=3)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), REL)
    report = streaming.solver_report()
    assert_eigenpairs(evals, evecs, G, stored.gram().shape[0], report.tolerance)
    assert report.tolerance == report.requested_tolerance  # no rounding floor
    assert report.solver == "factor_krylov" and report.converged
    # two passes per product with G̃, one for the eigenvectors
    assert streaming.passes == 3 + 2 * len(calls) + 1


def test_monte_carlo_draws_the_same_samples_as_stored_factors():
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="sum")
    model, loss_func, X, y = prepare(problem, torch.float64)
    data = DataLoader(TensorDataset(X, y), batch_size=2)

    def generator():
        return torch.Generator().manual_seed(5)

    streaming = StreamingGGN(
        model, loss_func, data, mc_samples=2, generator=generator()
    )
    stored = LowRankGGN(model, loss_func, data, mc_samples=2, generator=generator())
    U = torch.randn(streaming.num_rows, 2, dtype=torch.float64)
    assert_rel(streaming.gram_matmul(U), stored.gram() @ U, REL)
    assert_rel(streaming.eigh(top_k=2)[0], stored.eigh(top_k=2)[0], REL)


def test_parameter_groups_and_float32_model():
    (problem,) = select(architecture="cnn", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float32)
    groups = layer_groups(model)
    batches = split(X, y, [3, 1])
    streaming = StreamingGGN(
        model, loss_func, batches, param_groups=groups, gram_dtype=torch.float64
    )
    stored = LowRankGGN(
        model, loss_func, batches, param_groups=groups, gram_dtype=torch.float64
    )
    for index in range(len(groups)):
        evals, evecs = streaming.eigh(top_k=2, group=index)
        assert evals.dtype == torch.float64 and evecs[0].dtype == torch.float32
        # the same float32 factors, float64 products: agree to float64 rounding
        assert_rel(evals, stored.eigh(top_k=2, group=index, solver="dense")[0], REL)


class Shuffled:
    """Re-iterable, but every pass yields the batches in another order."""

    def __init__(self, batches):
        self.batches, self.calls = batches, 0

    def __iter__(self):
        self.calls += 1
        return iter(self.batches[self.calls % 2 :] + self.batches[: self.calls % 2])


class Augmented(Shuffled):
    def __iter__(self):
        self.calls += 1
        noise = 1e-12 * self.calls
        return iter([(X + noise, y) for X, y in self.batches])


class Shrinking(Shuffled):
    def __iter__(self):
        self.calls += 1
        return iter(self.batches[: len(self.batches) - self.calls + 1])


def test_nondeterministic_loaders_are_detected():
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [2, 1, 2])
    with pytest.raises(NondeterministicDataError, match="Batch 0 .* pass 2"):
        StreamingGGN(model, loss_func, Shuffled(batches)).eigh(top_k=1)
    with pytest.raises(NondeterministicDataError, match="Batch 0 .* random"):
        StreamingGGN(model, loss_func, Augmented(batches)).eigh(top_k=1)
    with pytest.raises(NondeterministicDataError, match="2 batches in pass 2 but 3"):
        StreamingGGN(model, loss_func, Shrinking(batches)).eigh(top_k=1)


def test_misuse():
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    with pytest.raises(InvalidArgumentError, match="iterator or generator"):
        StreamingGGN(model, loss_func, ((X, y) for _ in range(2)))
    with pytest.raises(InvalidArgumentError, match="yielded no batch"):
        StreamingGGN(model, loss_func, [])
    with pytest.raises(InvalidArgumentError, match="Batch 1 of the data loader"):
        StreamingGGN(model, loss_func, [(X, y), (X.float(), y)])
    ggn = StreamingGGN(model, loss_func, (X, y))  # one batch: a loader of one
    with pytest.raises(InvalidArgumentError, match="pass top_k"):
        ggn.eigh(top_k=None)
    for tol in [1.0, 5.0, float("inf"), True, "1e-3"]:  # ≥ 1 accepts any Ritz pair
        with pytest.raises(InvalidArgumentError, match="tol must be a number"):
            ggn.eigh(top_k=2, tol=tol)
        with pytest.raises(InvalidArgumentError, match="tol must be a number"):
            ggn.directional_derivatives(top_k=2, tol=tol)
    for seed in [1.5, 2**70]:
        with pytest.raises(InvalidArgumentError, match="seed must be an integer"):
            ggn.eigh(top_k=2, seed=seed)
    # seed=None: the constructor's solver_seed (0), as LowRankGGN's calls
    # the same solve with the same seed, kept or repeated: bit for bit
    assert torch.equal(ggn.eigh(top_k=2, seed=None)[0], ggn.eigh(2, seed=0)[0])
    for group in [1, False]:  # a bool is not taken for a group index
        with pytest.raises(GroupIndexError):
            ggn.eigh(top_k=1, group=group)
    with (
        torch.inference_mode(),
        pytest.raises(GradientContextError, match="inside torch.inference_mode"),
    ):
        ggn.eigh(top_k=1)  # a later pass, not only the construction
    rows = ggn.num_rows
    for vectors in [
        torch.randn(rows + 1, 2, dtype=torch.float64),  # too many rows
        torch.randn(rows, 2),  # float32 for float64 products
        torch.randn(rows, 2, 1, dtype=torch.float64),
        [[0.0] * 2] * rows,
    ]:
        with pytest.raises(InvalidArgumentError, match="vectors must be"):
            ggn.gram_matmul(vectors)


def test_shuffling_with_the_global_random_state_repeats_in_every_pass():
    """Every pass runs with the caller's random state forked: the same order."""
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    shuffled = DataLoader(TensorDataset(X, y), batch_size=2, shuffle=True)
    streaming = StreamingGGN(model, loss_func, shuffled)
    stored = LowRankGGN(model, loss_func, (X, y))
    assert_rel(streaming.eigh(top_k=2)[0], stored.eigh(top_k=2)[0], REL)


def test_every_pass_draws_the_dropout_masks_of_the_first():
    """Dropout in training mode: every pass starts from the construction's random
    state, so random numbers the caller draws between calls change nothing, and
    the curvature is that of the first pass's masks, as with stored factors over
    the same loader (whose memory check between the batches draws nothing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8),
        torch.nn.Dropout(0.5),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 3),
    ).double()
    X, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    loss_func = torch.nn.CrossEntropyLoss()

    def top(cls, seed, draw_between):
        torch.manual_seed(seed)
        with pytest.warns(RandomForwardWarning):
            ggn = cls(model, loss_func, [(X[:5], y[:5]), (X[5:], y[5:])])
        if draw_between:
            torch.randn(100)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RandomForwardWarning)
            return ggn.eigh(top_k=3)[0]

    streamed = top(StreamingGGN, 1, draw_between=True)
    assert_rel(streamed, top(StreamingGGN, 1, draw_between=False), REL)
    assert_rel(streamed, top(LowRankGGN, 1, draw_between=True), REL)
    other_masks = top(LowRankGGN, 2, draw_between=False)
    assert (streamed - other_masks).abs().max() > 1e-3 * streamed.max()


def test_a_changed_model_is_refused():
    """A pass after the parameters changed would mix two models: refused, naming
    the pass; what was computed before stays that of the construction's values."""
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    streaming = StreamingGGN(model, loss_func, split(X, y, [2, 3]))
    evals, _ = streaming.eigh(top_k=2)
    passes = streaming.passes
    original = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        next(model.parameters()).mul_(2.0)
    with pytest.raises(ModelChangedError, match=f"before pass {passes + 1}"):
        streaming.eigh(top_k=3)
    with pytest.raises(ModelChangedError):
        streaming.directional_derivatives(top_k=2)
    assert torch.equal(streaming.eigh(top_k=2)[0], evals)  # kept, no pass
    with torch.no_grad():
        for p, value in zip(model.parameters(), original, strict=True):
            p.copy_(value)
    stored = LowRankGGN(model, loss_func, (X, y))
    assert_rel(streaming.eigh(top_k=3)[0], stored.eigh(top_k=3)[0], REL)


@pytest.mark.parametrize("problem", PROBLEMS[:2], ids=str)
def test_directional_derivatives_and_newton_steps(problem):
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [2, X.shape[0] - 2])
    streaming = StreamingGGN(model, loss_func, batches)
    stored = LowRankGGN(model, loss_func, batches, solver="dense")
    d = streaming.directional_derivatives(top_k=3)
    d_s = stored.directional_derivatives(top_k=3)
    assert d.gammas.shape == (X.shape[0], 3)
    # γ changes sign with e_k; iterative eigenvectors to ~tol·λ_max/gap
    assert_rel(d.evals, d_s.evals, REL)
    assert_rel(d.gammas.abs(), d_s.gammas.abs(), DIRECTION_REL)
    assert_rel(d.lambdas, d_s.lambdas, DIRECTION_REL)
    assert_rel(d.gamma_bar.abs(), d_s.gamma_bar.abs(), DIRECTION_REL)
    passes = streaming.passes
    for options in (
        {"damping": 0.1},
        {"damping": 0.0, "lr": 0.5, "max_decrease": 0.01},
    ):
        newton = streaming.newton(top_k=3, **options)
        expected = stored.newton(top_k=3, **options)
        assert_rel(newton.dampings, expected.dampings, DIRECTION_REL)
        for a, b in zip(newton.step, expected.step, strict=True):
            assert_rel(a, b, DIRECTION_REL)
    # the eigenpairs are kept: one pass for γ, one for each step
    assert streaming.passes == passes + 2 * 2


@pytest.mark.parametrize("problem", PROBLEMS[:2], ids=str)
def test_chunks_change_nothing_exact(problem):
    """Chunks of every batch are blocks of their own (``docs/math.rst``, "Data
    sets and processes"): the same loss, gradient and products as whole batches
    and as stored factors of the same chunks, to rounding (``REL``)."""
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [3, X.shape[0] - 3])
    chunked = StreamingGGN(model, loss_func, batches, chunk_size=2)
    whole = StreamingGGN(model, loss_func, batches)
    stored = LowRankGGN(model, loss_func, batches, chunk_size=2)
    assert chunked.passes == 1 and chunked.num_rows == stored.gram().shape[0]
    for other in (whole, stored):
        assert_rel(chunked.loss, other.loss, REL)
        for a, b in zip(chunked.gradient(), other.gradient(), strict=True):
            assert_rel(a, b, REL)
    U = torch.randn(chunked.num_rows, 2, dtype=torch.float64)
    expected = stored.gram() @ U
    assert_rel(chunked.gram_matmul(U), expected, REL)
    assert_rel(whole.gram_matmul(U), expected, REL)
    assert chunked.passes == 3  # chunks add no pass
    assert_rel(chunked.eigh(top_k=2)[0], stored.eigh(top_k=2)[0], REL)


def test_chunks_draw_the_monte_carlo_samples_of_stored_chunks():
    """Block ``b`` (the ``b``-th chunk over all batches) draws from stream
    ``s + b`` in both sources; chunks are other blocks than whole batches."""
    (problem,) = select(architecture="mlp_tanh", loss="mse", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [3, X.shape[0] - 3])

    def build(cls, chunk_size):
        return cls(
            model,
            loss_func,
            batches,
            mc_samples=2,
            generator=torch.Generator().manual_seed(5),
            chunk_size=chunk_size,
        )

    streaming = build(StreamingGGN, 2)
    U = torch.randn(streaming.num_rows, 2, dtype=torch.float64)
    product = streaming.gram_matmul(U)
    assert_rel(product, build(LowRankGGN, 2).gram() @ U, REL)
    other_draws = build(LowRankGGN, None).gram() @ U
    assert (product - other_draws).abs().max() > 1e-3 * other_draws.abs().max()


def test_refusals_name_what_needs_the_gram_matrix(monkeypatch):
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="sum")
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [2, 3])
    ggn = StreamingGGN(model, loss_func, batches)
    never_forms = "StreamingGGN never forms the Gram matrix"
    for refused in (
        ggn.gram,
        ggn.eigvalsh,
        ggn.zero_tolerance,
        lambda: ggn.eigh(top_k=None),
        lambda: ggn.directional_derivatives(top_k=None),
        lambda: ggn.newton(top_k=None),
        lambda: ggn.operator().pinv_matvec(torch.zeros(ggn.operator().shape[0])),
    ):
        with pytest.raises(InvalidArgumentError, match=never_forms):
            refused()
    for solver in ("dense", "gram_krylov"):
        with pytest.raises(InvalidArgumentError, match=f"solver='{solver}' needs the"):
            ggn.eigh(top_k=2, solver=solver)
    assert ggn.passes == 1  # every refusal before a pass

    class Unread:
        def __iter__(self):
            raise AssertionError("the data were read before the options were refused")

    for solver in ("dense", "gram_krylov"):  # refused before the first pass
        with pytest.raises(InvalidArgumentError, match=f"solver='{solver}' needs the"):
            StreamingGGN(model, loss_func, Unread(), solver=solver)
    with pytest.raises(InvalidArgumentError, match="subsampling selects samples"):
        StreamingGGN(model, loss_func, Unread(), subsampling=[0, 1])
    group = object()  # what resolve_group answers for a group of several ranks
    monkeypatch.setattr(vivit.options, "resolve_group", lambda process_group: group)
    with pytest.raises(InvalidArgumentError, match="a process group .* not supported"):
        StreamingGGN(model, loss_func, Unread(), process_group=group)


def test_operator_products_cost_two_passes():
    """``G v = V (Vᵀ v)``: one pass for ``Vᵀ v``, one for ``V ·``; ``G_K⁺ v`` as
    many once the eigenpairs are kept."""
    (problem,) = select(architecture="cnn", loss="mse", reduction="sum")
    model, loss_func, X, y = prepare(problem, torch.float64)
    ggn = StreamingGGN(model, loss_func, split(X, y, [1, 3]))
    op = ggn.operator()
    v = torch.randn(op.shape[0], 2, dtype=torch.float64)
    passes = ggn.passes
    op.matvec(v)
    assert ggn.passes == passes + 2
    op.to_scipy() @ v.numpy()
    assert ggn.passes == passes + 4
    ggn.eigh(top_k=2)
    passes = ggn.passes
    op.pinv_matvec(v, top_k=2)
    assert ggn.passes == passes + 2


def test_a_solve_that_does_not_converge_is_reported_as_such():
    """The default solver has no Gram matrix to fall back to: a tolerance below
    the rounding floor raises the solver's error, not a warning about a dense
    fallback followed by a refusal that asks for ``top_k``."""
    (problem,) = select(architecture="residual", loss="ce", reduction="sum")
    model, loss_func, X, y = prepare(problem, torch.float64)
    ggn = StreamingGGN(model, loss_func, split(X, y, [2, 3]), solver_tol=1e-18)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(SolverNotConvergedError, match="did not reach"):
            ggn.eigh(top_k=3)
