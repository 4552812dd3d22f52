"""The ``DampedNewton`` optimizer: exact Newton on least squares, training, groups."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vivit.sources.stored
from tests.fixtures.checks import (
    DIRECTION_REL,
    EIGVEC_PRODUCT_REL,
    EIGVEC_PRODUCT_REL32,
    assert_differs,
    assert_rel,
    assert_within,
    flat_evecs,
    orthonormality_bound,
    rounding_rel,
)
from tests.fixtures.problems import mlp
from tests.optim.problems import DTYPE, blobs, least_squares
from vivit import InvalidArgumentError, LowRankGGN
from vivit.optim import BootstrapDamping, DampedNewton, NewtonStep
from vivit.sources.runs import run_engine


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_undamped_step_solves_least_squares(reduction):
    """GGN = Hessian for a linear model: one full Newton step is the minimiser."""
    model, loss_func, X, y = least_squares(reduction)
    A = torch.cat([X, torch.ones(20, 1, dtype=DTYPE)], dim=1)
    solution = torch.linalg.lstsq(A, y).solution.squeeze(1)  # [w, b]
    initial = torch.cat([model.weight.detach().flatten(), model.bias.detach()])
    assert (initial - solution).norm() > 0.5  # the step has work to do

    optimizer = DampedNewton(
        model.parameters(), lr=1.0, damping=0.0, top_k=None, trust_fraction=None
    )
    loss_before = optimizer.step(lambda: loss_func(model(X), y))
    assert loss_before.requires_grad is False

    reached = torch.cat([model.weight.detach().flatten(), model.bias.detach()])
    # a Newton step over all directions
    assert (reached - solution).norm() <= DIRECTION_REL * solution.norm()
    (newton,) = optimizer.last_steps
    assert newton.directional.evals.numel() == 4  # rank of [X, 1]
    # The minimiser's gradient vanishes.
    model.zero_grad()
    loss_func(model(X), y).backward()
    assert model.weight.grad.norm() + model.bias.grad.norm() < 1e-10


@pytest.mark.parametrize(
    "damping",
    [0.1, BootstrapDamping(generator=torch.Generator().manual_seed(0))],
    ids=["constant", "bootstrap"],
)
def test_training_loss_decreases(damping):
    model, loss_func, X, y = blobs()
    optimizer = DampedNewton(model.parameters(), lr=1.0, damping=damping, top_k=10)

    def closure():
        return loss_func(model(X), y)

    losses = [optimizer.step(closure).item() for _ in range(5)]
    with torch.no_grad():
        final = closure().item()
    losses.append(final)
    # Every step decreases the full-batch loss, and by a lot overall.
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert final < 0.5 * losses[0], losses
    # The parameters' .grad are left alone (the closure calls no backward).
    assert all(p.grad is None for p in model.parameters())


def test_param_groups_with_own_lr_and_top_k():
    model, loss_func, X, y = blobs(seed=1)
    first, second = list(model[0].parameters()), list(model[2].parameters())
    groups = [
        {"params": first, "lr": 0.5, "top_k": 2},
        {"params": second, "top_k": 4, "damping": 0.3},
    ]
    optimizer = DampedNewton(
        groups,
        lr=0.8,
        damping=0.1,
        subsampling_grad=list(range(0, 30, 2)),
        trust_fraction=None,  # the plain damped steps, compared below
    )
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.8]
    assert [g["damping"] for g in optimizer.param_groups] == [0.1, 0.3]

    # Expected steps: the block-diagonal GGN at the current parameters.
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=[first, second])
    expected = [
        ggn.newton(top_k=2, group=0, damping=0.1, subsampling_grad=range(0, 30, 2)),
        ggn.newton(top_k=4, group=1, damping=0.3, subsampling_grad=range(0, 30, 2)),
    ]
    before = [[p.detach().clone() for p in ps] for ps in (first, second)]

    optimizer.step(lambda: loss_func(model(X), y))

    assert len(optimizer.last_steps) == 2
    for index, (params, lr, K) in enumerate([(first, 0.5, 2), (second, 0.8, 4)]):
        newton = optimizer.last_steps[index]
        assert isinstance(newton, NewtonStep)
        assert newton.directional.evals.shape == (K,)
        assert newton.directional.gammas.shape == (15, K)
        assert newton.directional.lambdas.shape == (30, K)
        for p, old, step, exp in zip(
            params, before[index], newton.step, expected[index].step, strict=True
        ):
            # ``last_steps`` holds the step as applied, ``lr`` included.
            # the same leading directions from another eigh call: products with them
            assert_rel(step, lr * exp, EIGVEC_PRODUCT_REL)
            # one addition on either side: 2 roundings of |old| + |step|
            assert_within(
                p.detach(), old + step, rounding_rel(2) * (old.abs() + step.abs())
            )


def test_last_steps_and_directions_shapes():
    model, loss_func, X, y = blobs()
    params = list(model.parameters())
    optimizer = DampedNewton(
        params, damping=0.1, top_k=5, keep_directions=True, trust_fraction=None
    )
    assert optimizer.last_steps == [] and optimizer.last_directions == []
    optimizer.step(lambda: loss_func(model(X), y))

    (newton,) = optimizer.last_steps
    assert newton.directional.evals.shape == (5,)
    assert newton.directional.gammas.shape == (30, 5)
    assert newton.directional.lambdas.shape == (30, 5)
    assert newton.gamma_bar.shape == newton.dampings.shape == (5,)
    # a constant damping is handed through: bit for bit
    assert torch.equal(newton.dampings, torch.full((5,), 0.1, dtype=DTYPE))
    assert [s.shape for s in newton.step] == [p.shape for p in params]

    ((evals, evecs),) = optimizer.last_directions
    torch.testing.assert_close(evals, newton.directional.evals, rtol=0, atol=0)
    assert [e.shape for e in evecs] == [(5, *p.shape) for p in params]
    E = flat_evecs(evecs)
    nc = newton.directional.lambdas.shape[0] * 3  # N·C, 3 classes
    assert_within(
        E @ E.T,
        torch.eye(5, dtype=DTYPE),
        orthonormality_bound(evals, evals.max().item(), nc, E.shape[1]),
    )
    # The step lies in the span of the kept directions (a product with them).
    step = torch.cat([s.flatten() for s in newton.step])
    assert_rel(E.T @ (E @ step), step, EIGVEC_PRODUCT_REL)

    without = DampedNewton(model.parameters(), damping=0.1, top_k=5)
    without.step(lambda: loss_func(model(X), y))
    assert without.last_directions == [] and len(without.last_steps) == 1


def _train_mc(seed: int, model, loss_func, X, y, steps: int = 2):
    model = copy.deepcopy(model)
    optimizer = DampedNewton(
        model.parameters(),
        damping=0.1,
        top_k=4,
        mc_samples=1,
        generator=torch.Generator().manual_seed(seed),
    )
    for _ in range(steps):
        optimizer.step(lambda: loss_func(model(X), y))
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_mc_reproducible_with_generator():
    model, loss_func, X, y = blobs()
    first = _train_mc(0, model, loss_func, X, y)
    again = _train_mc(0, model, loss_func, X, y)
    other = _train_mc(1, model, loss_func, X, y)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    # another MC draw: apart by more than steps over all directions could round to
    assert_differs(first, other, DIRECTION_REL)


@pytest.mark.parametrize("solver", ["dense", "gram_krylov", "factor_krylov"])
def test_gram_dtype_and_solver_reach_the_step(solver, monkeypatch):
    """One step with float64 accumulation and each solver equals the default step.

    Float32 model: the default step carries float32 rounding of the Gram matrix
    and its eigenvectors, so the steps agree to EIGVEC_PRODUCT_REL32 = 1e-4 relative.
    """
    torch.manual_seed(0)
    model = mlp(6, 8, 3)
    X, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    loss_func = nn.CrossEntropyLoss()
    reports = []

    class Recording(LowRankGGN):
        def newton(self, *args, **kwargs):
            result = super().newton(*args, **kwargs)
            reports.append(self.solver_report())
            return result

    monkeypatch.setattr("vivit.optim.damped_newton.LowRankGGN", Recording)
    steps = []
    for kwargs in ({}, {"gram_dtype": torch.float64, "solver": solver}):
        net = copy.deepcopy(model)
        optimizer = DampedNewton(
            net.parameters(), top_k=3, model=net, loss_func=loss_func, **kwargs
        )
        optimizer.step(data=(X, y))
        steps.append(torch.cat([s.flatten() for s in optimizer.last_steps[0].step]))
    assert steps[1].dtype == torch.float32
    assert optimizer.last_steps[0].directional.evals.dtype == torch.float64
    assert reports[-1].solver == solver
    scale = steps[0].abs().max()
    assert scale > 0
    assert_rel(steps[1], steps[0], EIGVEC_PRODUCT_REL32)


def test_chunked_steps_are_those_of_the_whole_batch(monkeypatch):
    """chunk_size reaches every step: exact GGN, float64, to EIGVEC_PRODUCT_REL."""
    model, loss_func, X, y = blobs()
    chunks, nets = [], []

    def recording_run(engine, model, part, request, sink):
        if model is nets[-1]:  # not the plan's measurements on a copy
            if part.index == 0:
                chunks.append(0)
            chunks[-1] += 1
        return run_engine(engine, model, part, request, sink)

    monkeypatch.setattr(vivit.sources.stored, "run_engine", recording_run)
    params = {}
    for chunk_size in (None, 7):
        net = copy.deepcopy(model)
        nets.append(net)
        optimizer = DampedNewton(
            net.parameters(),
            damping=0.1,
            top_k=4,
            model=net,
            loss_func=loss_func,
            chunk_size=chunk_size,
        )
        for _ in range(3):
            optimizer.step(data=(X, y))
        params[chunk_size] = torch.cat([p.detach().flatten() for p in net.parameters()])
    assert chunks == [1] * 3 + [5] * 3  # 30 samples in chunks of 7
    # reordered Gram sums, through the leading eigenvectors into three steps
    assert_rel(params[7], params[None], EIGVEC_PRODUCT_REL)
    # the steps moved the parameters beyond the bound they agree within
    initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert_differs(params[None], initial, EIGVEC_PRODUCT_REL)


def test_chunk_size_with_a_closure_is_refused():
    model, loss_func, X, y = blobs()
    optimizer = DampedNewton(model.parameters(), chunk_size=4)
    with pytest.raises(InvalidArgumentError, match="step\\(data="):
        optimizer.step(lambda: loss_func(model(X), y))
    with pytest.raises(InvalidArgumentError, match="chunk_size"):
        DampedNewton(model.parameters(), chunk_size=0)
