"""Stochastic Lanczos quadrature (``vivit.analysis.density``) against exact spectra.

``docs/math.rst``, "Spectral density by stochastic Lanczos quadrature": each
probe's quadrature reproduces the moments ``x̂ᵀ A^p x̂`` for ``p ≤ 2k − 1`` (Gauss
quadrature; with full reorthogonalization to ``p·n·ε·λ_max^p``), its weights sum
to one, and the measure is within Chen, Trogdon and Ubaru's Wasserstein bound of
the exact spectrum with probability ``1 − η``. The operators: the Gram matrices
of float64 GGNs (dense, the exact spectrum from ``eigvalsh``), the GGN itself
through :meth:`vivit.LowRankGGN.operator` against the dense reference, and a
matrix of a prescribed spectrum.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import Tensor, nn

from tests.fixtures.checks import rounding_rel
from tests.fixtures.problems import get_problem, mlp, prepare
from tests.fixtures.reference import dense_ggn
from vivit import InvalidArgumentError, LowRankGGN, NonFiniteError
from vivit.analysis import (
    spectral_density,
    wasserstein_bound,
    wasserstein_distance,
)

EPS = torch.finfo(torch.float64).eps
ETA = 1e-3  # failure probability of the Wasserstein bound


@functools.cache
def gram(reduction: str, samples: int = 40) -> Tensor:
    """The float64 Gram matrix of an MLP, 5 classes (``n = 5·samples``)."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = mlp(8, 16, 5).double()
    X = torch.randn(samples, 8, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (samples,), generator=generator)
    return LowRankGGN(model, nn.CrossEntropyLoss(reduction=reduction), (X, y)).gram()


def prescribed(size: int = 200) -> tuple[Tensor, Tensor]:
    """A PSD matrix with a bulk, outliers and a null space, and its eigenvalues."""
    generator = torch.Generator().manual_seed(1)
    nulls = size // 6
    bulk = torch.rand(size - nulls - 10, generator=generator, dtype=torch.float64)
    evals = torch.cat([torch.zeros(nulls), bulk, 5 + 10 * torch.arange(10.0)]).double()
    Q, _ = torch.linalg.qr(
        torch.randn(size, size, generator=generator, dtype=torch.float64)
    )
    return (Q * evals) @ Q.T, evals.sort().values


@pytest.mark.parametrize("steps", [4, 10, 25])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_quadrature_reproduces_the_probes_moments(reduction, steps):
    """``Σ_j ω_j θ_j^p = x̂ᵀ A^p x̂``, ``p ≤ 2k − 1``, within ``p·n·ε·λ_max^p``."""
    A = gram(reduction)
    n = A.shape[0]
    probes = torch.randn(
        n, 3, generator=torch.Generator().manual_seed(2), dtype=A.dtype
    )
    density = spectral_density(A, lanczos_steps=steps, probes=probes)
    unit = probes / probes.norm(dim=0)
    lam_max = torch.linalg.eigvalsh(A)[-1].item()
    power = unit
    for p in range(2 * steps):
        moments = (density.weights * density.nodes**p).sum(1) * density.probes / n
        expected = (unit * power).sum(0)
        bound = max(p, 1) * n * EPS * lam_max**p
        assert ((moments - expected).abs() <= bound).all(), (p, moments, expected)
        power = A @ power


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_weights_count_every_eigenvalue(reduction):
    """The weights of each probe sum to one: ``n`` over all probes."""
    A = gram(reduction)
    density = spectral_density(A, lanczos_steps=20, probes=7)
    assert density.weights.shape == density.nodes.shape == (7, 20)
    n = A.shape[0]
    assert abs(density.weights.sum().item() - n) <= n * rounding_rel(20)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_basis_probes_give_the_exact_trace_and_rank(reduction):
    """Probes ``e_1 … e_n``: ``Σ_i e_iᵀ A e_i = tr(A)``; with ``k = n`` steps the
    mass at zero is ``Σ_i ‖P_0 e_i‖² = tr(P_0)``, the count of zero eigenvalues.
    """
    A = gram(reduction, samples=12)
    n = A.shape[0]
    basis = torch.eye(n, dtype=A.dtype)
    density = spectral_density(A, lanczos_steps=n, probes=basis)
    assert abs(density.trace() - A.trace().item()) <= n * EPS * A.trace().item() * 10
    evals = torch.linalg.eigvalsh(A)
    tolerance = n * EPS * evals[-1].item()
    rank = int((evals > tolerance).sum())
    assert rank < n  # cross-entropy: N zero eigenvalues
    assert abs(density.count(tolerance) - rank) <= n * rounding_rel(n)


@pytest.mark.parametrize("probes", [10, 40])
@pytest.mark.parametrize("steps", [10, 30, 200])
def test_wasserstein_distance_within_its_bound_prescribed(steps, probes):
    """A bulk, outliers and a null space (``n = 200``): ``W₁`` within the bound."""
    A, evals = prescribed()
    density = spectral_density(A, lanczos_steps=steps, probes=probes, seed=3)
    distance = wasserstein_distance(density, evals)
    bound = wasserstein_bound(200, steps, probes, (evals[-1] - evals[0]).item(), ETA)
    assert distance <= bound, (distance, bound)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("steps", [10, 200])
def test_wasserstein_distance_within_its_bound_gram(reduction, steps):
    """A GGN's Gram matrix: ``W₁`` within the bound (``k = n``: exact quadrature)."""
    A = gram(reduction)
    evals = torch.linalg.eigvalsh(A)
    density = spectral_density(A, lanczos_steps=steps, probes=20, seed=4)
    distance = wasserstein_distance(density, evals)
    bound = wasserstein_bound(A.shape[0], steps, 20, (evals[-1] - evals[0]).item(), ETA)
    assert distance <= bound, (distance, bound)


def test_wasserstein_distance_is_that_of_the_measures():
    """Two point masses: ``W₁`` of ``½δ₀ + ½δ₂`` and ``δ₁`` is 1; of a measure and
    itself 0."""
    density = spectral_density(
        torch.diag(torch.tensor([0.0, 2.0]).double()),
        probes=torch.tensor([[1.0], [1.0]]).double(),
    )
    assert abs(
        wasserstein_distance(density, torch.tensor([1.0, 1.0])) - 1
    ) <= rounding_rel(4)
    assert (
        wasserstein_distance(density, torch.tensor([0.0, 2.0])) <= rounding_rel(4) * 2
    )


def test_ggn_operator_in_parameter_space():
    """``LowRankGGN.operator()`` (``D × D``, products with ``V``) vs. the dense GGN."""
    model, loss_func, X, y = prepare(get_problem("mlp_tanh-ce-mean"), torch.float64)
    ggn = LowRankGGN(model, loss_func, (X, y))
    G = dense_ggn(model, loss_func, X, y)
    D = G.shape[0]
    density = spectral_density(ggn.operator(), lanczos_steps=D, probes=30, seed=5)
    evals = torch.linalg.eigvalsh(G)
    distance = wasserstein_distance(density, evals)
    assert distance <= wasserstein_bound(D, D, 30, (evals[-1] - evals[0]).item(), ETA)
    tolerance = D * EPS * evals[-1].item()
    rank = int((evals > tolerance).sum())
    assert rank < D and density.count(tolerance) < D  # the null space is seen


def test_operator_forms_agree():
    """A matrix, and a callable of its products, give the same measure."""
    A, _ = prescribed(50)
    density = spectral_density(A, lanczos_steps=20, probes=4, seed=6)
    products = spectral_density(
        lambda X: A @ X, dim=50, lanczos_steps=20, probes=4, seed=6, dtype=A.dtype
    )
    torch.testing.assert_close(products.nodes, density.nodes, rtol=0, atol=0)
    torch.testing.assert_close(products.weights, density.weights, rtol=0, atol=0)


def test_smoothed_density_integrates_to_the_dimension():
    """A Gaussian kernel on a grid spanning ±12σ beyond the nodes integrates to
    ``n`` (trapezoid rule on a smooth, decayed integrand: error far below rounding).
    """
    A, _ = prescribed()
    density = spectral_density(A, lanczos_steps=30, probes=5)
    width = 0.1
    grid = torch.linspace(
        density.nodes.min() - 12 * width,
        density.nodes.max() + 12 * width,
        20_000,
        dtype=torch.float64,
    )
    values = density.density(grid, width)
    integral = torch.trapezoid(values, grid).item()
    assert abs(integral - 200) <= 200 * rounding_rel(20_000)


def test_bad_input_is_refused():
    A = torch.eye(3, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="square"):
        spectral_density(torch.ones(3, 2))
    with pytest.raises(InvalidArgumentError, match="floating-point"):
        spectral_density(torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(InvalidArgumentError, match="dim must be a positive"):
        spectral_density(lambda X: X)
    with pytest.raises(InvalidArgumentError, match="operator must be"):
        spectral_density("matrix")
    with pytest.raises(InvalidArgumentError, match=r"\[3, n_v\]"):
        spectral_density(A, probes=torch.ones(2, 1))
    with pytest.raises(InvalidArgumentError, match="non-zero"):
        spectral_density(A, probes=torch.zeros(3, 1))
    with pytest.raises(InvalidArgumentError, match="lanczos_steps"):
        spectral_density(A, lanczos_steps=0)
    with pytest.raises(InvalidArgumentError, match="probes must be a positive"):
        spectral_density(A, probes=0)
    with pytest.raises(NonFiniteError, match="Lanczos step 0"):
        spectral_density(lambda X: X * math.nan, dim=3)
    density = spectral_density(A)
    with pytest.raises(InvalidArgumentError, match="all 3 eigenvalues"):
        wasserstein_distance(density, torch.ones(2))
    with pytest.raises(InvalidArgumentError, match="width must be positive"):
        density.density(torch.zeros(1), 0.0)


@pytest.mark.parametrize("t", [0.2, 0.05])
def test_bound_is_chen_trogdon_ubarus_theorem(t):
    """Their theorem: ``⌈12/t + 1/2⌉`` steps and ``⌈4 ln(2n/η) / ((n+2) t²)⌉`` probes
    give ``W₁ ≤ t·(λ_max − λ_min)``, each term ``t/2``, one fewer step or probe not."""
    n = 1000
    steps = math.ceil(12 / t + 1 / 2)
    probes = math.ceil(4 * math.log(2 * n / ETA) / ((n + 2) * t**2))
    no_sampling = 10**30  # probes: the sampling term vanishes
    assert wasserstein_bound(n, steps, no_sampling, 1.0, ETA) <= t / 2
    assert wasserstein_bound(n, steps - 1, no_sampling, 1.0, ETA) > t / 2
    assert wasserstein_bound(n, n, probes, 1.0, ETA) <= t / 2  # k = n: exact
    assert wasserstein_bound(n, n, probes - 1, 1.0, ETA) > t / 2
    assert wasserstein_bound(n, steps, probes, 2.0, ETA) <= 2 * t


@pytest.mark.parametrize(
    "args, says",
    [
        ((200, 10, 0, 1.0), "probes"),
        ((200, 0, 5, 1.0), "lanczos_steps"),
        ((0, 10, 5, 1.0), "dim"),
        ((200, 10, 5, 1.0, 0.0), "failure_probability"),
    ],
)
def test_the_bound_refuses_counts_it_cannot_use(args, says):
    """A zero count would divide by zero or give a bound that holds for nothing."""
    with pytest.raises(InvalidArgumentError, match=says):
        wasserstein_bound(*args)
