"""LowRankGGN with a memory budget so small that every route works in chunks.

With ``planner.MEMORY_BUDGET_BYTES`` at 8 bytes no intermediate fits: the planner
takes the route with the smallest block, and ``V`` of every Linear and convolution
weight is formed one output feature at a time. The results must still be those of
the dense float64 GGN (``tests/fixtures/reference.py``). With ``compact=False``
convolution weights keep their factor form instead of ``V`` (see
``OuterProductFactors.compact``), so the chunked Gram of every layer type runs.
"""

import pytest
import torch

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    flat_evecs,
)
from tests.fixtures.problems import prepare, problem_ids, select
from tests.fixtures.reference import dense_ggn, per_sample_gradients
from vivit import LowRankGGN
from vivit.gram import OuterProductFactors
from vivit.gram import outer as planner

ARCHITECTURES = ["cnn", "conv1d", "conv3d", "sequence_linear"]
#: Both losses and both reductions, each architecture twice (keeps the file fast).
PROBLEMS = select(architecture=ARCHITECTURES, loss="ce", reduction="mean") + select(
    architecture=ARCHITECTURES, loss="mse", reduction="sum"
)
#: float64 throughout: eigenvalues to EIGVAL_RTOL·λ_max (tests/fixtures/checks.py).
RTOL = EIGVAL_RTOL[torch.float64]


@pytest.fixture(params=[True, False], ids=["compact", "factors"])
def tiny_budget(request, monkeypatch):
    monkeypatch.setattr(planner, "MEMORY_BUDGET_BYTES", 8)
    if not request.param:
        monkeypatch.setattr(OuterProductFactors, "compact", lambda self, *ratio: self)


@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
@pytest.mark.parametrize("subsampling", [None, [0, 2, 3]], ids=["full", "sub"])
def test_tiny_budget_matches_dense_ggn(problem, subsampling, tiny_budget):
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=subsampling)
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(G), RTOL)
    evals, evecs = ggn.eigh(top_k=3)
    assert_eigenpairs(evals, evecs, G, ggn.eigvalsh().numel())

    # γ_nk = e_kᵀ ∇ℓ_n through the chunked cross-Gram with the gradient factors
    directional = ggn.directional_derivatives(top_k=3)
    E = flat_evecs(evecs)
    grads = per_sample_gradients(model, loss_func, X, y)
    # eigenvectors are defined up to sign; γ_nk changes sign with e_k; products
    # with the 3 leading eigenvectors
    assert_rel(directional.gammas.abs(), (grads @ E.T).abs(), EIGVEC_PRODUCT_REL)


@pytest.mark.parametrize("problem", select(architecture="cnn", loss="ce"), ids=str)
def test_tiny_budget_monte_carlo_matches_default_budget(problem, monkeypatch):
    """Same MC sample, same Gram matrix, whatever the budget."""
    model, loss_func, X, y = prepare(problem, torch.float64)

    def gram():
        generator = torch.Generator().manual_seed(3)
        return LowRankGGN(
            model, loss_func, (X, y), mc_samples=2, generator=generator
        ).gram()

    default = gram()
    monkeypatch.setattr(planner, "MEMORY_BUDGET_BYTES", 8)
    monkeypatch.setattr(OuterProductFactors, "compact", lambda self, *ratio: self)
    assert_rel(gram(), default, REORDERED_REL)  # the same sums in other chunks
