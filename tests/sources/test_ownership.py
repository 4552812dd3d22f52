"""No result depends on a tensor the caller can still change (issue 19).

Every result of a ``LowRankGGN`` is computed after construction from the kept
factors of ``V``. With the BackPACK engine the first Linear layer's kept input is
the caller's inputs themselves (or a view: a chunk, a reshape); an in-place
change of the inputs, the targets, the parameters or the buffers after
construction must change nothing (:mod:`vivit.sources.ownership`). Each test
builds the GGN, builds a pristine twin on copies, changes every caller tensor in
place, and compares every result with the twin (the same computation on the same
numbers: equal to rounding, ``1e-10`` relative, measured 0) and with the dense
float64 reference of the original numbers (``tests/fixtures/checks.py``; the
eigenvalue bound of ``docs/math.rst``, "Precision and the numerical zero"). An
aliased factor changes the eigenvalues by O(1) (measured 106–121 % on the
reported MLP).

``StreamingGGN`` keeps no factors; it re-reads the loader in every pass and
refuses a changed batch or model by name.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.fixtures.checks import EIGVAL_RTOL, assert_rel, assert_top_eigvals
from tests.fixtures.problems import prepare, select
from tests.fixtures.reference import dense_ggn, dense_gradient, flatten_params
from vivit import (
    LowRankGGN,
    ModelChangedError,
    NondeterministicDataError,
    StreamingGGN,
)

REL = 1e-10
PROBLEMS = [
    *select(architecture="mlp_tanh", loss="ce", reduction="mean"),
    *select(architecture="mlp_relu", loss="mse", reduction="sum"),
    *select(architecture="sequence_linear", loss="ce", reduction="sum"),
    *select(architecture="cnn", loss="mse", reduction="mean"),
    *select(architecture="batchnorm1d", loss="ce", reduction="mean"),
]
#: How the samples reach the engine: (LowRankGGN options, data as a loader).
PATHS = {
    "batch": ({}, False),
    "chunks": ({"chunk_size": 2}, False),
    "one-chunk": ({"chunk_size": 100}, False),
    "subsampling": ({"subsampling": [3, 0, 2]}, False),
    "chunks-subsampling": ({"chunk_size": 2, "subsampling": [3, 0, 2]}, False),
    "loader": ({}, True),
    "one-batch-loader": ({}, "one"),
    "monte-carlo": ({"mc_samples": 2}, False),
}


def _mutate(model, inputs, targets):
    """Change every tensor the caller owns, in place."""
    with torch.no_grad():
        inputs.mul_(-3.0).add_(1.0)
        if targets.is_floating_point():
            targets.mul_(5.0)
        else:
            targets.copy_((targets + 1) % 3)
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point():
                tensor.mul_(1.5).add_(0.25)


def _data(inputs, targets, loader):
    if not loader:
        return inputs, targets
    if loader == "one":
        return [(inputs, targets)]
    return list(zip(inputs.split(2), targets.split(2), strict=True))


def _results(ggn: LowRankGGN) -> dict:
    """Every result of a GGN (its tensors), computed now."""
    evals, evecs = ggn.eigh(top_k=2, solver="factor_krylov")
    directional = ggn.directional_derivatives(top_k=2, solver="dense")
    vector = [torch.ones_like(p) for p in ggn.param_groups[0]]
    return {
        "gram": ggn.gram(),
        "eigvalsh": ggn.eigvalsh(),
        "evals": evals,
        "evecs": evecs,
        "gammas": directional.gammas,
        "lambdas": directional.lambdas,
        "newton": ggn.newton_step(top_k=2, solver="gram_krylov"),
        "newton-all": ggn.newton_step(),
        "operator": ggn.operator().matvec(vector),
        "gradient": ggn.gradient(),
        "loss": ggn.loss,
    }


def _assert_same(results: dict, twin: dict) -> None:
    for name, value in results.items():
        values = value if isinstance(value, list) else [value]
        twins = twin[name] if isinstance(value, list) else [twin[name]]
        for a, b in zip(values, twins, strict=True):
            # eigenvectors up to sign
            b = b * torch.sign((a * b).sum()) if name == "evecs" else b
            assert_rel(a, b, REL)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_results_ignore_in_place_changes(problem, engine, path):
    """Inputs, targets, parameters and buffers changed after construction."""
    options, loader = PATHS[path]
    model, loss_func, X, y = prepare(problem)
    X, y = X[:4], y[:4]  # every architecture: 4 samples (two batches of two)
    model_copy = copy.deepcopy(model)
    X0, y0 = X.clone(), y.clone()
    generator = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    if options.get("mc_samples"):
        options = {**options, "generator": generator()}
    ggn = LowRankGGN(model, loss_func, _data(X, y, loader), engine=engine, **options)
    if options.get("mc_samples"):
        options = {**options, "generator": generator()}
    twin = LowRankGGN(
        model_copy,
        loss_func,
        _data(X0.clone(), y0.clone(), loader),
        engine=engine,
        **options,
    )
    _mutate(model, X, y)
    results, expected = _results(ggn), _results(twin)
    _assert_same(results, expected)
    if options.get("mc_samples"):
        return
    G = dense_ggn(model_copy, loss_func, X0, y0, subsampling=options.get("subsampling"))
    assert_top_eigvals(
        results["eigvalsh"], torch.linalg.eigvalsh(G), EIGVAL_RTOL[X.dtype]
    )
    g = dense_gradient(model_copy, loss_func, X0, y0)
    assert_rel(flatten_params(results["gradient"]), g, REL)


def _factor_storages(ggn: LowRankGGN) -> dict[int, int]:
    """Bytes of every distinct memory the kept factors hold, by address."""
    storages = {}
    for group in range(len(ggn.param_groups)):
        curvature = ggn._group(group)
        for factor in (*curvature.ggn_factors, *curvature.grad_factors):
            for tensor in factor.tensors():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return storages


@pytest.mark.parametrize("path", ["batch", "chunks", "subsampling"])
def test_inputs_copied_at_most_once(path):
    """The memory cost: one copy of the inputs, shared by ``V`` and the gradients.

    The first Linear layer of the MLP keeps the inputs in its factors of ``V``
    and of the per-sample gradients; they share one copy (``batch``); the
    subsampling's ``V`` keeps its own selection (a copy made by the engine) and
    the gradients one copy; chunks are concatenated into a copy when merged, and
    copied no second time.
    """
    options, _ = PATHS[path]
    model, loss_func, X, y = prepare(select(architecture="mlp_tanh")[0])
    caller = {t.untyped_storage().data_ptr() for t in (X, y, *model.parameters())}
    ggn = LowRankGGN(model, loss_func, (X, y), engine="backpack", **options)
    storages = _factor_storages(ggn)
    assert not caller & storages.keys()
    input_sized = [n for n in storages.values() if n == X.untyped_storage().nbytes()]
    assert len(input_sized) == 1


@pytest.mark.parametrize("problem", PROBLEMS[:3], ids=lambda p: p.name)
def test_from_loss_ignores_in_place_changes(problem):
    """A loss computed elsewhere: the inputs are unknown, every factor is copied."""
    model, loss_func, X, y = prepare(problem)
    model_copy = copy.deepcopy(model)
    X0, y0 = X.clone(), y.clone()
    ggn = LowRankGGN.from_loss(
        lambda: loss_func(model(X), y), [list(model.parameters())]
    )
    twin = LowRankGGN.from_loss(
        lambda: loss_func(model_copy(X0), y0), [list(model_copy.parameters())]
    )
    _mutate(model, X, y)
    results = _results(ggn)
    _assert_same(results, _results(twin))
    G = dense_ggn(model_copy, loss_func, X0, y0)
    assert_top_eigvals(
        results["eigvalsh"], torch.linalg.eigvalsh(G), EIGVAL_RTOL[X.dtype]
    )


@pytest.mark.parametrize("engine", ["backpack", "func"])
def test_streaming_refuses_changed_data_or_model(engine):
    """StreamingGGN re-reads the loader: a change is refused by name, not used."""
    model, loss_func, X, y = prepare(select(architecture="mlp_tanh")[0])
    loader = [(X[:2], y[:2]), (X[2:], y[2:])]
    ggn = StreamingGGN(model, loss_func, loader, engine=engine)
    X.mul_(2.0)
    with pytest.raises(
        NondeterministicDataError, match="changed in place since pass 1"
    ):
        ggn.eigh(top_k=2)
    X.div_(2.0)
    ggn.eigh(top_k=2)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    with pytest.raises(ModelChangedError):
        ggn.eigh(top_k=3)  # a new request: a pass


@pytest.mark.parametrize("engine", ["backpack", "func"])
@pytest.mark.parametrize("problem", PROBLEMS[:2], ids=lambda p: p.name)
def test_loader_that_refills_one_buffer(problem, engine):
    """A loader that writes every batch into the same tensors (a reused buffer)."""
    model, loss_func, X, y = prepare(problem, torch.float64)
    half = X.shape[0] // 2
    buffer_x, buffer_y = X[:half].clone(), y[:half].clone()

    def refilled():
        for start in (0, half):
            buffer_x.copy_(X[start : start + half])
            buffer_y.copy_(y[start : start + half])
            yield buffer_x, buffer_y

    ggn = LowRankGGN(model, loss_func, refilled(), engine=engine)
    G = dense_ggn(model, loss_func, X[: 2 * half], y[: 2 * half])
    assert_top_eigvals(
        ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
    )
