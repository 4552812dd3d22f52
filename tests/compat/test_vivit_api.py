"""The ViViT-compatible BackPACK hook API against the dense float64 GGN."""

import pytest
import torch
from backpack import backpack

import vivit
from tests.fixtures.checks import (
    EIGVAL_RTOL,
    assert_differs,
    assert_eigenpairs,
    assert_top_eigvals,
    layer_groups,
)
from tests.fixtures.problems import PROBLEMS, prepare, problem_ids, select
from tests.fixtures.reference import dense_ggn
from vivit.linalg.eigh import EighComputation
from vivit.linalg.eigvalsh import EigvalshComputation


def run_backward(computation, groups, model, loss_func, X, y):
    with backpack(
        computation.get_extension(),
        extension_hook=computation.get_extension_hook(groups),
    ):
        loss_func(model(X), y).backward()


def top(k):
    return lambda evals: list(range(evals.numel() - k, evals.numel()))


@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
@pytest.mark.parametrize("subsampling", [None, [3, 1]], ids=["full", "subsampled"])
def test_eigvalsh_and_eigh(problem, subsampling):
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    reference = torch.linalg.eigvalsh(G)
    groups = [{"params": list(model.parameters()), "criterion": top(2)}]

    eigvalsh = EigvalshComputation(subsampling=subsampling)
    run_backward(eigvalsh, groups, model, loss_func, X, y)
    evals = eigvalsh.get_result(groups[0])
    num_samples = problem.batch_size if subsampling is None else len(subsampling)
    assert evals.shape == (num_samples * problem.num_outputs,)
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float64])

    eigh = EighComputation(subsampling=subsampling)
    run_backward(eigh, groups, model, loss_func, X, y)
    evals, evecs = eigh.get_result(groups[0])
    assert evals.shape == (2,) and evals[0] <= evals[1]
    assert [e.shape for e in evecs] == [(2, *p.shape) for p in model.parameters()]
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float64])
    assert_eigenpairs(evals, evecs, G, num_samples * problem.num_outputs)


@pytest.mark.parametrize(
    "problem",
    select(architecture=["cnn", "batchnorm2d"]),
    ids=problem_ids(select(architecture=["cnn", "batchnorm2d"])),
)
def test_per_layer_groups_and_criterion(problem):
    model, loss_func, X, y = prepare(problem, torch.float64)
    groups = [{"params": g, "criterion": top(1)} for g in layer_groups(model)]
    computation = EighComputation()
    run_backward(computation, groups, model, loss_func, X, y)
    for group in groups:
        G = dense_ggn(model, loss_func, X, y, params=group["params"])
        evals, evecs = computation.get_result(group)
        assert evals.shape == (1,)
        assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])
        assert_eigenpairs(evals, evecs, G, problem.batch_size * problem.num_outputs)


def test_hook_serves_several_backward_passes():
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64)
    groups = [{"params": list(model.parameters())}]
    computation = EigvalshComputation()
    hook = computation.get_extension_hook(groups)
    results = []
    for inputs in (X, 2 * X):
        with backpack(computation.get_extension(), extension_hook=hook):
            loss_func(model(inputs), y).backward()
        results.append(computation.get_result(groups[0]))
        G = dense_ggn(model, loss_func, inputs, y)
        assert_top_eigvals(
            results[-1], torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
        )
    assert_differs(results[0], results[1], EIGVAL_RTOL[torch.float64])


@pytest.mark.parametrize("mc_samples", [1, 3])
def test_mc_shape(mc_samples):
    problem = PROBLEMS[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    groups = [{"params": list(model.parameters()), "criterion": top(1)}]
    computation = EigvalshComputation(mc_samples=mc_samples)
    run_backward(computation, groups, model, loss_func, X, y)
    assert computation.get_result(groups[0]).shape == (problem.batch_size * mc_samples,)


def test_import_paths_and_verbose(capsys):
    assert vivit.EighComputation is EighComputation
    assert vivit.EigvalshComputation is EigvalshComputation
    from vivit.optim.directional_damped_newton import DirectionalDampedNewtonComputation
    from vivit.optim.directional_derivatives import DirectionalDerivativesComputation

    assert vivit.DirectionalDerivativesComputation is DirectionalDerivativesComputation
    assert (
        vivit.DirectionalDampedNewtonComputation is DirectionalDampedNewtonComputation
    )

    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64)
    groups = [{"params": list(model.parameters())}]
    run_backward(EigvalshComputation(verbose=True), groups, model, loss_func, X, y)
    assert "computing the result" in capsys.readouterr().out


def test_warns_about_small_eigenvalues():
    model, loss_func, X, y = prepare(PROBLEMS[0], torch.float64)
    groups = [{"params": list(model.parameters()), "criterion": top(1)}]
    with pytest.warns(UserWarning, match="smaller than"):
        run_backward(
            EighComputation(warn_small_eigvals=1e6), groups, model, loss_func, X, y
        )
