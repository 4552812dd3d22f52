"""Newton-step guards: trust region, no overshoot, zero steps, non-finite values."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from backpack import extend
from torch import nn

from tests.fixtures.checks import DIRECTION_REL, assert_within, record, rounding_rel
from tests.optim.problems import DTYPE, blobs, least_squares
from vivit import LowRankGGN, UnboundedStepWarning, ZeroStepWarning
from vivit.directional.gram_space import predicted_decrease, trust_region_dampings
from vivit.optim import BootstrapDamping, DampedNewton


def _directions(seed: int = 0, K: int = 6):
    gen = torch.Generator().manual_seed(seed)
    evals = torch.logspace(-6, 0, K, dtype=DTYPE)  # flat to sharp directions
    gamma_bar = torch.randn(K, generator=gen, dtype=DTYPE)
    return evals, gamma_bar


def test_predicted_decrease_is_the_quadratic_model():
    """``−(γ̄ t + ½ λ t²)`` at ``t = −lr γ̄ / (λ + δ)``, 0 for skipped directions."""
    evals, gamma_bar = _directions()
    dampings = torch.tensor([0.0, 0.1, 1.0, 2.0, torch.inf, 0.5], dtype=DTYPE)
    for lr in (0.5, 1.0, 3.0):
        t = -lr * gamma_bar / (evals + dampings)
        expected = -(gamma_bar * t + 0.5 * evals * t**2)
        expected[4] = 0.0
        # 7 roundings on each side, of a sum of two terms: Higham's n·ε·Σ|terms|
        terms = (gamma_bar * t).abs() + (0.5 * evals * t**2).abs()
        terms[4] = 0.0
        assert_within(
            predicted_decrease(evals, gamma_bar, dampings, lr),
            expected,
            rounding_rel(14) * terms,
        )


def test_trust_region_not_binding_keeps_the_dampings():
    evals, gamma_bar = _directions()
    dampings = torch.full_like(evals, 10.0)
    bound = float(predicted_decrease(evals, gamma_bar, dampings).sum()) * 1.01
    out = trust_region_dampings(evals, gamma_bar, dampings, 1.0, bound)
    assert torch.equal(out, dampings)


@pytest.mark.parametrize("lr", [0.3, 1.0, 2.5])
def test_trust_region_binding_adds_one_damping_to_all(lr):
    evals, gamma_bar = _directions(seed=1)
    dampings = torch.tensor([0.0, 0.0, 1e-8, 0.01, torch.inf, 0.0], dtype=DTYPE)
    bound = 0.05
    floor = torch.maximum(dampings, (lr - 1) * evals)  # no overshoot
    assert float(predicted_decrease(evals, gamma_bar, floor, lr).sum()) > bound
    out = trust_region_dampings(evals, gamma_bar, dampings, lr, bound)
    # The predicted decrease meets the bound (bisection to 2⁻⁶⁰, from above): six
    # positive terms of 7 roundings and their sum, on both ends of the last interval,
    # plus its width (< ε/1000).
    reached = float(predicted_decrease(evals, gamma_bar, out, lr).sum())
    assert bound * (1 - rounding_rel(2 * (7 + 5) + 1)) <= reached <= bound
    record(1 - reached / bound, rounding_rel(2 * (7 + 5) + 1))
    # One μ > 0 on top of the no-overshoot floor, skipped directions stay skipped.
    mu = out - floor
    finite = ~torch.isinf(dampings)
    assert torch.isinf(out[~finite]).all()
    assert (mu[finite] > 0).all()
    # μ_k = (floor_k + μ) − floor_k: one rounding of each sum, one of each difference
    out_finite = out[finite]
    assert_within(
        mu[finite],
        mu[finite][:1].expand(5),
        rounding_rel(2) * (out_finite + out_finite[0]),
    )


def test_large_lr_never_predicts_an_increase():
    """Undamped ``lr = 3`` would carry every direction past its model's minimum."""
    evals, gamma_bar = _directions(seed=2)
    dampings = torch.zeros_like(evals)
    assert (predicted_decrease(evals, gamma_bar, dampings, 3.0) < 0).all()
    out = trust_region_dampings(evals, gamma_bar, dampings, 3.0, math.inf)
    assert (predicted_decrease(evals, gamma_bar, out, 3.0) >= 0).all()
    # The scaled step is exactly the undamped Newton step: lr / (λ + δ') = 1 / λ.
    # λ + 2λ, 3/(…) and 1/λ: three roundings
    assert_within(3.0 / (evals + out), 1 / evals, rounding_rel(3) / evals)


def test_zero_bound_skips_every_direction():
    evals, gamma_bar = _directions()
    out = trust_region_dampings(evals, gamma_bar, torch.zeros_like(evals), 1.0, 0.0)
    assert torch.isinf(out).all()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("damping", [0.0, 1e-8])
def test_trust_region_on_a_quadratic_loss_decreases_by_the_fraction(reduction, damping):
    """GGN = Hessian and the loss is quadratic: the model's prediction is exact.

    The undamped step would remove ``L − L_min > L / 4``; the trust region
    allows a quarter of the loss, and exactly that is what the step removes.
    """
    model, loss_func, X, y = least_squares(reduction)
    A = torch.cat([X, torch.ones(20, 1, dtype=DTYPE)], dim=1)
    residual = A @ torch.linalg.lstsq(A, y).solution - y
    minimum = float(loss_func(residual, torch.zeros_like(residual)))

    optimizer = DampedNewton(model.parameters(), damping=damping)  # fraction 1/4
    before = float(optimizer.step(lambda: loss_func(model(X), y)))
    assert before - minimum > 0.25 * before  # the bound binds
    with torch.no_grad():
        after = float(loss_func(model(X), y))
    # the step's decrease comes from every direction's γ̄ and λ (DIRECTION_REL)
    assert after == pytest.approx(0.75 * before, rel=DIRECTION_REL)
    record(abs(after - 0.75 * before), DIRECTION_REL * 0.75 * before)
    (newton,) = optimizer.last_steps
    assert (newton.dampings > damping).all()  # μ > 0 was added


def saturated_problem(agree: bool):
    """Logits ~1e6 apart: softmax is exactly one-hot, the loss Hessian exactly 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).to(DTYPE)
    with torch.no_grad():
        model[0].weight.mul_(1e6)
    X = torch.randn(8, 4, dtype=DTYPE)
    with torch.no_grad():
        predicted = model(X).argmax(1)
    y = predicted if agree else (predicted + 1) % 3
    return extend(model), extend(nn.CrossEntropyLoss()), X, y


@pytest.mark.parametrize("agree", [True, False], ids=["zero-loss", "wrong-labels"])
@pytest.mark.parametrize(
    "damping",
    [1.0, BootstrapDamping(generator=torch.Generator().manual_seed(0))],
    ids=["constant", "bootstrap"],
)
def test_saturated_softmax_gives_a_zero_step_with_a_warning(agree, damping):
    model, loss_func, X, y = saturated_problem(agree)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DampedNewton(model.parameters(), damping=damping)
    with pytest.warns(ZeroStepWarning, match="no numerically non-zero eigenvalue"):
        loss = optimizer.step(lambda: loss_func(model(X), y))
    assert math.isfinite(float(loss))
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), old)
    (newton,) = optimizer.last_steps
    assert newton.dampings.numel() == 0
    assert all(torch.equal(s, torch.zeros_like(s)) for s in newton.step)


def test_every_direction_skipped_gives_a_zero_step_with_a_warning():
    model, loss_func, X, y = blobs(per_class=6)
    ggn = LowRankGGN(model, loss_func, (X, y))

    def skip_all(evals, gram_evecs, gammas, lambdas):
        return torch.full_like(evals, torch.inf)

    with pytest.warns(ZeroStepWarning, match="skipped all"):
        newton = ggn.newton(damping=skip_all)
    assert all(torch.equal(s, torch.zeros_like(s)) for s in newton.step)


@pytest.mark.parametrize("batch_size", [1, 18])
def test_single_gradient_sample_with_bootstrap(batch_size):
    """One gradient sample: the bootstrap treats it as exact; finite step, no error."""
    model, loss_func, X, y = blobs(per_class=6)
    X, y = X[:batch_size], y[:batch_size]
    damping = BootstrapDamping(generator=torch.Generator().manual_seed(0))
    optimizer = DampedNewton(model.parameters(), damping=damping, subsampling_grad=[0])
    optimizer.step(lambda: loss_func(model(X), y))
    (newton,) = optimizer.last_steps
    assert newton.directional.gammas.shape[0] == 1
    assert all(s.isfinite().all() for s in newton.step)


def test_bootstrap_without_directions_returns_no_damping():
    empty = torch.empty(0, dtype=DTYPE)
    out = BootstrapDamping()(empty, torch.empty(6, 0), torch.empty(3, 0), empty[None])
    assert out.shape == (0,)


def test_non_finite_loss_is_refused_and_parameters_unchanged():
    model, loss_func, X, y = blobs(per_class=6)
    X = X.clone()
    X[3, 0] = torch.nan
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DampedNewton(model.parameters())
    with pytest.raises(FloatingPointError, match="(?i)nan"):
        optimizer.step(lambda: loss_func(model(X), y))
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), old)


def test_non_finite_step_is_refused_and_parameters_unchanged():
    """``lr = 1e308`` overflows; without a trust region nothing else stops it."""
    model, loss_func, X, y = blobs(per_class=6)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DampedNewton(
        model.parameters(), lr=1e308, damping=0.0, trust_fraction=None
    )
    with pytest.raises(FloatingPointError, match="not finite"):
        optimizer.step(lambda: loss_func(model(X), y))
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), old)


def test_negative_loss_needs_no_trust_region():
    model, loss_func, X, y = blobs(per_class=6)
    optimizer = DampedNewton(model.parameters())
    with pytest.raises(ValueError, match="trust_fraction=None"):
        optimizer.step(lambda: loss_func(model(X), y) - 10.0)
    DampedNewton(model.parameters(), trust_fraction=None).step(
        lambda: loss_func(model(X), y) - 10.0
    )


@pytest.mark.parametrize("value", [0, -0.5, math.nan, math.inf, True, "0.25"])
def test_invalid_trust_fraction(value):
    model, _, _, _ = blobs(per_class=6)
    with pytest.raises(ValueError, match="trust_fraction"):
        DampedNewton(model.parameters(), trust_fraction=value)


@pytest.mark.parametrize(
    "setting, value",
    [
        ("trust_fraction", -1.0),  # used to give zero steps with a ZeroStepWarning
        ("trust_fraction", "0.25"),  # used to give a bare TypeError at step time
        ("trust_fraction", math.nan),
        ("lr", math.inf),
        ("damping", -1.0),
        ("top_k", 0),
    ],
)
def test_invalid_group_setting_is_refused_when_added_and_at_step(setting, value):
    """One check for the constructor's groups, added groups and changed values."""
    model, loss_func, X, y = blobs(per_class=6)
    first, last = list(model[0].parameters()), list(model[2].parameters())
    words = f"Parameter group 1: {setting}"
    with pytest.raises(ValueError, match=words):
        DampedNewton([{"params": first}, {"params": last, setting: value}])
    optimizer = DampedNewton(first)
    with pytest.raises(ValueError, match=words):
        optimizer.add_param_group({"params": last, setting: value})
    assert len(optimizer.param_groups) == 1  # the bad group was not added
    optimizer.add_param_group({"params": last})
    optimizer.param_groups[1][setting] = value
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=words):
        optimizer.step(lambda: loss_func(model(X), y))
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), old)


def test_exact_newton_on_a_quadratic_does_not_warn():
    model, loss_func, X, y = least_squares("mean")
    optimizer = DampedNewton(model.parameters(), damping=0.0, trust_fraction=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnboundedStepWarning)
        optimizer.step(lambda: loss_func(model(X), y))
