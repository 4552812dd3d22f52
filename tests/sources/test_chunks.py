"""``LowRankGGN(..., chunk_size=B)``: the backward pass in chunks of samples.

Chunking must not change any result: the chunked GGN is the GGN of the loss on the whole
mini-batch (``docs/math.rst``, "Data sets and processes"). Checked against the unchunked
object (Gram matrix, loss, gradient, ``γ``, Newton steps) and against the dense float64
GGN of ``tests/fixtures/reference.py`` (eigenvalues, eigenpairs of every solver), on
several architectures, both losses and reductions, both engines, parameter groups, and
subsamplings that fall into every chunk, into some chunks only, and that visit the
chunks out of order.

Tolerances (float64): the chunked and unchunked Gram matrices hold the same
products summed in a different order and rescaled by ``√(R_union/R_chunk)``, so
they agree to a few ulps of their largest entry (measured ≤ 1e-15 relative);
``1e-12`` relative leaves room, while a wrong scale or a missing or misplaced
sample is an O(1) error. Eigenpairs against the dense GGN: ``tests/fixtures/checks.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    layer_groups,
)
from tests.fixtures.func_problems import FUNC_PROBLEMS
from tests.fixtures.problems import default_dtype, prepare, problem_ids, select
from tests.fixtures.reference import dense_ggn
from vivit import LowRankGGN
from vivit.errors import (
    InvalidArgumentError,
    InvalidTargetsError,
    UnsupportedLossError,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

#: Chunked against unchunked, float64 (see the module docstring).
REL = REORDERED_REL
ARCHITECTURES = ["mlp_tanh", "cnn", "conv1d", "batchnorm1d", "residual"]
#: Both losses and both reductions, each architecture twice (keeps the file fast).
PROBLEMS = select(architecture=ARCHITECTURES, loss="ce", reduction="mean") + select(
    architecture=ARCHITECTURES, loss="mse", reduction="sum"
)
#: Name → subsampling of a batch of N ≥ 4 samples, chunked by 2.
SUBSAMPLINGS = {
    "all": None,
    "ordered": [0, 2, 3],
    "unordered": [3, 0, 2],  # rows must come back in this order
    "one-chunk": [1],  # the other chunks hold no curvature sample
}


def build(problem, engine):
    """The problem in float64, extended for BackPACK only."""
    return prepare(problem, torch.float64, extend=engine == "backpack")


def assert_same(chunked: LowRankGGN, whole: LowRankGGN, group: int = 0) -> None:
    """Gram matrix, loss, gradients and Newton step of chunked and whole agree.

    Compared where the eigenbasis does not matter (degenerate eigenvalues, e.g. of
    a bias, have no unique eigenvectors): ``ΓΓᵀ`` of the directional gradients
    ``γ_nk`` over every non-zero direction is ``∇ℓ_nᵀ P ∇ℓ_m`` with ``P`` the
    projector onto the GGN's range, and the Newton step with a constant damping
    is ``−(G + δ)⁻¹`` on that range applied to the mean gradient of the samples
    (given out of order: the per-sample gradients must keep the batch's order).
    """
    assert_rel(chunked.gram(group), whole.gram(group), REL)
    assert_rel(chunked.loss, whole.loss, REL)
    for a, b in zip(chunked.gradient(group), whole.gradient(group), strict=True):
        assert_rel(a, b, REL)
    gammas = [
        ggn.directional_derivatives(group=group, subsampling_grad=[1, 0]).gammas
        for ggn in (chunked, whole)
    ]
    assert_rel(gammas[0] @ gammas[0].T, gammas[1] @ gammas[1].T, EIGVEC_PRODUCT_REL)
    steps = [
        ggn.newton_step(group=group, damping=0.1, subsampling_grad=[1, 0])
        for ggn in (chunked, whole)
    ]
    for a, b in zip(*steps, strict=True):
        assert_rel(a, b, EIGVEC_PRODUCT_REL)


#: (problem, engine): the func engine runs every problem but the converted
#: model, whose custom forward is BackPACK's own.
PROBLEM_ENGINES = [
    pytest.param(problem, engine, id=f"{name}-{engine}")
    for problem, name in zip(PROBLEMS, problem_ids(PROBLEMS), strict=True)
    for engine in ("backpack", "func")
    if not (engine == "func" and problem.needs_converter)
]


@pytest.mark.parametrize("subsampling", SUBSAMPLINGS.values(), ids=SUBSAMPLINGS)
@pytest.mark.parametrize("problem, engine", PROBLEM_ENGINES)
def test_chunked_equals_whole_and_dense_ggn(problem, subsampling, engine):
    model, loss_func, X, y = build(problem, engine)
    with default_dtype(torch.float64):
        whole = LowRankGGN(
            model, loss_func, (X, y), subsampling=subsampling, engine=engine
        )
        chunked = LowRankGGN(
            model,
            loss_func,
            (X, y),
            subsampling=subsampling,
            engine=engine,
            chunk_size=2,
        )
    assert_same(chunked, whole)
    G = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    assert_top_eigvals(
        chunked.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
    )
    for solver in ("dense", "gram_krylov", "factor_krylov"):
        evals, evecs = chunked.eigh(top_k=2, solver=solver)
        report = chunked.solver_report()
        tol = None if report is None else report.tolerance
        assert_eigenpairs(evals, evecs, G, chunked.eigvalsh().numel(), tol)


@pytest.mark.parametrize("problem", FUNC_PROBLEMS, ids=lambda p: p.name)
def test_models_only_the_func_engine_runs(problem):
    """Transformer, LSTM, shared weights, GroupNorm: samples independent, so exact."""
    model, loss_func, X, y = problem.setup(torch.float64)
    whole = LowRankGGN(model, loss_func, (X, y), engine="func")
    assert_same(
        LowRankGGN(model, loss_func, (X, y), engine="func", chunk_size=2), whole
    )


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_chunk_sizes(chunk_size):
    """Chunks of one sample, a last chunk shorter than the others, one chunk."""
    problem = select(architecture="mlp_relu", loss="ce", reduction="sum")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    whole = LowRankGGN(model, loss_func, (X, y), subsampling=[5, 1, 2])
    chunked = LowRankGGN(
        model, loss_func, (X, y), subsampling=[5, 1, 2], chunk_size=chunk_size
    )
    assert_same(chunked, whole)


@pytest.mark.parametrize("engine", ["backpack", "func"])
def test_parameter_groups(engine):
    problem = select(architecture="cnn", loss="mse", reduction="mean")[0]
    model, loss_func, X, y = build(problem, engine)
    groups = layer_groups(model)
    with default_dtype(torch.float64):
        whole = LowRankGGN(model, loss_func, (X, y), param_groups=groups, engine=engine)
        chunked = LowRankGGN(
            model,
            loss_func,
            (X, y),
            param_groups=groups,
            engine=engine,
            chunk_size=3,
        )
    for group in range(len(groups)):
        assert_same(chunked, whole, group)


def test_monte_carlo_chunks_are_a_loaders_batches():
    """Chunk ``b`` draws from the stream of a loader's batch ``b``; one chunk, as is."""
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)

    def ggn(data, **options):
        generator = torch.Generator().manual_seed(3)
        return LowRankGGN(
            model, loss_func, data, mc_samples=2, generator=generator, **options
        )

    loader = [(X[:2], y[:2]), (X[2:4], y[2:4]), (X[4:], y[4:])]
    chunked = ggn((X, y), chunk_size=2)
    assert_rel(chunked.gram(), ggn(loader).gram(), REL)
    assert_rel(ggn((X, y), chunk_size=len(X)).gram(), ggn((X, y)).gram(), REL)
    # the exact parts do not depend on the draws
    assert_rel(chunked.loss, ggn((X, y)).loss, REL)
    assert chunked.gram().shape == (2 * len(X), 2 * len(X))


def test_loader_batches_are_chunked():
    problem = select(architecture="conv1d", loss="mse", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    loader = [(X[:4], y[:4]), (X[4:], y[4:])]
    whole = LowRankGGN(model, loss_func, (X, y))
    assert_same(LowRankGGN(model, loss_func, loader, chunk_size=3), whole)


@pytest.mark.parametrize("chunk_size", [0, -2, 1.5, True, "4"])
def test_invalid_chunk_size(chunk_size):
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    with pytest.raises(InvalidArgumentError, match="chunk_size must be a positive"):
        LowRankGGN(model, loss_func, (X, y), chunk_size=chunk_size)


@pytest.mark.parametrize("engine", ["backpack", "func"])
def test_chunk_whose_targets_are_all_ignored_carries_no_weight(engine):
    """A chunk with every target ignored: zero columns, zero loss (issue 19).

    Its own mean is ``0/0``; in the loss on the whole batch its samples have
    weight ``0`` (``docs/math.rst``, "Data sets and processes"): the chunked
    GGN is the unchunked one (used to be refused, "use a larger chunk_size").
    """
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, _, X, _ = prepare(problem, torch.float64)
    loss_func = torch.nn.CrossEntropyLoss(ignore_index=-1)
    y = torch.tensor([0, 1, -1, -1, 2])
    whole = LowRankGGN(model, loss_func, (X, y), engine=engine)
    assert whole.gram().shape == (15, 15)
    chunked = LowRankGGN(model, loss_func, (X, y), chunk_size=2, engine=engine)
    assert_rel(chunked.gram(), whole.gram(), REL)
    assert (chunked.gram()[6:12] == 0).all()  # samples 2 and 3: zero columns
    assert_rel(chunked.loss, whole.loss, REL)
    G = dense_ggn(model, loss_func, X, y)
    assert_top_eigvals(
        chunked.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
    )
    with pytest.raises(InvalidTargetsError, match="Every target of every batch"):
        LowRankGGN(model, loss_func, (X, torch.full((5,), -1)), chunk_size=2)


def test_errors_in_chunks_name_the_batch_and_samples():
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)  # N = 5
    wrong = y.clone()
    wrong[3] = 99  # a bad label: wrong whatever the chunks
    with pytest.raises(InvalidTargetsError, match="class index 99") as error:
        LowRankGGN(model, loss_func, (X, wrong), chunk_size=2)
    assert "chunk_size" not in str(error.value)  # no advice to change it
    assert "positions count from the chunk's first sample" in str(error.value)
    loader = [(X[:2], y[:2]), (X, wrong)]
    with pytest.raises(InvalidTargetsError, match="^Batch 1 of the data loader: Chunk"):
        LowRankGGN(model, loss_func, loader, chunk_size=2)
    # the last chunk (1 sample) of chunk_size=2 is not called chunk_size=1
    with pytest.raises(InvalidTargetsError, match="samples 4 to 4 .*class index 7"):
        LowRankGGN(model, loss_func, (X, torch.tensor([0, 1, 2, 0, 7])), chunk_size=2)


@pytest.mark.parametrize("engine", ["backpack", "func"])
def test_per_sample_bce_weight_is_refused_alike_by_both_engines(engine):
    """A weight ``[N, C]`` does not follow the chunks: ``UnsupportedLossError``
    from both engines (the func engine used to raise torch's RuntimeError)."""
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, _, X, _ = build(problem, engine)  # N = 5
    gen = torch.Generator().manual_seed(0)
    num_classes = model(X).shape[1]
    y = torch.rand(len(X), num_classes, generator=gen, dtype=torch.float64)
    weight = torch.rand(len(X), num_classes, generator=gen, dtype=torch.float64)
    loss_func = torch.nn.BCEWithLogitsLoss(weight=weight)
    assert LowRankGGN(model, loss_func, (X, y), engine=engine).gram().isfinite().all()
    with pytest.raises(UnsupportedLossError, match="weight per sample .*chunk_size"):
        LowRankGGN(model, loss_func, (X, y), engine=engine, chunk_size=2)
