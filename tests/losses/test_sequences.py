"""Cross-entropy on sequences ``[N, C, T]``: chunked exact roots, MC per token.

``docs/math.rst``, "Losses" (the root of ``C·T`` columns per sample, each non-zero
at one position) and "Monte Carlo on sequences" (per token and per sequence, both
unbiased; their variances). Every comparison is against the dense float64
``torch.func`` reference of ``tests/fixtures/reference.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import vivit.loss_roots
import vivit.memory
import vivit.memory.plan
import vivit.sources.stored
from tests.fixtures.checks import REORDERED_REL, assert_rel, assert_within
from tests.fixtures.func_problems import CharLSTM
from tests.fixtures.memory import available
from tests.fixtures.reference import dense_ggn
from vivit import FactorsTooLargeError, FewerEigenpairsWarning, LowRankGGN
from vivit.engines.func import FuncEngine
from vivit.losses import LossCurvature
from vivit.memory.plan import ESTIMATE_FACTOR

N, C, T = 4, 3, 6


def _conv_lm() -> nn.Module:
    """Logits ``[N, C, T]`` from ``[N, 2, T + 2]``; both engines run it."""
    return nn.Sequential(nn.Conv1d(2, 4, 3), nn.Tanh(), nn.Conv1d(4, C, 1)).double()


def _problem(reduction: str, seed: int = 0):
    torch.manual_seed(seed)
    model = _conv_lm()
    X = torch.randn(N, 2, T + 2, dtype=torch.float64)
    y = torch.randint(C, (N, T))
    y[0, 1] = -100  # an ignored position: a zero column
    return model, nn.CrossEntropyLoss(reduction=reduction), X, y


def _lstm_problem(reduction: str):
    torch.manual_seed(1)
    model = CharLSTM().double()
    X = torch.randint(0, 5, (3, 4))
    return model, nn.CrossEntropyLoss(reduction=reduction), X, torch.randint(5, (3, 4))


def _ggn_matrix(ggn: LowRankGGN, num_params: int) -> torch.Tensor:
    """``G = V Vᵀ`` in parameter space, from products with the identity."""
    eye = torch.eye(num_params, dtype=torch.float64)
    return ggn.operator().matvec(eye)


# ----------------------------------------------------------------------------------
# Exact roots, a block of columns at a time
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_root_blocks_are_the_whole_root(dtype, monkeypatch):
    """Any split of the columns gives the whole root's numbers, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    output = torch.randn(N, C, 2, 3, generator=gen, dtype=dtype)
    targets = torch.randint(C, (N, 2, 3), generator=gen)
    curvature = LossCurvature(nn.CrossEntropyLoss(), output, targets)
    root = curvature.root([0, 2, 3])
    whole = curvature.sqrt_hessian([0, 2, 3])
    assert whole.shape == (C * 6, 3, C, 2, 3)
    for step in (1, 4, 7):
        parts = [root[k : k + step] for k in range(0, len(root), step)]
        assert torch.equal(torch.cat(parts), whole)
    # the whole root formed in blocks of a few columns (LossRoot's own blocks)
    monkeypatch.setattr(vivit.loss_roots, "ROOT_BLOCK_ENTRIES", 100)
    assert torch.equal(root[:], whole)
    assert torch.equal(root[2:], whole[2:])
    # column c·P + p is non-zero at position p only
    flat = whole.reshape(C, 6, 3, C, 6)
    off = ~torch.eye(6, dtype=torch.bool)
    assert (flat.permute(1, 4, 0, 2, 3)[off] == 0).all()


def test_func_engine_never_forms_the_whole_root(monkeypatch):
    """With a small budget the backward passes take a few root columns at a time.

    The Gram matrix is that of the dense reference (reordered sums,
    ``docs/math.rst``, "Tolerances of the tests").
    """
    largest = []
    getitem = vivit.loss_roots.LossRoot.__getitem__

    def recording(self, columns):
        block = getitem(self, columns)
        largest.append(len(block))
        return block

    monkeypatch.setattr(vivit.loss_roots.LossRoot, "__getitem__", recording)
    model, loss_func, X, y = _problem("mean")
    ggn = LowRankGGN(model, loss_func, (X, y), engine=FuncEngine(memory_budget=200))
    assert 0 < max(largest) < C * T  # never all C·T columns at once
    num_params = sum(p.numel() for p in model.parameters())
    reference = dense_ggn(model, loss_func, X, y)
    assert_rel(_ggn_matrix(ggn, num_params), reference, REORDERED_REL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("subsampling", [None, [0, 2]])
def test_exact_sequence_ggn(reduction, engine, subsampling):
    """``V Vᵀ`` of N·C·T columns is the dense float64 GGN (reordered sums)."""
    model, loss_func, X, y = _problem(reduction)
    ggn = LowRankGGN(model, loss_func, (X, y), engine=engine, subsampling=subsampling)
    rows = (N if subsampling is None else len(subsampling)) * C * T
    assert ggn.gram().shape == (rows, rows)
    num_params = sum(p.numel() for p in model.parameters())
    reference = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    assert_rel(_ggn_matrix(ggn, num_params), reference, REORDERED_REL)


# ----------------------------------------------------------------------------------
# Monte Carlo per token and per sequence
# ----------------------------------------------------------------------------------


def _mc_estimates(model, loss_func, X, y, mc_per, runs, generator, subsampling=None):
    """``runs`` MC estimates of ``G`` (one draw each), ``[runs, D, D]``."""
    num_params = sum(p.numel() for p in model.parameters())
    return torch.stack(
        [
            _ggn_matrix(
                LowRankGGN(
                    model,
                    loss_func,
                    (X, y),
                    mc_samples=1,
                    mc_per=mc_per,
                    subsampling=subsampling,
                    generator=generator,
                ),
                num_params,
            )
            for _ in range(runs)
        ]
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("engine", ["backpack", "func"])
def test_mc_column_counts(reduction, engine):
    """Per token N·M·T Gram rows, per sequence N·M: the sums of the same draws."""
    model, loss_func, X, y = _problem(reduction)
    grams = {}
    for mc_per, rows in (("token", N * 2 * T), ("sequence", N * 2)):
        ggn = LowRankGGN(
            model,
            loss_func,
            (X, y),
            engine=engine,
            mc_samples=2,
            mc_per=mc_per,
            generator=torch.Generator().manual_seed(3),
        )
        assert ggn.gram().shape == (rows, rows)
        grams[mc_per] = ggn.gram()
    # the same draws: per sequence sums each sample's per-token columns
    token = grams["token"].reshape(N, 2, T, N, 2, T)
    summed = token.sum((2, 5)).reshape(N * 2, N * 2)
    assert_rel(summed, grams["sequence"], REORDERED_REL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "mc_per, subsampling", [("token", None), ("sequence", None), ("token", [1, 3])]
)
def test_mc_is_unbiased(reduction, mc_per, subsampling):
    """The mean of R MC estimates of G is the exact G within 5 standard errors.

    Each entry of the mean has standard error ``σ/√R`` (the variances of
    ``docs/math.rst``, "Monte Carlo on sequences", estimated from the runs); the
    outcome is fixed by the seed, and a false alarm at ``5σ`` has ``p < 6e-7``
    per entry.
    """
    model, loss_func, X, y = _problem(reduction)
    runs = 200
    gen = torch.Generator().manual_seed(0)
    estimates = _mc_estimates(model, loss_func, X, y, mc_per, runs, gen, subsampling)
    exact = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    standard_error = estimates.std(0) / runs**0.5
    # entries without variance are exact up to reordered sums (math.rst, tolerances)
    floor = REORDERED_REL * exact.abs().max()
    assert_within(estimates.mean(0), exact, 5 * standard_error + floor)
    # narrower than a factor-2 error of the largest entry: the check has power
    assert (5 * standard_error).max() < 0.5 * exact.abs().max()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mc_per_token_has_the_smaller_error(reduction):
    """Same draws: per token drops the cross terms between positions (math.rst)."""
    model, loss_func, X, y = _problem(reduction)
    exact = dense_ggn(model, loss_func, X, y)
    errors = {}
    for mc_per in ("token", "sequence"):
        gen = torch.Generator().manual_seed(0)
        estimates = _mc_estimates(model, loss_func, X, y, mc_per, 20, gen)
        errors[mc_per] = (estimates - exact).square().sum()
    # measured ratio 0.13 (both reductions: R scales both alike); 0.5 is the
    # margin, and equal variances (ratio ≈ 1) would fail
    assert errors["token"] < 0.5 * errors["sequence"]


def test_mc_per_token_on_an_lstm():
    """The func engine on an LSTM: N·M·T rows, G's trace unbiased."""
    model, loss_func, X, y = _lstm_problem("sum")
    gen = torch.Generator().manual_seed(0)
    traces = []
    for _ in range(100):
        ggn = LowRankGGN(model, loss_func, (X, y), mc_samples=1, generator=gen)
        assert ggn.gram().shape == (3 * 4, 3 * 4)
        traces.append(ggn.gram().trace())
    traces = torch.stack(traces)
    exact = dense_ggn(model, loss_func, X, y).trace()
    assert (traces.mean() - exact).abs() <= 5 * traces.std() / 100**0.5


# ----------------------------------------------------------------------------------
# Fewer eigenpairs than top_k
# ----------------------------------------------------------------------------------


def test_fewer_pairs_than_top_k_warns_with_the_gram_side():
    model, loss_func, X, y = _problem("mean")
    ggn = LowRankGGN(
        model, loss_func, (X, y), mc_samples=1, mc_per="sequence", generator=None
    )
    with pytest.warns(FewerEigenpairsWarning, match=r"only 4 rows .*mc_per='token'"):
        evals, _ = ggn.eigh(top_k=10)
    assert len(evals) == 4
    with pytest.warns(FewerEigenpairsWarning, match="only 4 rows"):
        ggn.directional_derivatives(top_k=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ggn.eigh(top_k=4)  # as many as exist: no warning


def test_fewer_pairs_than_top_k_warns_on_numerical_zeros():
    """Cross-entropy: rank at most N·(C - 1)·T, the rest are numerical zeros."""
    model, loss_func, X, y = _problem("sum")
    ggn = LowRankGGN(model, loss_func, (X, y))
    with pytest.warns(FewerEigenpairsWarning, match="numerical zeros") as record:
        evals, _ = ggn.eigh(top_k=N * C * T)
    assert f"only {len(evals)} exist" in str(record[0].message)
    assert len(evals) <= N * (C - 1) * T


# ----------------------------------------------------------------------------------
# Refusal of a batch whose factors cannot fit
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["backpack", "func"])
def test_a_batch_whose_factors_cannot_fit_is_refused_before_running(
    engine, monkeypatch
):
    model, loss_func, X, y = _problem("mean")
    options = {"engine": engine, "solver": "factor_krylov"}
    needs = vivit.memory.estimate_memory(
        model, X[:1], N, loss_func=loss_func, **options
    )
    LowRankGGN(model, loss_func, (X, y), **options)  # measured on a copy, once
    ran = []
    monkeypatch.setattr(vivit.sources.stored, "run_part", ran.append)
    available(monkeypatch, int(needs.passes / ESTIMATE_FACTOR / 2))
    with pytest.raises(FactorsTooLargeError) as error:
        LowRankGGN(model, loss_func, (X, y), **options)
    message = str(error.value)
    assert f"{N * C * T} columns" in message
    for option in ("mc_samples=1", "subsampling", "chunk_size", "StreamingGGN"):
        assert option in message
    assert "route='implicit'" in message
    assert not ran  # refused before the engine ran


def test_a_batch_that_fits_runs(monkeypatch):
    """Within the estimate's factor (ESTIMATE_FACTOR) the batch is not refused."""
    model, loss_func, X, y = _problem("mean")
    options = {"engine": "backpack", "solver": "factor_krylov"}
    needs = vivit.memory.estimate_memory(
        model, X[:1], N, loss_func=loss_func, **options
    )
    enough = int(needs.passes / ESTIMATE_FACTOR) + 1
    monkeypatch.setattr(vivit.memory.plan, "available_bytes", lambda device: enough)
    LowRankGGN(model, loss_func, (X, y), **options).gram()


class _PositionalConv(nn.Module):
    """A parameter outside every leaf layer (a position embedding)."""

    def __init__(self):
        super().__init__()
        self.conv = _conv_lm()
        self.position = nn.Parameter(torch.randn(2, T + 2, dtype=torch.float64))

    def forward(self, x):
        return self.conv(x + self.position)


def test_a_parameter_outside_the_leaf_layers_is_estimated(monkeypatch):
    """The estimate (and so the refusal) covers a model-owned parameter."""
    _, loss_func, X, y = _problem("sum")
    model = _PositionalConv()
    needs = vivit.memory.estimate_memory(
        model, X[:1], N, loss_func=loss_func, engine="func"
    )
    assert needs.kept > 0
    available(monkeypatch, 0)
    with pytest.raises(FactorsTooLargeError):
        LowRankGGN(model, loss_func, (X, y), solver="factor_krylov")
