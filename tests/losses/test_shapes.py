"""Model outputs of the shapes the supported losses take, end to end.

``docs/math.rst``, "Losses": an output ``[N]`` (one logit or value per sample, a
binary classifier's ``model(x).squeeze(1)``) is an output ``[N, 1]``, one column
per sample. Checked against the dense float64 GGN of ``tests/fixtures/reference.py``
(exact, subsampled, Monte Carlo with the same sampled root, the implicit route) and
against the same model returning ``[N, 1]`` with targets ``[N, 1]``: the same
numbers in another layout, through ``LowRankGGN``, ``DampedNewton`` and
``audit_approximations``. Outputs ``[N, C, H, W]`` of every loss against the dense
GGN on both engines.

Tolerances (:ref:`math-test-tolerances`): ``G`` from products with ``V``, the
gradient and the Gram matrices are sums in another order (``REORDERED_REL``);
eigenvalues ``EIGVAL_RTOL``; eigenpairs' residuals and orthonormality their bounds
(``assert_eigenpairs``); ``γ``, ``λ``, Newton steps and parameters after a step,
products with the leading eigenvectors (``EIGVEC_PRODUCT_REL``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    flat_evecs,
)
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn, dense_gradient, dense_mc_ggn
from vivit import LowRankGGN
from vivit.analysis import audit_approximations
from vivit.errors import UnsupportedLossError
from vivit.optim import DampedNewton

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing:UserWarning"
)

N = 6
ENGINES = ["backpack", "func"]
LOSSES = ["bce", "mse"]


def _problem(loss: str, reduction: str = "mean", axis: bool = False):
    """An MLP with one output per sample: ``[N]``, or ``[N, 1]`` with ``axis``.

    Binary BCE targets (curvlinops' KFAC takes no others); the same parameters and
    data either way.
    """
    torch.manual_seed(0)
    model = mlp(3, 4, 1).double()
    if not axis:
        model.append(nn.Flatten(0))  # [N, 1] -> [N]: the converter's .flatten()
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(N, 3, generator=gen, dtype=torch.float64)
    if loss == "bce":
        loss_func = nn.BCEWithLogitsLoss(reduction=reduction)
        y = torch.randint(0, 2, (N,), generator=gen).double()
    else:
        loss_func = nn.MSELoss(reduction=reduction)
        y = torch.randn(N, generator=gen, dtype=torch.float64)
    return model, loss_func, X, y.unsqueeze(1) if axis else y


def _ggn_matrix(ggn: LowRankGGN, model: nn.Module) -> torch.Tensor:
    """``G = V Vᵀ`` in parameter space, from products with the identity."""
    num_params = sum(p.numel() for p in model.parameters())
    return ggn.operator().matvec(torch.eye(num_params, dtype=torch.float64))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


@pytest.mark.parametrize("subsampling", [None, [4, 1, 3]], ids=["full", "sub"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("loss", LOSSES)
def test_output_per_sample_matches_dense(loss, engine, reduction, subsampling):
    model, loss_func, X, y = _problem(loss, reduction)
    ggn = LowRankGGN(model, loss_func, (X, y), engine=engine, subsampling=subsampling)
    G = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    assert ggn.gram().shape == (len(subsampling or X),) * 2  # C = 1 per sample
    assert_rel(_ggn_matrix(ggn, model), G, REORDERED_REL)
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[G.dtype])
    evals, evecs = ggn.eigh(top_k=3)
    assert_eigenpairs(evals, evecs, G, ggn.gram().shape[0])
    gradient = dense_gradient(model, loss_func, X, y)
    assert_rel(_flat(ggn.gradient()), gradient, REORDERED_REL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", LOSSES)
def test_output_per_sample_monte_carlo_matches_dense(loss, reduction):
    """The func engine's draws (the batch's documented stream) in the dense GGN."""
    model, loss_func, X, y = _problem(loss, reduction)
    seed, samples = 3, 2
    generator = torch.Generator().manual_seed(seed)
    ggn = LowRankGGN(
        model, loss_func, (X, y), engine="func", mc_samples=samples, generator=generator
    )
    G = dense_mc_ggn(model, loss_func, [(X, y)], samples, seed)
    assert_rel(_ggn_matrix(ggn, model), G, REORDERED_REL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", LOSSES)
def test_output_per_sample_implicit_route_matches_dense(loss, reduction):
    model, loss_func, X, y = _problem(loss, reduction)
    ggn = LowRankGGN(model, loss_func, (X, y), route="implicit")
    G = dense_ggn(model, loss_func, X, y)
    assert_rel(_ggn_matrix(ggn, model), G, REORDERED_REL)
    evals, evecs = ggn.eigh(top_k=3)
    report = ggn.solver_report()
    assert report.converged
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[G.dtype])
    assert_eigenpairs(evals, evecs, G, N, tol=report.tolerance)


def _both(loss: str, reduction: str = "mean"):
    """The problem with outputs ``[N]`` and ``[N, 1]``."""
    return _problem(loss, reduction), _problem(loss, reduction, axis=True)


@pytest.mark.parametrize(
    "options",
    [{}, {"subsampling": [4, 1, 3]}, {"mc_samples": 2}],
    ids=["exact", "sub", "mc"],
)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("loss", LOSSES)
def test_output_per_sample_is_the_output_axis(loss, engine, options):
    """Every result of ``[N]`` is that of ``[N, 1]``, the same seed for MC draws."""
    results = []
    for model, loss_func, X, y in _both(loss):
        generator = torch.Generator().manual_seed(5)
        ggn = LowRankGGN(
            model, loss_func, (X, y), engine=engine, generator=generator, **options
        )
        evals, evecs = ggn.eigh(top_k=3)
        directional = ggn.directional_derivatives(top_k=3)
        results.append(
            (
                ggn.gram(),
                ggn.eigvalsh(),
                evals,
                flat_evecs(evecs),
                directional.gammas,
                directional.lambdas,
                _flat(ggn.newton_step()),
            )
        )
    (gram, all_evals, *products), (gram1, all_evals1, *products1) = results
    assert_rel(gram, gram1, REORDERED_REL)
    assert_top_eigvals(all_evals, all_evals1, EIGVAL_RTOL[torch.float64])
    for actual, expected in zip(products, products1, strict=True):
        assert_rel(actual, expected, EIGVEC_PRODUCT_REL)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("loss", LOSSES)
def test_damped_newton_on_output_per_sample_is_the_output_axis(loss, engine):
    params = []
    for model, loss_func, X, y in _both(loss, "sum"):
        optimizer = DampedNewton(
            model.parameters(), model=model, loss_func=loss_func, engine=engine
        )
        optimizer.step(data=(X, y))
        params.append(_flat(p.detach() for p in model.parameters()))
    assert_rel(params[0], params[1], EIGVEC_PRODUCT_REL)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("loss", LOSSES)
def test_audit_on_output_per_sample_is_the_output_axis(loss, engine):
    """Every row (KFAC and EKFAC too, where curvlinops is installed) as ``[N, 1]``."""
    audits = [
        audit_approximations(model, loss_func, (X, y), top_k=3, engine=engine)
        for model, loss_func, X, y in _both(loss)
    ]
    assert audits[0].exact_eigenvalues == pytest.approx(
        audits[1].exact_eigenvalues, rel=0, abs=EIGVAL_RTOL[torch.float64]
    )
    for row, expected in zip(audits[0].rows, audits[1].rows, strict=True):
        assert (row.name, row.status) == (expected.name, expected.status)
        for field in ("eigenvalues", "relative_errors", "principal_cosines"):
            actual = getattr(row, field)
            if actual is not None:
                assert_rel(
                    torch.tensor(actual),
                    torch.tensor(getattr(expected, field)),
                    EIGVEC_PRODUCT_REL,
                )
        for field in ("step_cosine", "step_norm_ratio"):
            assert getattr(row, field) == pytest.approx(
                getattr(expected, field), rel=EIGVEC_PRODUCT_REL
            )


def _image_problem(loss: str, reduction: str):
    """A CNN with outputs ``[N, 3, 2, 2]`` and targets the loss takes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.Tanh(), nn.Conv2d(3, 3, 1)).double()
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(4, 2, 2, 2, generator=gen, dtype=torch.float64)
    if loss == "ce":
        return (
            model,
            nn.CrossEntropyLoss(reduction=reduction),
            X,
            torch.randint(0, 3, (4, 2, 2), generator=gen),
        )
    y = torch.rand(4, 3, 2, 2, generator=gen, dtype=torch.float64)
    loss_class = {
        "ce-soft": nn.CrossEntropyLoss,
        "mse": nn.MSELoss,
        "bce": nn.BCEWithLogitsLoss,
    }[loss]
    return model, loss_class(reduction=reduction), X, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("loss", ["ce", "ce-soft", "mse", "bce"])
def test_image_outputs_match_dense(loss, engine, reduction):
    model, loss_func, X, y = _image_problem(loss, reduction)
    ggn = LowRankGGN(model, loss_func, (X, y), engine=engine)
    G = dense_ggn(model, loss_func, X, y)
    assert_rel(_ggn_matrix(ggn, model), G, REORDERED_REL)
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[G.dtype])


@pytest.mark.parametrize("engine", ENGINES)
def test_nll_loss_points_to_cross_entropy(engine):
    """``NLLLoss`` after ``log_softmax``: the refusal names the loss on logits."""
    model = nn.Sequential(nn.Linear(3, 4), nn.LogSoftmax(dim=1))
    data = (torch.randn(N, 3), torch.randint(0, 4, (N,)))
    with pytest.raises(UnsupportedLossError) as info:
        LowRankGGN(model, nn.NLLLoss(), data, engine=engine)
    for words in ("log_softmax", "logits", "torch.nn.CrossEntropyLoss"):
        assert words in str(info.value)
