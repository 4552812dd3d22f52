"""LowRankGGN over a data loader equals LowRankGGN on the concatenated batch.

The GGN of a loader is that of the loss on all its samples together
(``docs/math.rst``, "Data sets and processes"): every quantity must equal the
dense float64 torch.func reference of the concatenated batch
(``tests/fixtures/reference.py``) and LowRankGGN on the concatenated batch.

Tolerances (float64 throughout unless said otherwise): the loader and the single
batch compute the same sums in a different order (per-batch forward passes,
cross-Gram blocks instead of one Gram), so they agree to rounding, ``1e-10``
relative to the largest entry (measured ≤ 1e-13); a wrong scaling
``√(R_union/R_block)`` or weight ``R_union/R_block`` is an O(1) relative error.
Eigenvalues against the reference as in ``tests/fixtures/checks.py``.
"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import vivit.sources.data
import vivit.sources.union
from tests.fixtures.checks import (
    DIRECTION_REL,
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    assert_differs,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    factor_product_bound,
    flat_evecs,
    layer_groups,
)
from tests.fixtures.func_problems import FUNC_PROBLEMS
from tests.fixtures.problems import prepare, select
from tests.fixtures.reference import dense_ggn, dense_gradient, per_sample_gradients
from vivit import InvalidArgumentError, InvalidTargetsError, LowRankGGN, StreamingGGN
from vivit.sources.data import UNBOUNDED_NOTE

REL = EIGVEC_PRODUCT_REL
#: Uneven batch sizes for a mini-batch of ``N`` samples (the tests' N are 3 to 6).
SIZES = {3: [2, 1], 4: [1, 3], 5: [2, 1, 2], 6: [3, 1, 2]}

PROBLEMS = [
    *select(architecture="mlp_tanh", loss="ce", reduction="mean"),
    *select(architecture="mlp_relu", loss="mse", reduction="sum"),
    *select(architecture="cnn", loss="ce", reduction="sum"),
    *select(architecture="conv1d", loss="mse", reduction="mean"),
    *select(architecture="residual", loss="ce", reduction="mean"),
]
FUNC = [p for p in FUNC_PROBLEMS if p.name in ("transformer-ce-mean", "twice-mse-mean")]


def split(X, y, sizes):
    """The batches of a loader over ``(X, y)`` with the given batch sizes."""
    return list(zip(X.split(sizes), y.split(sizes), strict=True))


def sizes_of(X):
    return SIZES[X.shape[0]]


def assert_same_ggn(
    loader: LowRankGGN, single: LowRankGGN, group: int = 0, directions: bool = True
):
    """Every Gram-space and parameter-space result of the two agrees to ``REL``.

    ``directions=False`` skips the per-direction ``γ``, ``λ``: they depend on the
    basis chosen inside a repeated eigenvalue.
    """
    assert_rel(loader.gram(group), single.gram(group), REL)
    assert_rel(loader.eigvalsh(group), single.eigvalsh(group), REL)
    assert_rel(loader.loss, single.loss, REL)
    for a, b in zip(loader.gradient(group), single.gradient(group), strict=True):
        assert_rel(a, b, REL)
    for solver in ("dense", "gram_krylov", "factor_krylov"):
        evals, evecs = loader.eigh(top_k=2, group=group, solver=solver)
        evals_s, evecs_s = single.eigh(top_k=2, group=group, solver=solver)
        assert_rel(evals, evals_s, REL)
        # eigenvectors of the single batch's GGN (sign- and rotation-free)
        G_e = single.operator(group).matvec([e.clone() for e in evecs])
        residual = flat_evecs(G_e) - flat_evecs(evecs) * evals[:, None]
        assert residual.norm(dim=1).max() <= REL * evals_s.max()
    if directions:
        assert_same_directions(loader, single, group)
    # the Newton step and the operator do not depend on the eigenvector basis
    for a, b in zip(
        loader.newton_step(group=group, damping=0.1),
        single.newton_step(group=group, damping=0.1),
        strict=True,
    ):
        assert_rel(a, b, DIRECTION_REL)
    v = [torch.randn_like(p) for p in single.param_groups[group]]
    for a, b in zip(
        loader.operator(group).matvec(v), single.operator(group).matvec(v), strict=True
    ):
        assert_rel(a, b, REL)


def assert_same_directions(loader: LowRankGGN, single: LowRankGGN, group: int):
    """``γ``, ``λ`` and their statistics (``γ`` changes sign with ``e_k``)."""
    d, d_s = (g.directional_derivatives(group=group) for g in (loader, single))
    assert_rel(d.evals, d_s.evals, REL)
    assert_rel(d.lambdas, d_s.lambdas, REL)
    assert_rel(d.lambda_mean, d_s.lambda_mean, REL)
    assert_rel(d.lambda_var, d_s.lambda_var, REL)
    assert_rel(d.gammas.abs(), d_s.gammas.abs(), DIRECTION_REL)
    assert_rel(d.gamma_var, d_s.gamma_var, DIRECTION_REL)
    assert_rel(d.gamma_bar.abs(), d_s.gamma_bar.abs(), DIRECTION_REL)


def assert_matches_reference(ggn: LowRankGGN, model, loss_func, X, y, params=None):
    G = dense_ggn(model, loss_func, X, y, params=params)
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[X.dtype])
    evals, evecs = ggn.eigh()
    assert_eigenpairs(evals, evecs, G, ggn.eigvalsh().numel())
    gradient = torch.cat([g.flatten() for g in ggn.gradient()])
    assert_rel(gradient, dense_gradient(model, loss_func, X, y, params=params), REL)
    assert_rel(ggn.loss, loss_func(model(X), y).detach(), REL)


def assert_leading_match_reference(ggn, model, loss_func, X, y):
    """The top 3 eigenpairs and the gradient: those of the dense reference."""
    G = dense_ggn(model, loss_func, X, y)
    evals, evecs = ggn.eigh(top_k=3)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[X.dtype])
    tol = ggn.solver_report().tolerance
    rows = ggn.num_rows if isinstance(ggn, StreamingGGN) else ggn.gram().shape[0]
    assert_eigenpairs(evals, evecs, G, rows, tol)
    gradient = torch.cat([g.flatten() for g in ggn.gradient()])
    assert_rel(gradient, dense_gradient(model, loss_func, X, y), REL)


@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_loader_equals_concatenated_batch(problem, engine):
    model, loss_func, X, y = prepare(problem, torch.float64)
    loader = LowRankGGN(model, loss_func, split(X, y, sizes_of(X)), engine=engine)
    single = LowRankGGN(model, loss_func, (X, y), engine=engine)
    assert loader.gram().shape == single.gram().shape
    assert_same_ggn(loader, single)
    assert_matches_reference(loader, model, loss_func, X, y)
    # γ_nk = e_kᵀ∇ℓ_n of every sample of every batch
    evals, evecs = loader.eigh(top_k=3)
    gammas = loader.directional_derivatives(top_k=3).gammas
    E = flat_evecs(evecs)
    assert_rel(
        gammas, per_sample_gradients(model, loss_func, X, y) @ E.T, DIRECTION_REL
    )


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("problem", FUNC, ids=lambda p: p.name)
def test_func_engine_only_models(problem):
    """Transformer and tied weights: the func engine over a loader."""
    model, loss_func, X, y = problem.setup(torch.float64)
    X, y = torch.cat([X, X.flip(0)]), torch.cat([y, y.flip(0)])  # N = 8
    loader = LowRankGGN(model, loss_func, split(X, y, [3, 1, 4]))
    assert loader.engine == "func"
    single = LowRankGGN(model, loss_func, (X, y))
    assert_same_ggn(loader, single)
    assert_matches_reference(loader, model, loss_func, X, y)


@pytest.mark.parametrize(
    "kind", ["list", "tuple", "generator", "dataloader", "one batch"]
)
def test_kinds_of_loaders(kind):
    (problem,) = select(architecture="mlp_relu", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)  # N = 6
    if kind == "list":
        data = split(X, y, [2, 2, 2])
    elif kind == "tuple":
        data = tuple(split(X, y, [4, 2]))
    elif kind == "generator":
        data = ((X[i : i + 4], y[i : i + 4]) for i in range(0, 6, 4))
    elif kind == "dataloader":
        data = DataLoader(TensorDataset(X, y), batch_size=4, shuffle=False)
    else:
        data = [(X, y)]
    loader = LowRankGGN(model, loss_func, data)
    assert_same_ggn(loader, LowRankGGN(model, loss_func, (X, y)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_parameter_groups(reduction):
    (problem,) = select(architecture="cnn", loss="mse", reduction=reduction)
    model, loss_func, X, y = prepare(problem, torch.float64)
    groups = layer_groups(model)
    loader = LowRankGGN(model, loss_func, split(X, y, [1, 3]), param_groups=groups)
    single = LowRankGGN(model, loss_func, (X, y), param_groups=groups)
    for index, group in enumerate(groups):
        assert_same_ggn(loader, single, index, directions=False)
        G = dense_ggn(model, loss_func, X, y, params=group)
        assert_top_eigvals(loader.eigvalsh(index), torch.linalg.eigvalsh(G), REL)


def _classifier(C=4, weighted=True, ignore_index=-100, seq=False):
    torch.manual_seed(0)
    if seq:  # [N, 3, T] -> [N, C, T]
        model = nn.Sequential(nn.Conv1d(3, 5, 1), nn.Tanh(), nn.Conv1d(5, C, 1))
    else:
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, C))
    weight = torch.tensor([0.5, 2.0, 1.0, 0.25]) if weighted else None
    loss_func = nn.CrossEntropyLoss(
        weight=weight, ignore_index=ignore_index, label_smoothing=0.1
    )
    return model.double(), loss_func.double()


@pytest.mark.parametrize("seq", [False, True], ids=["classes", "positions"])
def test_union_normalization_with_ignored_targets_and_class_weights(seq):
    """Mean CE divides by the class weights of the counted targets of all batches."""
    model, loss_func = _classifier(seq=seq)
    gen = torch.Generator().manual_seed(1)
    N, T = 8, 3
    X = torch.randn((N, 3, T) if seq else (N, 3), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (N, T) if seq else (N,), generator=gen)
    y[1] = -100  # a sample ignored entirely (in batch 0)
    y[5] = 2  # batches of different total class weight
    if seq:
        y[6, 0] = -100  # a position ignored
    loader = LowRankGGN(model, loss_func, split(X, y, [3, 2, 3]))
    single = LowRankGGN(model, loss_func, (X, y))
    assert_same_ggn(loader, single)
    assert_matches_reference(loader, model, loss_func, X, y)


@pytest.mark.parametrize("front_door", [LowRankGGN, StreamingGGN])
@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_with_every_target_ignored_carries_no_weight(
    reduction, engine, front_door
):
    """Its own mean is 0/0, the union's is defined: zero columns, loss, gradient.

    The batch's samples have weight ``0`` in the mean over all samples
    (``docs/math.rst``, "Data sets and processes"); the loader's GGN, loss,
    gradient and ``γ`` are those of the concatenated batch (used to be
    refused under the mean). A loader whose every target is ignored stays
    refused under the mean.
    """
    model, loss_func = _classifier()
    loss_func.reduction = reduction
    X = torch.randn(6, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, -100, -100, 2, 3])
    loader = front_door(model, loss_func, split(X, y, [2, 2, 2]), engine=engine)
    assert_leading_match_reference(loader, model, loss_func, X, y)
    assert_rel(loader.loss, loss_func(model(X), y).detach(), REL)
    # γ of every sample (zero for the ignored ones), as on the concatenated batch
    gammas = loader.directional_derivatives(top_k=3).gammas
    single = LowRankGGN(model, loss_func, (X, y)).directional_derivatives(top_k=3)
    assert_rel(gammas.abs(), single.gammas.abs(), DIRECTION_REL)
    assert (gammas[2:4] == 0).all()
    if reduction == "mean":
        ignored = torch.full_like(y, -100)
        with pytest.raises(InvalidTargetsError, match="Every target of every batch"):
            front_door(model, loss_func, split(X, ignored, [2, 2, 2]), engine=engine)


def test_float32_model_with_float64_gram():
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="sum")
    model, loss_func, X, y = prepare(problem, torch.float32)
    sizes = sizes_of(X)
    loader = LowRankGGN(model, loss_func, split(X, y, sizes), gram_dtype=torch.float64)
    assert loader.gram().dtype == torch.float64
    evals, evecs = loader.eigh(top_k=2)
    assert evals.dtype == torch.float64 and evecs[0].dtype == torch.float32
    # the diagonal blocks are the float64 Grams of each batch's own float32 factors
    start = 0
    for (Xb, yb), n in zip(split(X, y, sizes), sizes, strict=True):
        rows = slice(start * 3, (start + n) * 3)
        alone = LowRankGGN(model, loss_func, (Xb, yb), gram_dtype=torch.float64)
        # the same float32 factors summed in float64 in another order
        assert_rel(loader.gram()[rows, rows], alone.gram(), REORDERED_REL)
        start += n
    # and the whole equals the concatenated batch to float32 rounding of factors
    single = LowRankGGN(model, loss_func, (X, y), gram_dtype=torch.float64)
    # float32 factors of another batch: 2c·ε₃₂ (docs/math.rst, "Float32 factors")
    assert_rel(loader.gram(), single.gram(), factor_product_bound(1.0))


def _pinned_base_seed(monkeypatch, seed):
    monkeypatch.setattr(vivit.sources.union, "base_seed", lambda generator: seed)


def test_monte_carlo_stream_per_block(monkeypatch):
    """Block b draws from seed + b; reproducible; one block == the single batch."""
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)  # N = 5
    batches = split(X, y, [2, 1, 2])

    def mc(data, seed=7):
        generator = torch.Generator().manual_seed(seed)
        return LowRankGGN(model, loss_func, data, mc_samples=2, generator=generator)

    first, again = mc(batches), mc(batches)
    torch.testing.assert_close(first.gram(), again.gram(), rtol=0, atol=0)
    assert_differs(first.gram(), mc(batches, seed=8).gram(), REORDERED_REL)
    assert_same_ggn(mc([(X, y)]), mc((X, y)))

    # with the base seed pinned to S, block b's samples are those of batch b alone
    # with base seed S + b (its Gram rescaled by R_union / R_block = 1/5 / (1/n))
    _pinned_base_seed(monkeypatch, 1000)
    union = mc(batches).gram()
    start = 0
    for b, (Xb, yb) in enumerate(batches):
        _pinned_base_seed(monkeypatch, 1000 + b)
        alone = mc((Xb, yb)).gram() * len(yb) / 5
        rows = slice(start * 2, (start + len(yb)) * 2)
        assert_rel(union[rows, rows], alone, REL)
        start += len(yb)


def test_monte_carlo_trace_is_unbiased():
    """E[tr G̃_MC] = tr G̃ over the loader; 5 standard errors (a fixed sample)."""
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [2, 1, 2])
    exact = LowRankGGN(model, loss_func, batches).gram().trace()
    generator = torch.Generator().manual_seed(0)
    traces = torch.stack(
        [
            LowRankGGN(model, loss_func, batches, mc_samples=8, generator=generator)
            .gram()
            .trace()
            for _ in range(200)
        ]
    )
    standard_error = traces.std() / 200**0.5
    assert (traces.mean() - exact).abs() <= 5 * standard_error
    assert standard_error < 0.1 * exact  # the check is not vacuous


def test_monte_carlo_without_generator_draws_anew_each_call():
    """Without a generator the MC seed is one draw from torch's global generator,
    which it advances: consecutive calls average out (the mean of 100 estimates
    is within 5 standard errors of the exact trace), a reset seed repeats."""
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    exact = LowRankGGN(model, loss_func, (X, y)).gram().trace()
    torch.manual_seed(0)
    traces = torch.stack(
        [
            LowRankGGN(model, loss_func, (X, y), mc_samples=1).gram().trace()
            for _ in range(100)
        ]
    )
    assert traces.unique().numel() > 50  # not the same draws every call
    assert (traces.mean() - exact).abs() <= 5 * traces.std() / 100**0.5
    torch.manual_seed(0)
    first = LowRankGGN(model, loss_func, (X, y), mc_samples=1).gram().trace()
    assert first == traces[0]


def test_misuse():
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    with pytest.raises(InvalidArgumentError, match="yielded no batch"):
        LowRankGGN(model, loss_func, [])
    with pytest.raises(InvalidArgumentError, match="yielded no batch"):
        LowRankGGN(model, loss_func, iter([]))
    with pytest.raises(InvalidArgumentError, match="Batch 1 of the data loader"):
        LowRankGGN(model, loss_func, [(X, y), (X,)])
    with pytest.raises(InvalidArgumentError, match="Batch 2 of the data loader"):
        LowRankGGN(model, loss_func, [(X, y), (X, y), (X.float(), y)])
    with pytest.raises(InvalidTargetsError, match="Batch 0 of the data loader"):
        LowRankGGN(model, loss_func, [(X, y[:2])])
    with pytest.raises(InvalidArgumentError, match="subsampling selects samples"):
        LowRankGGN(model, loss_func, [(X, y)], subsampling=[0])
    with pytest.raises(InvalidArgumentError, match="iterable of such batches"):
        LowRankGGN(model, loss_func, 3)
    # a batch as a dict (iterating it would yield its keys, "got a str")
    with pytest.raises(InvalidArgumentError, match="got a dict with keys"):
        LowRankGGN(model, loss_func, {"x": X, "y": y})
    with pytest.raises(InvalidArgumentError, match="Batch 0 .* got a dict with keys"):
        LowRankGGN(model, loss_func, [{"x": X, "y": y}])


def test_progress_bar(capsys):
    (problem,) = select(architecture="mlp_tanh", loss="mse", reduction="sum")
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [2, 1, 2])
    LowRankGGN(model, loss_func, batches, progress=True)
    assert "LowRankGGN: pass over the data" in capsys.readouterr().err
    # automatic: only on a terminal (the captured stderr is none), never for quick
    # passes; off: nothing; one mini-batch: nothing
    LowRankGGN(model, loss_func, batches)
    LowRankGGN(model, loss_func, batches, progress=False)
    LowRankGGN(model, loss_func, (X, y), progress=True)
    assert capsys.readouterr().err == ""
    with pytest.raises(InvalidArgumentError, match="progress must be True, False"):
        LowRankGGN(model, loss_func, batches, progress="yes")


def test_gradient_samples_count_over_all_batches():
    (problem,) = select(architecture="mlp_relu", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)  # N = 6
    loader = LowRankGGN(model, loss_func, split(X, y, [3, 1, 2]))
    single = LowRankGGN(model, loss_func, (X, y))
    samples = [5, 0, 3]  # batches 2, 0 and 1
    d, d_s = (
        g.directional_derivatives(top_k=2, subsampling_grad=samples)
        for g in (loader, single)
    )
    assert_rel(d.gammas.abs(), d_s.gammas.abs(), DIRECTION_REL)
    assert_rel(d.gamma_bar.abs(), d_s.gamma_bar.abs(), DIRECTION_REL)
    step, step_s = (
        g.newton_step(top_k=2, subsampling_grad=samples) for g in (loader, single)
    )
    for a, b in zip(step, step_s, strict=True):
        assert_rel(a, b, DIRECTION_REL)


class _PerPosition(nn.Module):
    """Per-position classifier of sequences ``[N, T, 3] -> [N, 4, T]``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x):
        return self.linear(x).transpose(1, 2)


@pytest.mark.parametrize("mc_samples", [0, 1])
def test_batches_whose_outputs_differ_in_shape_are_refused(mc_samples):
    """Sequences of another length per batch: each batch's per-sample losses are
    normalized by its own length, so no union of them is the loss on all samples
    (a silently wrong loss, gradient and GGN from StreamingGGN before)."""
    model = _PerPosition().double()
    loss_func = nn.CrossEntropyLoss()
    batches = [
        (torch.randn(3, 4, 3, dtype=torch.float64), torch.randint(0, 4, (3, 4))),
        (torch.randn(2, 6, 3, dtype=torch.float64), torch.randint(0, 4, (2, 6))),
    ]
    match = "Batch 1 .* shape \\(6,\\) per sample, those of batch 0 \\(4,\\)"
    with pytest.raises(InvalidArgumentError, match=match):
        LowRankGGN(model, loss_func, batches, mc_samples=mc_samples, engine="func")
    with pytest.raises(InvalidArgumentError, match=match):
        StreamingGGN(model, loss_func, batches, mc_samples=mc_samples, engine="func")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes: 3.11+")
def test_a_model_error_in_a_batch_names_the_batch():
    """The model's own error keeps its type and gains a note naming the batch."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    batches = [(X[:2], y[:2]), (torch.randn(3, 6), y[2:])]
    with pytest.raises(RuntimeError) as info:
        LowRankGGN(model, torch.nn.CrossEntropyLoss(), batches)
    assert "(in batch 1 of the data loader)" in getattr(info.value, "__notes__", [])


class EndlessBatches(IterableDataset):
    """An infinite stream of the batches of ``(X, y)``, cycling (no ``len``)."""

    def __init__(self, X, y, size):
        self.X, self.y, self.size = X, y, size

    def __iter__(self):
        for start in itertools.cycle(range(0, self.X.shape[0], self.size)):
            yield self.X[start : start + self.size], self.y[start : start + self.size]


class ListedBatches(IterableDataset):
    """The batches of a list, as a dataset without ``len``."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


@pytest.mark.parametrize("front_door", [LowRankGGN, StreamingGGN])
@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize(
    "problem",
    [
        *select(architecture="mlp_tanh", loss="ce", reduction="mean"),
        *select(architecture="cnn", loss="mse", reduction="sum"),
    ],
    ids=str,
)
def test_max_batches_bounds_an_infinite_loader(problem, engine, front_door):
    """``max_batches=B``: the GGN of the loader's first ``B`` batches (issue 19)."""
    model, loss_func, X, y = prepare(problem, torch.float64)  # N = 4 or 5
    loader = DataLoader(EndlessBatches(X, y, 2), batch_size=None)
    ggn = front_door(model, loss_func, loader, engine=engine, max_batches=3)
    first = list(itertools.islice(EndlessBatches(X, y, 2), 3))  # N=4: a repeat
    X3, y3 = (torch.cat(parts) for parts in zip(*first, strict=True))
    assert_leading_match_reference(ggn, model, loss_func, X3, y3)


def test_max_batches_of_a_finite_loader():
    """At most ``len(loader)`` batches are read; the option is checked."""
    (problem,) = select(architecture="mlp_relu", loss="mse", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)  # N = 6
    batches = split(X, y, [2, 2, 2])
    assert_same_ggn(
        LowRankGGN(model, loss_func, batches, max_batches=10),
        LowRankGGN(model, loss_func, (X, y)),
    )
    first = LowRankGGN(model, loss_func, batches, max_batches=1)
    assert first.gram().shape[0] == 2 * 3
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(InvalidArgumentError, match="max_batches must be"):
            LowRankGGN(model, loss_func, batches, max_batches=bad)
        with pytest.raises(InvalidArgumentError, match="max_batches must be"):
            StreamingGGN(model, loss_func, batches, max_batches=bad)


@pytest.mark.parametrize("front_door", [LowRankGGN, StreamingGGN])
def test_unbounded_pass_says_so(front_door, capsys, monkeypatch):
    """A loader without ``len``: the bar (``progress=None``, no terminal) says why.

    A bounded pass on a non-terminal stays silent, as before.
    """
    monkeypatch.setattr(vivit.sources.data, "PROGRESS_DELAY", 0.0)
    (problem,) = select(architecture="mlp_tanh", loss="mse", reduction="sum")
    model, loss_func, X, y = prepare(problem, torch.float64)
    batches = split(X, y, [2, 1, 2])
    front_door(model, loss_func, batches)
    assert capsys.readouterr().err == ""
    endless = DataLoader(EndlessBatches(X, y, 2), batch_size=None)
    front_door(model, loss_func, endless, max_batches=2)
    assert capsys.readouterr().err == ""
    unsized = DataLoader(ListedBatches(batches), batch_size=None)  # finite, no len
    front_door(model, loss_func, unsized)
    assert UNBOUNDED_NOTE in capsys.readouterr().err
