"""The func engine against dense float64 references and against the BackPACK engine.

References (``tests/fixtures/reference.py``) use only ``torch.func`` on the whole batch,
independently of both engines: the dense GGN ``G = R Σ_n J_nᵀ H_n J_n``, per-sample
gradients ``∇ℓ_n`` and per-sample GGNs ``G_n`` (``docs/math.rst``, "Ground truth
for tests"). Directions are the engine's own eigenvectors, certified by their
residual against the dense GGN; γ, λ and Newton steps are then compared with the
dense formulas along them (``docs/math.rst``, "Directional derivatives", "Damped
Newton step").

Tolerances (float64, ε ≈ 2.2e-16, D ≤ 200, Gram side ≤ 60): eigenvalues within
1e-10·λ_max and residuals within their bound N·C·ε·λ_max·√(λ_max/λ) (``docs/math.rst``,
"Tolerances of the tests"; ``tests/fixtures/checks.py``); γ, λ and steps within
1e-10 of the largest reference entry. The errors of the Gram eigendecomposition and of
the products stay around 1e-13 relative, while a wrong scale (R, √R, N, C), a missing
sample, a dropped use of a shared weight or a missing cross term is an O(1) error.
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from torch import nn

from tests.fixtures.checks import (
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    align_signs,
    assert_differs,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    flat_evecs,
    layer_groups,
)
from tests.fixtures.func_problems import FUNC_PROBLEMS, PADDED_PROBLEMS, TwiceLinear
from tests.fixtures.per_sample import Reference, per_sample_reference
from tests.fixtures.problems import PROBLEMS, prepare, problem_ids
from tests.fixtures.recurrent_problems import RECURRENT_PROBLEMS
from tests.fixtures.reference import (
    dense_ggn,
    dense_gradient,
    reduction_factor,
)
from vivit import LowRankGGN, SampleCouplingError
from vivit.engines.func import FuncEngine
from vivit.engines.func.vjp import BatchedVJP
from vivit.errors import BatchNormTrainingError, UnsupportedLayerError
from vivit.gram import OuterProductFactors
from vivit.optim import DampedNewton

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:Using padding='same' with even kernel:UserWarning"
    ),
]

REL = EIGVEC_PRODUCT_REL
TOP_K = 3
ALL_FUNC_PROBLEMS = FUNC_PROBLEMS + PADDED_PROBLEMS + RECURRENT_PROBLEMS


@functools.cache
def func_reference(name: str) -> Reference:
    """The per-sample references of the func problem ``name``."""
    (problem,) = [p for p in ALL_FUNC_PROBLEMS if p.name == name]
    return per_sample_reference(problem.setup())


# ----------------------------------------------------------------------------------
# Models BackPACK cannot extend
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [p.name for p in ALL_FUNC_PROBLEMS])
@pytest.mark.parametrize("subsampling", [None, [2, 0]], ids=["full", "subsampled"])
def test_func_problem(name, subsampling):
    """Eigenpairs, γ, λ and the Newton step through engine='auto', without extend."""
    ref = func_reference(name)
    model, loss_func, X, y = ref.setup
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=subsampling)
    assert ggn.engine == "func"
    G = ref.ggn(subsampling)
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(G), REL)
    evals, evecs = ggn.eigh()
    assert_eigenpairs(evals, evecs, G, ggn.eigvalsh().numel())

    top, top_evecs = ggn.eigh(top_k=TOP_K)
    E = flat_evecs(top_evecs)
    grad_samples = [1, 2, 0]
    dd = ggn.directional_derivatives(top_k=TOP_K, subsampling_grad=grad_samples)
    gammas = ref.gammas(E, grad_samples)
    assert_rel(align_signs(dd.gammas, gammas), gammas)
    assert_rel(dd.lambdas, ref.lambdas(E, subsampling))

    step = ggn.newton_step(top_k=TOP_K, damping=0.3, subsampling_grad=grad_samples)
    expected, _ = ref.newton_step(top, E, 0.3, grad_samples)
    actual = torch.cat([s.flatten() for s in step])
    assert (actual - expected).norm() <= REL * expected.norm()
    assert_rel(torch.cat([g.flatten() for g in ggn.gradient()]), ref.gradient)


@pytest.mark.parametrize("name", ["transformer-ce-mean", "lstm-ce-sum"])
def test_func_parameter_groups(name):
    """One block per layer: each group's eigenpairs are those of its GGN block."""
    ref = func_reference(name)
    model, loss_func, X, y = ref.setup
    groups = layer_groups(model)
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=groups, engine="func")
    for index, group in enumerate(groups):
        G = dense_ggn(model, loss_func, X, y, params=group)
        assert_top_eigvals(ggn.eigvalsh(index), torch.linalg.eigvalsh(G), REL)
        evals, evecs = ggn.eigh(group=index)
        assert_eigenpairs(evals, evecs, G, ggn.eigvalsh(index).numel())


def test_shared_linear_keeps_factor_form():
    """A Linear applied twice keeps its factor form, with both uses stacked."""
    model, loss_func, X, y = func_reference("twice-mse-mean").setup
    ggn = LowRankGGN(model, loss_func, (X, y), engine="func")
    weight_factors = ggn._group(0).ggn_factors[0]
    assert isinstance(weight_factors, OuterProductFactors)
    assert weight_factors._T == 2  # one position per use


def test_batch_norm_keeps_factor_form(monkeypatch):
    """BatchNorm's columns come from the vectors at its output: no parameter is
    left to the explicit one-sample-at-a-time pass, the batch runs in one chunk
    (test_func_problem checks the columns against the dense GGN)."""
    explicit = []
    vectors_per_pass = FuncEngine._vectors_per_pass

    def spy(self, samples, width, dense):
        explicit.append(dense)
        return vectors_per_pass(self, samples, width, dense)

    monkeypatch.setattr(FuncEngine, "_vectors_per_pass", spy)
    model, loss_func, X, y = func_reference("resnet-block-ce-mean").setup
    ggn = LowRankGGN(model, loss_func, (X, y), mc_samples=1, engine="func")
    assert ggn.gram().shape == (len(X), len(X))
    assert explicit and not any(explicit)


@pytest.mark.parametrize("name", ["transformer-mse-sum", "twice-bce-sum"])
def test_chunks_give_the_same_result(name):
    """A tiny memory budget (one sample, one vector at a time) changes nothing."""
    model, loss_func, X, y = func_reference(name).setup
    whole = LowRankGGN(model, loss_func, (X, y), engine="func")
    chunked = LowRankGGN(model, loss_func, (X, y), engine=FuncEngine(memory_budget=1))
    assert_rel(chunked.gram(), whole.gram(), REORDERED_REL)
    assert_rel(
        chunked.directional_derivatives().gammas, whole.directional_derivatives().gammas
    )


# ----------------------------------------------------------------------------------
# The registry through "func", and against "backpack"
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_registry_func_matches_dense_and_backpack(problem):
    """Exact eigenpairs through func; the same γ, λ and Newton steps as BackPACK."""
    model, loss_func, X, y = prepare(problem, torch.float64)
    subsampling = [0, 2, 3]
    func = LowRankGGN(model, loss_func, (X, y), subsampling=subsampling, engine="func")
    G = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    evals, evecs = func.eigh()
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), REL)
    assert_eigenpairs(evals, evecs, G, func.eigvalsh().numel())

    bp = LowRankGGN(
        model, loss_func, (X, y), subsampling=subsampling, engine="backpack"
    )
    assert bp.engine == "backpack"
    assert_top_eigvals(func.eigvalsh(), bp.eigvalsh(), REL)
    func_dd = func.directional_derivatives(top_k=TOP_K, subsampling_grad=[3, 1])
    bp_dd = bp.directional_derivatives(top_k=TOP_K, subsampling_grad=[3, 1])
    assert_rel(func_dd.evals, bp_dd.evals)
    assert_rel(func_dd.lambdas, bp_dd.lambdas)
    assert_rel(align_signs(func_dd.gammas, bp_dd.gammas), bp_dd.gammas)
    func_step = torch.cat([s.flatten() for s in func.newton_step(top_k=TOP_K)])
    bp_step = torch.cat([s.flatten() for s in bp.newton_step(top_k=TOP_K)])
    assert (func_step - bp_step).norm() <= REL * bp_step.norm()


# ----------------------------------------------------------------------------------
# Engine choice and what the caller keeps
# ----------------------------------------------------------------------------------


def test_auto_logs_its_choice(caplog):
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64, extend=False)
    with caplog.at_level(logging.INFO, logger="vivit"):
        assert LowRankGGN(model, loss_func, (X, y)).engine == "backpack"
    assert "using 'backpack'" in caplog.text
    shared = nn.Linear(4, 4).double()
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 3)).double()
    with caplog.at_level(logging.INFO, logger="vivit"):
        assert LowRankGGN(model, loss_func, (X, y)).engine == "func"
    assert "used 2 times in one forward pass" in caplog.text
    model, loss_func, X, y = func_reference("transformer-ce-mean").setup
    with caplog.at_level(logging.INFO, logger="vivit"):
        assert LowRankGGN(model, loss_func, (X, y)).engine == "func"


def test_func_leaves_model_as_it_was():
    """No hooks, no changed .grad or parameters; torch.func still works on it."""
    model, loss_func, X, y = func_reference("transformer-ce-mean").setup
    params = [p.detach().clone() for p in model.parameters()]
    model.head.weight.grad = torch.ones_like(model.head.weight)
    LowRankGGN(model, loss_func, (X, y), engine="func")
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks
    assert (model.head.weight.grad == 1).all()
    assert all(
        p.grad is None for n, p in model.named_parameters() if n != "head.weight"
    )
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    dense_gradient(model, loss_func, X, y)  # torch.func on the same modules


# ----------------------------------------------------------------------------------
# Refused input
# ----------------------------------------------------------------------------------


class Centered(nn.Module):
    """Subtracts the batch mean: every output depends on every sample."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Noisy(nn.Module):
    """Adds fresh noise in every forward pass."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


@pytest.mark.parametrize(
    "layer, error",
    [
        (nn.BatchNorm1d(4).train(), BatchNormTrainingError),
        (nn.Dropout(0.5).train(), SampleCouplingError),
        (Centered(), SampleCouplingError),
        (Noisy(), SampleCouplingError),
    ],
    ids=["batchnorm-train", "dropout-train", "batch-mean", "noise"],
)
def test_coupled_or_random_models_are_refused(layer, error):
    model = nn.Sequential(nn.Linear(3, 4), layer, nn.Linear(4, 2)).double()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    with pytest.raises(error, match="model.eval()|mix"):
        LowRankGGN(model, nn.CrossEntropyLoss(), (X, y), engine="func")


def test_unsupported_loss_and_engine_are_refused():
    model = TwiceLinear().double()
    X, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="NLLLoss is not supported"):
        LowRankGGN(model, nn.NLLLoss(), (X, y), engine="func")
    with pytest.raises(ValueError, match="engine must be one of"):
        LowRankGGN(model, nn.CrossEntropyLoss(), (X, y), engine="jax")
    with pytest.raises(ValueError, match="memory_budget must be a positive int"):
        FuncEngine(memory_budget=0)


class ShapeDependent(nn.Module):
    """Uses another Linear layer for small batches (control flow on the data)."""

    def __init__(self):
        super().__init__()
        self.large, self.small = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x):
        return self.large(x) if len(x) > 2 else self.small(x)


def test_chunk_dependent_computation_is_refused_with_a_vivit_error():
    """Chunks that use different layers: a VivitError (it was a bare RuntimeError)."""
    torch.manual_seed(0)
    model = ShapeDependent().double()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    LowRankGGN(model, nn.CrossEntropyLoss(), (X, y), engine="func")  # one chunk
    with pytest.raises(UnsupportedLayerError, match="larger memory_budget"):
        LowRankGGN(
            model,
            nn.CrossEntropyLoss(),
            (X, y),
            engine=FuncEngine(memory_budget=1),
        )


# ----------------------------------------------------------------------------------
# Monte-Carlo GGN
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, mc_samples",
    [("lstm-ce-mean", 2), ("twice-bce-sum", 1), ("resnet-block-ce-mean", 1)],
)
def test_func_mc_unbiased(name, mc_samples):
    """tr(VᵀV) = tr(G^MC) is an unbiased estimate of tr(G); γ and R Σ_n λ_nk exact."""
    ref = func_reference(name)
    model, loss_func, X, y = ref.setup
    gen = torch.Generator().manual_seed(0)
    runs = 150
    ggns = [
        LowRankGGN(
            model,
            loss_func,
            (X, y),
            mc_samples=mc_samples,
            mc_per="sequence",  # N·M columns; per token: tests/losses/test_sequences.py
            generator=gen,
            engine="func",
        )
        for _ in range(runs)
    ]
    traces = torch.stack([ggn.gram().trace() for ggn in ggns])
    exact = ref.ggn().trace()
    standard_error = traces.std() / runs**0.5
    # 4 standard errors: a false alarm has p < 1e-4 (and the seed fixes the outcome)
    assert (traces.mean() - exact).abs() <= 4 * standard_error
    assert 4 * standard_error < 0.5 * exact  # narrower than a factor-2 error
    # one MC draw is not the exact trace: apart by more than reordered sums
    assert_differs(traces[0], exact, REORDERED_REL)

    ggn = ggns[0]
    assert ggn.gram().shape == (len(X) * mc_samples,) * 2
    evals, evecs = ggn.eigh()
    dd = ggn.directional_derivatives()
    R = reduction_factor(loss_func, len(X))
    assert_rel(R * dd.lambdas.sum(0), evals)
    gammas = ref.gammas(flat_evecs(evecs))
    assert_rel(align_signs(dd.gammas, gammas), gammas)


# ----------------------------------------------------------------------------------
# DampedNewton with the model and loss function
# ----------------------------------------------------------------------------------


def test_damped_newton_step_with_data():
    """step(data=...) applies lr·Δθ of the func engine's Newton step (dense-checked
    in test_func_problem), on an LSTM that needs no extend."""
    ref = func_reference("lstm-ce-sum")
    model, loss_func, X, y = ref.setup
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    step = LowRankGGN(model, loss_func, (X, y), engine="func").newton_step(
        top_k=TOP_K, damping=0.5
    )
    optimizer = DampedNewton(
        model.parameters(),
        lr=0.3,
        damping=0.5,
        top_k=TOP_K,
        model=model,
        loss_func=loss_func,
        engine="func",
    )
    loss = optimizer.step(data=(X, y))
    # the loss of the weights before the step, summed in the engine's order
    assert_rel(loss, loss_func(ref.setup.model(X), y).detach(), REORDERED_REL)
    for p, p0, s in zip(model.parameters(), before, step, strict=True):
        assert_rel(p.detach() - p0, 0.3 * s)


def test_damped_newton_refuses_closure_for_func():
    model, loss_func, X, y = func_reference("twice-mse-mean").setup
    optimizer = DampedNewton(model.parameters(), engine="func")
    with pytest.raises(ValueError, match="model= and loss_func="):
        optimizer.step(lambda: loss_func(model(X), y))
    with pytest.raises(ValueError, match="needs the model"):
        optimizer.step(data=(X, y))
    with pytest.raises(ValueError, match="both model and loss_func"):
        DampedNewton(model.parameters(), model=model)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(2, 3, 2, padding="same"),
        nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="reflect"),
        nn.Conv1d(2, 4, 3, padding=2, padding_mode="circular", dilation=2, groups=2),
        nn.Conv3d(2, 2, 2, padding=1, padding_mode="replicate"),
    ],
    ids=["same-even-kernel", "reflect-stride", "circular-groups-1d", "replicate-3d"],
)
def test_convolution_padding_modes(conv):
    """Factor forms of convolutions with every padding mode, against dense."""
    torch.manual_seed(0)
    spatial = {nn.Conv1d: (5,), nn.Conv2d: (4, 4), nn.Conv3d: (3, 3, 3)}[type(conv)]
    X = torch.randn(3, 2, *spatial, dtype=torch.float64)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten()).double()
    model.append(nn.Linear(model(X).shape[1], 2).double())
    y = torch.tensor([0, 1, 1])
    ggn = LowRankGGN(model, nn.CrossEntropyLoss(), (X, y))
    assert ggn.engine == "func"
    assert isinstance(ggn._group(0).ggn_factors[0], OuterProductFactors)
    G = dense_ggn(model, nn.CrossEntropyLoss(), X, y)
    evals, evecs = ggn.eigh()
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), REL)
    assert_eigenpairs(evals, evecs, G, ggn.eigvalsh().numel())


def test_looped_and_vmapped_backward_agree():
    """Both ways BatchedVJP can push vectors back give the same products."""
    model, loss_func, X, y = func_reference("lstm-ce-sum").setup
    output = model(X)
    params = list(model.lstm.parameters())
    vectors = torch.randn(5, *output.shape, dtype=output.dtype)
    results = []
    for batched in (True, False):
        vjp = BatchedVJP()
        vjp.batched = batched
        results.append(vjp(output, params, vectors, chunk_size=2))
    for vmapped, looped in zip(*results, strict=True):
        assert_rel(vmapped, looped, REORDERED_REL)
