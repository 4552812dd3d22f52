"""Assertions on eigenpairs shared by the numerical tests.

Tolerances: a backward-stable symmetric eigensolver computes eigenvalues with an
absolute error of order ``ε·‖G‖`` (Weyl), so eigenvalues are compared with a bound
relative to ``λ_max``. An eigenvector ``e = V ẽ / √λ`` inherits the Gram
eigenvector's error ``ε·λ_max / gap`` amplified by nothing more than ``1/√λ``, so
residuals are checked relative to ``λ`` only for eigenvalues well above the
numerical zero, and relative to ``λ_max`` for all.
"""

import torch
from torch import Tensor

#: float64: eigenvalues within 1e-10·λ_max, residuals 1e-8·λ, orthonormal to 1e-10.
#: float32: eigenvalues within 1e-4·λ_max (ε₃₂ ≈ 1.2e-7 times growth with N·C).
EIGVAL_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def assert_top_eigvals(evals: Tensor, reference: Tensor, rtol: float) -> None:
    """``evals`` (ascending) equal the largest ``len(evals)`` reference eigenvalues."""
    reference = reference.to(torch.float64)
    evals = evals.to(torch.float64)
    # a Gram matrix larger than G (N·C > D) has N·C − D extra zero eigenvalues
    extra = max(evals.numel() - reference.numel(), 0)
    reference = torch.cat([reference.new_zeros(extra), reference])
    top = reference[-evals.numel() :]
    scale = reference.abs().max()
    error = (evals - top).abs().max()
    assert error <= rtol * scale, f"eigenvalue error {error:.2e} > {rtol}·{scale:.2e}"


def flat_evecs(evecs: list[Tensor]) -> Tensor:
    """Eigenvectors in parameter-list format → ``[K, D]``."""
    return torch.cat([e.flatten(start_dim=1) for e in evecs], dim=1).to(torch.float64)


def assert_eigenpairs(evals: Tensor, evecs: list[Tensor], G: Tensor) -> None:
    """Residuals and orthonormality of float64 eigenpairs of ``G``."""
    E = flat_evecs(evecs)
    assert E.shape == (evals.numel(), G.shape[0])
    lam_max = G.norm(2)
    residual = (G @ E.T - E.T * evals).norm(dim=0)
    assert (residual <= 1e-10 * lam_max).all(), residual.max()
    well_conditioned = evals >= 1e-5 * lam_max
    assert (residual[well_conditioned] <= 1e-8 * evals[well_conditioned]).all()
    Ew = E[well_conditioned]
    gram = Ew @ Ew.T
    torch.testing.assert_close(
        gram, torch.eye(len(Ew), dtype=gram.dtype), atol=1e-10, rtol=0
    )


def layer_groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """One parameter group per layer that owns parameters."""
    groups = [list(m.parameters(recurse=False)) for m in model.modules()]
    return [g for g in groups if g]


def align_signs(actual: Tensor, expected: Tensor) -> Tensor:
    """Flip each column (direction) of ``actual`` to the sign of ``expected``'s."""
    signs = torch.sign((actual * expected).sum(0))
    return actual * torch.where(signs == 0, 1.0, signs)


def assert_rel(actual: Tensor, expected: Tensor, rel: float = 1e-10) -> None:
    """Entry-wise |actual − expected| ≤ rel · max|expected| (float64: 1e-10)."""
    assert actual.shape == expected.shape
    scale = expected.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * scale)
