"""Tests for ``vivit.optim.damping``."""

from __future__ import annotations

import math

import pytest
import torch

from tests.fixtures.checks import rounding_rel
from vivit.optim.damping import BootstrapDamping, ConstantDamping

GRID = [0.0, 0.5, 1.0, 2.0, 4.0]


def _seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _call(damping, gammas, lambdas, evals=None):
    """Call a damping with mean-scale ``evals`` unless given."""
    if evals is None:
        evals = lambdas.mean(0)
    gram_evecs = torch.eye(lambdas.shape[0], evals.shape[0], dtype=evals.dtype)
    return damping(evals, gram_evecs, gammas, lambdas)


def _noisy(num_samples=32, num_directions=50, noise=1.0, seed=1):
    """Gradients with mean 1 and spread ``noise``, curvatures with mean 2."""
    gen = _seeded(seed)
    shape = (num_samples, num_directions)
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    z = (z - z.mean(0)) / z.std(0)
    gammas = 1.0 + noise * z
    lambdas = 2.0 + torch.rand(shape, generator=gen, dtype=torch.float64)
    lambdas = lambdas - lambdas.mean(0) + 2.0
    return gammas, lambdas


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_damping_value_shape_dtype(dtype):
    evals = torch.tensor([0.1, 1.0, 3.0], dtype=dtype)
    gammas, lambdas = torch.randn(4, 3, dtype=dtype), torch.rand(5, 3, dtype=dtype)
    delta = _call(ConstantDamping(0.25), gammas, lambdas, evals)
    assert delta.shape == (3,)
    assert delta.dtype == dtype
    assert torch.equal(delta, torch.full((3,), 0.25, dtype=dtype))
    assert torch.equal(_call(ConstantDamping(), gammas, lambdas, evals), evals * 0 + 1)


@pytest.mark.parametrize("value", [-1e-3, float("nan")])
def test_constant_damping_rejects_invalid(value):
    with pytest.raises(ValueError, match="non-negative"):
        ConstantDamping(value)


def test_constant_damping_accepts_zero():
    delta = _call(ConstantDamping(0.0), torch.ones(2, 2), torch.ones(2, 2))
    assert torch.equal(delta, torch.zeros(2))


@pytest.mark.parametrize("grid", [None, [3.0, 0.2, 1.0, 0.05]])
def test_bootstrap_pure_signal_gives_smallest_damping(grid):
    gamma_values = torch.tensor([1.0, -2.0, 0.3, 5.0], dtype=torch.float64)
    lambda_values = torch.tensor([1.0, 0.5, 4.0, 1e-2], dtype=torch.float64)
    gammas = gamma_values.repeat(10, 1)
    lambdas = lambda_values.repeat(7, 1)
    damping = BootstrapDamping(damping_grid=grid, generator=_seeded())
    smallest = 1e-3 if grid is None else min(grid)
    delta = _call(damping, gammas, lambdas)
    # a grid value times evals/λ̄ = λ̄/λ̄ = 1 exactly: bit for bit
    assert torch.equal(delta, torch.full((4,), smallest, dtype=torch.float64))


def test_bootstrap_pure_noise_is_skipped():
    gammas = torch.tensor([[1.0], [-1.0]]).repeat(20, 6)  # [40, 6], zero mean
    gammas[:, 3:] *= 5.0
    lambdas = torch.rand(30, 6, generator=_seeded(3)) + 0.1
    delta = _call(BootstrapDamping(generator=_seeded()), gammas, lambdas)
    assert torch.equal(delta, torch.full((6,), math.inf))


def test_bootstrap_uncertain_gradient_sign_is_skipped():
    gammas = 0.01 + torch.tensor([[1.0], [-1.0]]).repeat(20, 2)  # mean 0.01, std 1
    lambdas = torch.ones(30, 2)
    delta = _call(BootstrapDamping(generator=_seeded()), gammas, lambdas)
    assert delta.isinf().all()


def test_bootstrap_directions_are_independent():
    """A noisy direction is skipped, a noise-free one in the same call is not."""
    gammas = torch.stack([torch.tensor([1.0, -1.0]).repeat(20), torch.ones(40)], 1)
    lambdas = torch.ones(40, 2)
    damping = BootstrapDamping(damping_grid=GRID, generator=_seeded())
    delta = _call(damping, gammas, lambdas)
    assert delta[0].isinf()
    assert delta[1] == 0.0


def test_bootstrap_analytic_choice():
    """Exact curvature, percentile 100: minimise ½λc² - c·min(γ), c = γ̄/(λ+δ).

    With γ = (1, 3), λ = 1 the resample means are 1, 2, 3; the worst one, 1, makes
    the grid objective 0, -0.444, -0.5, -0.444, -0.267, so δ = 1 (shrinking the
    Newton step 2 to the pessimistic step 1).
    """
    gammas = torch.tensor([[1.0], [3.0]], dtype=torch.float64)
    lambdas = torch.ones(2, 1, dtype=torch.float64)
    damping = BootstrapDamping(GRID, num_resamples=200, percentile=100.0)
    damping.generator = _seeded()
    assert _call(damping, gammas, lambdas).item() == 1.0


def test_bootstrap_ties_go_to_smaller_damping():
    """As in the analytic test, δ = 1/3 and δ = 3 both give the objective -0.375."""
    gammas = torch.tensor([[1.0], [3.0]], dtype=torch.float64)
    lambdas = torch.ones(2, 1, dtype=torch.float64)
    damping = BootstrapDamping([3.0, 1 / 3], num_resamples=200, percentile=100.0)
    damping.generator = _seeded()
    assert _call(damping, gammas, lambdas).item() == 1 / 3


def test_bootstrap_more_noise_more_damping():
    gen_seed = 4
    deltas = []
    for noise in (0.3, 0.6, 0.9):
        gammas, lambdas = _noisy(noise=noise)
        damping = BootstrapDamping(generator=_seeded(gen_seed))
        deltas.append(_call(damping, gammas, lambdas))
    for low, high in zip(deltas[:-1], deltas[1:], strict=True):
        assert (low <= high).all()
        assert (low < high).any()
    assert deltas[0].isfinite().all()


def test_bootstrap_reproducible_with_generator():
    gammas, lambdas = _noisy(noise=0.6)
    first = _call(BootstrapDamping(generator=_seeded(7)), gammas, lambdas)
    second = _call(BootstrapDamping(generator=_seeded(7)), gammas, lambdas)
    other = _call(BootstrapDamping(generator=_seeded(8)), gammas, lambdas)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)
    assert first.isfinite().any()


def test_bootstrap_output_on_sum_scale():
    gammas, lambdas = _noisy(noise=0.6)
    N = lambdas.shape[0]
    mean_scale = _call(BootstrapDamping(generator=_seeded()), gammas, lambdas)
    sum_scale = _call(
        BootstrapDamping(generator=_seeded()), gammas, lambdas, N * lambdas.mean(0)
    )
    assert mean_scale.isfinite().sum() >= 10
    assert torch.equal(mean_scale.isinf(), sum_scale.isinf())
    finite = mean_scale.isfinite()
    # the same grid values; N·λ̄, (N·λ̄)/λ̄, δ'·scale and the test's N·δ: four
    # roundings ("Tolerances of the tests", "Few operations")
    torch.testing.assert_close(
        sum_scale[finite], N * mean_scale[finite], rtol=rounding_rel(4), atol=0
    )


def test_bootstrap_shape_and_dtype():
    gammas, lambdas = _noisy(num_samples=8, num_directions=5, noise=0.3)
    evals = lambdas.mean(0).float()
    delta = _call(BootstrapDamping(), gammas.float(), lambdas.float(), evals)
    assert delta.shape == (5,)
    assert delta.dtype == torch.float32
    assert (delta >= 0).all()


def test_bootstrap_zero_curvature_gives_no_nan():
    gammas = torch.ones(6, 3)
    gammas[:, 2] = torch.tensor([1.0, -1.0]).repeat(3)  # pure noise
    lambdas = torch.zeros(4, 3)
    damping = BootstrapDamping(damping_grid=[0.0, 2.0, 4.0], generator=_seeded())
    delta = _call(damping, gammas, lambdas, evals=torch.zeros(3))
    assert not delta.isnan().any()
    # δ = 0 would divide by λ̄ + δ = 0; without curvature the change -γ̄²/δ is most
    # negative for the smallest positive candidate
    assert delta[:2].tolist() == [2.0, 2.0]
    assert delta[2].isinf()


def test_bootstrap_single_sample_is_exact():
    gammas = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    lambdas = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    damping = BootstrapDamping(damping_grid=[0.1, 1.0], generator=_seeded())
    assert _call(damping, gammas, lambdas).tolist() == [0.1, 0.1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"damping_grid": []},
        {"damping_grid": [[1.0]]},
        {"damping_grid": [-1.0, 1.0]},
        {"damping_grid": [1.0, math.inf]},
        {"num_resamples": 0},
        {"percentile": 0.0},
        {"percentile": 101.0},
    ],
)
def test_bootstrap_rejects_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        BootstrapDamping(**kwargs)


@pytest.mark.parametrize(
    ("gamma_shape", "lambda_shape"),
    [((4, 2), (4, 3)), ((0, 3), (4, 3)), ((3,), (4, 3))],
)
def test_bootstrap_rejects_mismatched_shapes(gamma_shape, lambda_shape):
    with pytest.raises(ValueError, match="must have shape"):
        BootstrapDamping()(
            torch.ones(3),
            torch.eye(3),
            torch.ones(gamma_shape),
            torch.ones(lambda_shape),
        )
