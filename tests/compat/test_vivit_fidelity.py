"""The ViViT-compatible classes behave as ViViT 1.0 wherever ViViT 1.0 answered.

ViViT's own criterion examples (keep all, the top one, none, those above a
threshold) on cross-entropy problems, whose Gram matrix has ``N`` exact zero
eigenvalues that come out as rounding-level numbers of either sign: eigenvalues
as computed and equal to the dense reference, ``warn_small_eigvals`` warnings,
finite results, zero vectors (and zero derivatives, no step) for the numerically
zero directions. And the class-major Gram-space order of the ``gram_evecs`` a
damping receives, against a Gram matrix built by hand in ViViT's order.

Tolerances (float64): eigenvalues within ``EIGVAL_RTOL`` = 1e-10·λ_max
(backward-stable solver, ``checks.py``); per-sample quantities and steps built
from resolved directions within ``DIRECTION_REL`` = 1e-8 of the largest entry
(``docs/math.rst``, "Tolerances of the tests": they inherit the eigenvectors'
error, which grows like √(λ_max/λ)); the Gram matrix against one built by hand
within ``REORDERED_REL``.
"""

import functools
import warnings

import pytest
import torch
from backpack import backpack, extend
from torch.func import functional_call, jacrev

from tests.fixtures.checks import (
    DIRECTION_REL,
    EIGVAL_RTOL,
    REORDERED_REL,
    assert_eigenpairs,
    assert_rel,
    flat_evecs,
)
from tests.fixtures.problems import prepare, problem_ids, select
from tests.fixtures.reference import dense_ggn, per_sample_ggns, per_sample_gradients
from vivit import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
    LowRankGGN,
)
from vivit.compat.selection import to_class_major
from vivit.linalg.solvers import numerical_zero_tolerance

PROBLEMS = select(architecture=["mlp_relu", "cnn", "residual"], loss="ce")

#: ViViT 1.0's criterion examples (docstrings of EighComputation and friends).
CRITERIA = {
    "all": lambda evals: list(range(evals.numel())),
    "top_one": lambda evals: [evals.numel() - 1],
    "none": lambda evals: [],
    "above_threshold": lambda evals: [i for i, e in enumerate(evals) if e > 1e-4],
}


def run(computation, groups, model, loss_func, X, y):
    """One backward pass with the computation; the small-eigenvalue warnings."""
    extensions = (
        computation.get_extensions()
        if hasattr(computation, "get_extensions")
        else [computation.get_extension()]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with backpack(
            *extensions, extension_hook=computation.get_extension_hook(groups)
        ):
            loss_func(model(X), y).backward()
    return [
        w
        for w in caught
        if issubclass(w.category, UserWarning) and "eigenvalues are smaller" in str(w)
    ]


@functools.cache
def references(name):
    """Dense GGN, its ``N·C`` Gram eigenvalues, ``G_n`` and ``∇ℓ_n`` of a problem.

    The Gram eigenvalues are the GGN's largest ``N·C`` (zeros prepended if
    ``N·C > D``). Cached: every criterion uses the same float64 problem.
    """
    problem = select_problem(name)
    model, loss_func, X, y = prepare(problem, torch.float64)
    G = dense_ggn(model, loss_func, X, y)
    num_rows = problem.batch_size * problem.num_outputs
    evals = torch.linalg.eigvalsh(G)
    extra = max(num_rows - evals.numel(), 0)
    gram_evals = torch.cat([evals.new_zeros(extra), evals])[-num_rows:]
    G_n = per_sample_ggns(model, loss_func, X, y)
    gradients = per_sample_gradients(model, loss_func, X, y)
    return G, gram_evals, G_n, gradients


def select_problem(name):
    return next(p for p in PROBLEMS if p.name == name)


@pytest.mark.parametrize("criterion", CRITERIA, ids=list(CRITERIA))
@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_criterion_examples(problem, criterion):
    model, loss_func, X, y = prepare(problem, torch.float64)
    params = list(model.parameters())
    G, reference, G_n, per_sample_grads = references(problem.name)
    lam_max = reference.abs().max()

    # the setting this test is about: negative rounding-level Gram eigenvalues
    eigvalsh = EigvalshComputation()
    groups = [{"params": params, "criterion": CRITERIA[criterion]}]
    assert not run(eigvalsh, groups, model, loss_func, X, y)
    all_evals = eigvalsh.get_result(groups[0])
    assert (all_evals < 0).any()
    assert (all_evals - reference).abs().max() <= EIGVAL_RTOL[torch.float64] * lam_max
    keep = CRITERIA[criterion](all_evals)
    tolerance = numerical_zero_tolerance(all_evals)
    resolved = all_evals[keep] > tolerance
    expect_warning = bool((all_evals[keep].abs() < 1e-4).any())
    assert expect_warning == (criterion == "all")

    # eigenpairs: eigenvalues as computed, zero vectors where not resolvable
    eigh = EighComputation()
    caught = run(eigh, groups, model, loss_func, X, y)
    assert bool(caught) == expect_warning
    evals, evecs = eigh.get_result(groups[0])
    assert evals.shape == (len(keep),)
    assert (
        (evals - reference[keep]).abs() <= EIGVAL_RTOL[torch.float64] * lam_max
    ).all()
    E = flat_evecs(evecs)
    assert E.isfinite().all()
    assert (E[~resolved] == 0).all()
    assert_eigenpairs(
        evals[resolved], [e[resolved] for e in evecs], G, all_evals.numel()
    )
    E = E[resolved]

    # directional derivatives: zero along zero vectors, dense values elsewhere
    derivatives = DirectionalDerivativesComputation()
    assert bool(run(derivatives, groups, model, loss_func, X, y)) == expect_warning
    gammas, lambdas = derivatives.get_result(groups[0])
    assert gammas.shape == lambdas.shape == (problem.batch_size, len(keep))
    assert gammas.isfinite().all() and lambdas.isfinite().all()
    assert (gammas[:, ~resolved] == 0).all() and (lambdas[:, ~resolved] == 0).all()
    lambdas_ref = torch.einsum("kd,nde,ke->nk", E, G_n, E)
    assert_rel(lambdas[:, resolved], lambdas_ref, DIRECTION_REL)
    gammas_ref = per_sample_grads @ E.T
    sign = torch.sign((gammas[:, resolved] * gammas_ref).sum(0))  # e_k up to sign
    assert_rel(gammas[:, resolved], gammas_ref * sign, DIRECTION_REL)

    # Newton step with ViViT's constant-damping example: no step along zero vectors
    newton = DirectionalDampedNewtonComputation()
    groups[0]["damping"] = lambda evals, evecs, gammas, lambdas: torch.ones_like(evals)
    assert bool(run(newton, groups, model, loss_func, X, y)) == expect_warning
    step = torch.cat([s.flatten() for s in newton.get_result(groups[0])])
    assert step.isfinite().all()
    R = 1 / problem.batch_size if problem.reduction == "mean" else 1.0
    gradient = R * per_sample_grads.sum(0)
    step_ref = -E.T @ ((E @ gradient) / (evals[resolved] + 1.0))
    if resolved.any():
        assert_rel(step, step_ref, DIRECTION_REL)
    else:
        assert (step == 0).all()


def test_float32_all_eigenpairs_finite():
    """Keep-all in float32: as many rounding-level eigenvalues, still finite."""
    problem = select(architecture="mlp_relu", loss="ce", reduction="sum")[0]
    model, loss_func, X, y = prepare(problem, torch.float32)
    groups = [{"params": list(model.parameters()), "criterion": CRITERIA["all"]}]
    eigh = EighComputation()
    assert run(eigh, groups, model, loss_func, X, y)
    evals, evecs = eigh.get_result(groups[0])
    assert (evals <= 0).any() and evals.dtype == torch.float32
    assert all(e.isfinite().all() and e.dtype == torch.float32 for e in evecs)


def hand_built_gram(model, X, y, reduction):
    """``Vᵀ V`` from ``V = √R [J_nᵀ S_n]`` with the Jacobians of ``torch.func``.

    ``S_n = diag(√p) − p √pᵀ`` (``docs/math.rst``). Returns the Gram matrix in
    ViViT's class-major order (column ``c·N + n``) and in sample-major order.
    """
    names = [name for name, _ in model.named_parameters()]
    theta = tuple(p.detach() for p in model.parameters())

    def output(*values):
        return functional_call(model, dict(zip(names, values, strict=True)), (X,))

    jacobians = jacrev(output, argnums=tuple(range(len(theta))))(*theta)
    N, C = X.shape[0], jacobians[0].shape[1]
    J = torch.cat([j.reshape(N, C, -1) for j in jacobians], dim=2)  # [N, C, D]
    p = output(*theta).detach().softmax(1)
    S = torch.diag_embed(p.sqrt()) - p.unsqueeze(2) * p.sqrt().unsqueeze(1)
    R = 1 / N if reduction == "mean" else 1.0
    V = R**0.5 * torch.einsum("ncd,nce->nde", J, S)  # [N, D, C]: column (n, c)
    V_vivit = V.permute(1, 2, 0).reshape(J.shape[2], C * N)  # column c·N + n
    V_vivit_order = V_vivit.T @ V_vivit
    V_sample = V.permute(1, 0, 2).reshape(J.shape[2], N * C)  # column n·C + c
    return V_vivit_order, V_sample.T @ V_sample


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_damping_receives_class_major_gram_evecs(reduction):
    problem = select(architecture="mlp_tanh", loss="ce", reduction=reduction)[0]
    model, loss_func, X, y = prepare(problem, torch.float64, extend=False)
    gram_vivit, gram_sample = hand_built_gram(model, X, y, reduction)
    model, loss_func = extend(model), extend(loss_func)
    # the same Gram matrix from torch.func's Jacobians: reordered sums
    assert_rel(LowRankGGN(model, loss_func, (X, y)).gram(), gram_sample, REORDERED_REL)

    received = {}

    def damping(evals, gram_evecs, gammas, lambdas):
        received.update(evals=evals, gram_evecs=gram_evecs)
        return torch.ones_like(evals)

    top = 4  # the criterion: the top four directions
    groups = [
        {
            "params": list(model.parameters()),
            "criterion": lambda evals: list(range(evals.numel() - top, evals.numel())),
            "damping": damping,
        }
    ]
    run(DirectionalDampedNewtonComputation(), groups, model, loss_func, X, y)
    evals, evecs = received["evals"], received["gram_evecs"]
    assert evecs.shape == (problem.batch_size * problem.num_outputs, top)
    scale = gram_vivit.norm(2)
    residual = (gram_vivit @ evecs - evecs * evals).norm(dim=0)
    # Gram-space residual: the solver's backward error N·C·ε·λ_max (Weyl)
    assert (residual <= EIGVAL_RTOL[torch.float64] * scale).all(), residual
    # the same vectors read sample-major are no eigenvectors: the order matters
    residual = (gram_sample @ evecs - evecs * evals).norm(dim=0)
    assert (residual > 1e-3 * scale).any()


def test_to_class_major_moves_entry_nc_to_cn():
    N, C = 3, 4
    sample_major = torch.arange(N * C, dtype=torch.float64).unsqueeze(1)  # n·C + c
    class_major = to_class_major(sample_major, C).squeeze(1)
    for n in range(N):
        for c in range(C):
            assert class_major[c * N + n] == n * C + c


@pytest.mark.parametrize(
    "returned",
    [None, 3, [0.5], [[0, 1]], [100], [-100], "top", torch.ones(2, dtype=torch.bool)],
    ids=["none", "int", "float", "nested", "too_large", "too_small", "str", "mask"],
)
def test_malformed_criterion_is_refused(returned):
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    groups = [{"params": list(model.parameters()), "criterion": lambda e: returned}]
    with pytest.raises(ValueError, match="criterion"):
        run(EighComputation(), groups, model, loss_func, X, y)


def test_criterion_may_return_a_mask_or_negative_indices():
    problem = select(architecture="mlp_tanh", loss="ce", reduction="mean")[0]
    model, loss_func, X, y = prepare(problem, torch.float64)
    results = []
    for criterion in (lambda e: e > 1e-4, lambda e: [-2, -1], lambda e: [13, 14]):
        groups = [{"params": list(model.parameters()), "criterion": criterion}]
        eigh = EighComputation()
        run(eigh, groups, model, loss_func, X, y)
        results.append(eigh.get_result(groups[0])[0])
    mask, negative, positive = results
    assert torch.equal(negative, positive)
    assert torch.equal(mask[-2:], positive)
