"""The estimate against measured peaks, its parts, the batch search and refusals.

The estimate runs the request on one and two small batches of a copy of the model
and extrapolates (``docs/math.rst``, "Memory of a request"); it must lie within
``ESTIMATE_FACTOR`` of the measured peak either way.
"""

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.fixtures.memory import available
from tests.fixtures.problems import mlp, prepare, select
from tests.memory.measure_memory import run_worker
from vivit import GramTooLargeError, LowRankGGN
from vivit.engines.base import Engine
from vivit.engines.func import FuncEngine
from vivit.errors import (
    BatchNormTrainingError,
    InvalidArgumentError,
    ParamGroupError,
    UnsupportedDtypeError,
)
from vivit.memory import estimate_data_set_memory, estimate_memory, largest_batch
from vivit.memory.plan import ESTIMATE_FACTOR
from vivit.options import CurvatureOptions

LINUX = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc"
)


def _within(result):
    ratio = result["measured"] / result["estimate"]
    return 1 / ESTIMATE_FACTOR <= ratio <= ESTIMATE_FACTOR


@LINUX
def test_estimate_against_measured_peak():
    """Within ESTIMATE_FACTOR either way: both engines, float32 with a float64
    Gram, chunks (down to one sample), loaders and the three Gram solvers, and
    the func engine's forms at the function level."""
    worker = Path(__file__).with_name("measure_memory.py")
    results = {result["request"]: result for result in run_worker(worker)}
    assert len(results) == 22
    for result in results.values():
        assert _within(result), result
    # "auto" is resolved as the run resolves it: LayerNorm has no BackPACK rule
    assert results["layer-norm-mlp-auto"]["engine"] == "func"
    assert results["cnn-loader-func-auto"]["engine"] == "func"
    assert results["tied-transformer-auto"]["engine"] == "func"
    assert results["conv1d-seq-first-auto"]["engine"] == "func"
    # chunks of 16 bound the backward pass of N=128
    whole = results["3c3d-like-factor_krylov"]["measured"]
    assert results["3c3d-like-chunked-factor_krylov"]["measured"] < 0.7 * whole


@LINUX
def test_implicit_estimate_against_measured_peak():
    """The implicit route within ESTIMATE_FACTOR either way, by name and under
    ``solver="auto"`` (a char-LSTM loader and ``gpt2-2l-64-v128``)."""
    worker = Path(__file__).with_name("measure_implicit_memory.py")
    results = {result["request"]: result for result in run_worker(worker)}
    assert len(results) == 5
    for result in results.values():
        assert result["route"] == "implicit", result
        assert _within(result), result


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 5), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 12 * 12, 10)
    )


def test_estimate_parts():
    model, X = mlp(20, 16, 10), torch.randn(2, 20)
    dense = estimate_memory(model, X, 100, top_k=None, solver="dense")
    assert dense.num_rows == 1000 and dense.solve >= 4 * 1000**2 * 4  # Gram, LAPACK
    matrix_free = estimate_memory(model, X, 100, top_k=5, solver="factor_krylov")
    assert matrix_free.solve < dense.solve and matrix_free.total < dense.total
    assert matrix_free.kept == dense.kept > 0 and matrix_free.passes == dense.passes
    mc = estimate_memory(model, X, 100, top_k=5, solver="dense", mc_samples=1)
    assert mc.num_rows == 100
    assert estimate_memory(model, X, 100, num_curvature_samples=10).num_rows == 100
    assert estimate_memory(model, X, 100, top_k=5).solver in (
        "dense",
        "gram_krylov",
        "factor_krylov",
    )
    sizes = [estimate_memory(model, X, n, solver="dense").total for n in (1, 10, 100)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_chunks_bound_the_passes():
    model, X = cnn(), torch.randn(2, 3, 16, 16)
    whole = estimate_memory(model, X, 256, solver="factor_krylov")
    chunked = estimate_memory(model, X, 256, solver="factor_krylov", chunk_size=32)
    assert chunked.passes < whole.passes and chunked.kept == whole.kept
    assert chunked.num_rows == whole.num_rows == 2560
    assert (
        estimate_memory(model, X, 256, solver="factor_krylov", chunk_size=256) == whole
    )
    budget = (whole.total + chunked.total) // 2
    search = {"solver": "factor_krylov", "count_resident": False}
    assert largest_batch(model, X, budget, **search) < 256
    assert largest_batch(model, X, budget, chunk_size=32, **search) >= 256


def test_chunks_never_raise_the_estimate():
    """Merging the chunks copies one parameter at a time, not all of them."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(256, 256), nn.Tanh())]
    model, X = nn.Sequential(*layers, nn.Linear(256, 10)), torch.randn(1, 256)
    totals = [
        estimate_memory(model, X, 512, chunk_size=size, solver="factor_krylov").total
        for size in (None, 64, 1)
    ]
    assert totals == sorted(totals, reverse=True), totals


def test_data_set_estimate():
    """A data set in batches: one batch's pass, every sample's factors."""
    model, X = cnn(), torch.randn(2, 3, 16, 16)
    data_set = estimate_data_set_memory(model, X, 1000, 100, top_k=10, solver="dense")
    chunked = estimate_memory(model, X, 1000, top_k=10, chunk_size=100, solver="dense")
    assert data_set.kept == chunked.kept and data_set.num_rows == 10_000
    assert data_set.passes == chunked.passes and data_set.solve == chunked.solve
    single = estimate_data_set_memory(model, X, 100, 100, top_k=10)
    assert single.total == estimate_memory(model, X, 100, top_k=10).total
    with pytest.raises(ValueError, match="num_samples must be a positive integer"):
        estimate_data_set_memory(model, X, 0, 10)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        estimate_data_set_memory(model, X, 10, 10, chunk_size=0)


def test_largest_batch():
    model, X = mlp(20, 16, 10), torch.randn(2, 20)
    budget = 50 * 2**20
    request = {"top_k": 10, "count_resident": False}
    N = largest_batch(model, X, budget, solver="dense", **request)
    assert estimate_memory(model, X, N, top_k=10, solver="dense").total <= budget
    assert estimate_memory(model, X, N + 1, top_k=10, solver="dense").total > budget
    assert largest_batch(model, X, budget, solver="factor_krylov", **request) > N
    assert largest_batch(model, X, 1, solver="dense", count_resident=False) == 0
    assert largest_batch(model, X, 2**60, max_batch_size=1000) == 1000


def test_largest_batch_counts_what_the_process_holds(monkeypatch):
    """A budget is for the process: 80 MiB with 30 MiB held leaves 50 MiB; no
    budget is what the process can still allocate."""
    import vivit.memory.estimate as estimate_module

    model, X = mlp(20, 16, 10), torch.randn(2, 20)
    request = {"top_k": 10, "solver": "dense"}
    alone = largest_batch(model, X, 50 * 2**20, count_resident=False, **request)
    assert 0 < alone < largest_batch(model, X, 80 * 2**20, count_resident=False)
    monkeypatch.setattr(estimate_module, "resident_bytes", lambda d: 30 * 2**20)
    assert largest_batch(model, X, 80 * 2**20, **request) == alone
    assert largest_batch(model, X, 20 * 2**20, **request) == 0
    available(monkeypatch, 50 * 2**20)
    assert largest_batch(model, X, **request) == alone


def test_options_by_the_runs_names():
    """The run's options by their names, checked by CurvatureOptions."""
    model, X = mlp(20, 16, 10), torch.randn(2, 20)
    single = estimate_memory(model, X, 100, top_k=10, solver="dense")
    double = estimate_memory(
        model, X, 100, top_k=10, solver="dense", gram_dtype=torch.float64
    )
    assert double.solve == 2 * single.solve
    assert double.kept > single.kept  # the factors cast to float64
    options = CurvatureOptions(solver="dense", gram_dtype=torch.float64)
    assert estimate_memory(model, X, 100, top_k=10, options=options) == double
    assert (
        estimate_memory(model, X, 100, options=options, gram_dtype=None, top_k=10)
        == single
    )
    subsampled = estimate_memory(model, X, 100, subsampling=list(range(10)))
    assert subsampled == estimate_memory(model, X, 100, num_curvature_samples=10)
    with pytest.raises(InvalidArgumentError, match="gram_dtype must be None"):
        estimate_memory(model, X, 100, gram_dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match="engine must be one of"):
        estimate_memory(model, X, 100, engine="jax")
    with pytest.raises(InvalidArgumentError, match=r"Unknown option\(s\) \['chunks'\]"):
        estimate_memory(model, X, 100, chunks=4)
    with pytest.raises(InvalidArgumentError, match="not both"):
        estimate_memory(model, X, 100, subsampling=[0], num_curvature_samples=1)
    with pytest.raises(InvalidArgumentError, match="subsampling"):
        largest_batch(model, X, 2**30, subsampling=[0])
    with pytest.raises(InvalidArgumentError, match="a data loader takes none"):
        estimate_data_set_memory(model, X, 100, 10, subsampling=[0])


def test_engine_is_the_one_the_run_resolves():
    """``engine="auto"`` as the run resolves it."""
    model, X = cnn(), torch.randn(2, 3, 16, 16)
    backpack = estimate_memory(model, X, 64, solver="factor_krylov")
    func = estimate_memory(model, X, 64, solver="factor_krylov", engine="func")
    assert (backpack.engine, func.engine) == ("backpack", "func")
    assert func.kept > backpack.kept
    norm = nn.Sequential(nn.Linear(20, 16), nn.LayerNorm(16), nn.Linear(16, 10))
    inputs, targets = torch.randn(8, 20), torch.randint(0, 10, (8,))
    estimate = estimate_memory(norm, inputs[:1], 8, loss_func=nn.CrossEntropyLoss())
    ggn = LowRankGGN(norm, nn.CrossEntropyLoss(), (inputs, targets))
    assert estimate.engine == ggn.engine == "func"


class Doubling(Engine):
    """An engine of the tests: the func engine's factors, and a copy of them kept.

    The memory code knows nothing of it; its estimate is measured all the same.
    """

    name = "doubling"

    def __init__(self):
        self.kept = []
        self.func = FuncEngine()

    def run(self, model, loss_func, data, request, sink):
        kept = self.kept

        class Copying:
            def add(self, param, contribution):
                kept.append([t.clone() for t in contribution.ggn.tensors()])
                sink.add(param, contribution)

        return self.func.run(model, loss_func, data, request, Copying())


def test_an_engine_the_memory_code_does_not_know_is_estimated():
    """A new engine needs no change in the memory code: its own pass (here
    keeping a second copy of every factor) is measured, not modelled."""
    model, X = mlp(20, 16, 10), torch.randn(4, 20)
    func = estimate_memory(model, X, 64, solver="factor_krylov", engine="func")
    doubling = estimate_memory(model, X, 64, solver="factor_krylov", engine=Doubling())
    assert doubling.engine == "doubling"
    ggn_factors = 64 * (20 + 10 * 16 + 16 + 10 * 10 + 10) * 4  # V's entries
    assert doubling.passes - func.passes >= ggn_factors


def test_estimator_leaves_backpack_inputs_alone():
    """The estimate runs a copy: what BackPACK stored on the model stays."""
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    loss = loss_func(model(X), y)
    stored = model[0].input0
    estimate_memory(model, X[:1], 5)
    assert model[0].input0 is stored
    ggn = LowRankGGN.from_loss(loss, [list(model.parameters())])
    assert ggn.gram().shape == (15, 15)


def test_the_estimate_leaves_the_model_its_hooks_and_generators_alone():
    """The request runs on a copy: no hook of the caller fires, no buffer or
    random state changes (the Monte-Carlo samples are drawn on the copy)."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).eval()
    fired, inputs = [], torch.randn(1, 4)
    model[0].register_forward_hook(lambda *args: fired.append(1))
    model[2].weight.register_hook(lambda grad: fired.append(2))  # a tensor hook
    model[2].weight.register_post_accumulate_grad_hook(lambda p: fired.append(3))
    state = torch.get_rng_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate_memory(model, inputs, 8, mc_samples=1)
    assert torch.equal(state, torch.get_rng_state()) and not fired
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_misuse():
    model, X = mlp(20, 16, 10), torch.randn(2, 20)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        estimate_memory(model, X, 0)
    with pytest.raises(ValueError, match="solver must be one of"):
        estimate_memory(model, X, 10, solver="eig")
    with pytest.raises(ValueError, match="pass top_k"):
        estimate_memory(model, X, 10, top_k=None, solver="gram_krylov")
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        estimate_memory(model, X, 10, chunk_size=-1)
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        largest_batch(model, X, 0)
    with pytest.raises(ValueError, match="num_curvature_samples"):
        largest_batch(model, X, 2**30, num_curvature_samples=4)


def test_refusal_uses_the_solver(monkeypatch):
    """A Gram matrix that does not fit is refused; matrix-free needs none."""
    problem = select(architecture="cnn", loss="ce", reduction="sum")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    square = (problem.batch_size * problem.num_outputs) ** 2 * 8
    ggn = LowRankGGN(model, loss_func, (X, y))
    available(monkeypatch, square // 2)
    with pytest.raises(GramTooLargeError, match="solver='factor_krylov'"):
        ggn.eigh(top_k=2, solver="dense")
    with pytest.raises(GramTooLargeError):
        ggn.eigvalsh()
    evals, _ = ggn.eigh(top_k=2)  # auto: the Gram does not fit → matrix-free
    assert ggn.solver_report().solver == "factor_krylov"
    assert evals.numel() == 2


@pytest.mark.parametrize(
    "widths, input_shape, batch_size, request_kwargs",
    [
        ((784, 128, 64, 10), (784,), 128, {}),
        ((784, 128, 64, 10), (784,), 512, {}),
        ((784, 128, 64, 10), (784,), 512, {"mc_samples": 1}),
        (None, (3, 16, 16), 64, {}),
    ],
    ids=["mlp-128", "mlp-512", "mlp-512-mc", "cnn-64"],
)
def test_auto_estimates_the_solver_the_request_runs(
    monkeypatch, widths, input_shape, batch_size, request_kwargs
):
    """Under "auto" the estimate is for the solver LowRankGGN's eigh chooses."""
    available(monkeypatch, 2**40)
    model = cnn() if widths is None else mlp(*widths, activation=nn.ReLU)
    X = torch.randn(batch_size, *input_shape)
    y = torch.randint(0, 10, (batch_size,))
    estimate = estimate_memory(model, X[:1], batch_size, top_k=10, **request_kwargs)
    ggn = LowRankGGN(model, nn.CrossEntropyLoss(), (X, y), **request_kwargs)
    ggn.eigh(top_k=10)
    assert estimate.solver == ggn.solver_report().solver


def test_auto_estimates_the_solver_of_a_loader(monkeypatch):
    available(monkeypatch, 2**40)
    model = mlp(784, 128, 64, 10, activation=nn.ReLU)
    X, y = torch.randn(512, 784), torch.randint(0, 10, (512,))
    loader = [(X[i : i + 96], y[i : i + 96]) for i in range(0, 512, 96)]
    estimate = estimate_data_set_memory(model, X[:1], 512, 96, top_k=10)
    ggn = LowRankGGN(model, nn.CrossEntropyLoss(), loader)
    ggn.eigh(top_k=10)
    assert estimate.solver == ggn.solver_report().solver


def test_refuses_malformed_requests():
    """Each of these gave a wrong number or a bare Python error."""
    model, X = mlp(20, 16, 10), torch.randn(1, 20)
    for inputs in (X[:0], torch.tensor(1.0)):  # no samples
        with pytest.raises(InvalidArgumentError, match="at least one sample"):
            estimate_memory(model, inputs, 8)
    with pytest.raises(InvalidArgumentError, match="example_inputs must be a tensor"):
        estimate_memory(model, X.tolist(), 8)
    with pytest.raises(InvalidArgumentError, match="exceeds the batch_size=8"):
        estimate_memory(model, X, 8, num_curvature_samples=100)
    for samples in (-3, 0, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="num_curvature_samples must"):
            estimate_memory(model, X, 8, num_curvature_samples=samples)
    params = list(model.parameters())
    for groups, message in [
        (params, "flat list"),
        ([], "param_groups is empty"),
        ([[]], "Group 0 has no parameters"),
        ([params[:1], params[:1]], "occurs in more than"),
        ([[torch.zeros(3, requires_grad=True)]], "not a parameter of the model"),
    ]:
        with pytest.raises(ParamGroupError, match=message):
            estimate_memory(model, X, 8, param_groups=groups)
        with pytest.raises(ParamGroupError, match=message):
            LowRankGGN(
                model, nn.MSELoss(), (X, torch.randn(1, 10)), param_groups=groups
            )
    with pytest.raises(ParamGroupError, match="no parameter that requires gradients"):
        estimate_memory(mlp(20, 16, 10).requires_grad_(False), X, 8)
    with pytest.raises(UnsupportedDtypeError, match="float16"):
        estimate_memory(nn.Linear(20, 5).half(), X.half(), 8)
    with pytest.raises(InvalidArgumentError, match="torch.nn.Module"):
        estimate_memory(lambda x: x, X, 8)


def test_refuses_batch_norm_in_training_mode():
    """As a request does; the copy would not touch the running statistics."""
    model = nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.Linear(16, 5))
    running_mean = model[1].running_mean.clone()
    with pytest.raises(BatchNormTrainingError, match="model.eval()"):
        estimate_memory(model, torch.randn(4, 20) + 5, 8)
    assert torch.equal(model[1].running_mean, running_mean)
    model.eval()
    assert estimate_memory(model, torch.randn(4, 20) + 5, 8).num_rows == 40


def test_meta_models_are_estimated_and_refused_by_the_computation():
    """A model on the meta device has shapes only: enough for an estimate (its
    copy is made on the CPU), not for a GGN (a clear error)."""
    model = mlp(6, 5, 3)
    inputs = torch.randn(1, 6)
    real = estimate_memory(model, inputs, 64)
    meta_model = mlp(6, 5, 3).to("meta")
    state = torch.get_rng_state()
    meta = estimate_memory(meta_model, inputs.to("meta"), 64)
    assert torch.equal(state, torch.get_rng_state())  # values drawn on a fork
    for part in ("passes", "kept", "solver", "num_rows"):
        assert getattr(meta, part) == getattr(real, part), part
    targets = torch.randint(0, 3, (4,))
    with pytest.raises(InvalidArgumentError, match="meta device"):
        LowRankGGN(
            meta_model, torch.nn.CrossEntropyLoss(), (torch.randn(4, 6), targets)
        )
