"""Papyan's hierarchy (``vivit.analysis.hierarchy``) against the dense float64 GGN.

The dense parts are built as Papyan writes them (``tests/analysis/dense.py``:
pair means of the columns ``v_nc = √R J_nᵀ s_nc``, from ``torch.func``), with
plain and probability-weighted means, on several architectures and both
reductions, with one parameter group per layer (the full GGN then the sum of
their Gram matrices). ``docs/math.rst``, "Hierarchy of the spectrum": each part
is ``V A Aᵀ Vᵀ``, its eigenvalues those of ``Aᵀ (G̃ + E) A`` with ``‖E‖`` the
Gram error, so within ``N·C·ε·λ_max`` of the dense part's (Weyl: ``EIGVAL_RTOL``,
"Tolerances of the tests"); the parts' eigenvectors ``V A s / √μ`` and the
overlaps built from them are products with eigenvectors (``DIRECTION_REL``:
every direction of a part enters, down to the numerical zero).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch
from torch import Tensor

from tests.analysis.dense import dense_columns, dense_parts
from tests.fixtures.checks import (
    DIRECTION_REL,
    EIGVAL_RTOL,
    assert_top_eigvals,
    assert_within,
    layer_groups,
)
from tests.fixtures.problems import Setup, get_problem, prepare, problem_ids, select
from tests.fixtures.reference import dense_ggn, eigh_reference
from vivit import InvalidArgumentError, LowRankGGN
from vivit.analysis import Hierarchy, SpectrumPart, hierarchy

PROBLEMS = select(
    architecture=["mlp_tanh", "mlp_relu", "conv1d", "residual", "batchnorm1d"],
    loss="ce",
)
WEIGHTINGS = ("plain", "probabilities")
PARTS = ("class_means", "cross_class", "within_class")
RTOL = EIGVAL_RTOL[torch.float64]


class Case(NamedTuple):
    setup: Setup
    ggn: LowRankGGN
    parts: Hierarchy
    columns: Tensor  # [D, N, C]
    probabilities: Tensor | None
    dense: dict[str, Tensor]  # Papyan's parts, [D, D] each
    G: Tensor


@functools.cache
def case(name: str, weighting: str, subsampling: tuple[int, ...] | None = None) -> Case:
    """The problem's hierarchy from vivit and its dense parts."""
    (problem,) = [p for p in PROBLEMS if p.name == name]
    setup = prepare(problem, torch.float64)
    model, loss_func, X, y = setup
    ggn = LowRankGGN(
        model,
        loss_func,
        (X, y),
        param_groups=layer_groups(model),
        subsampling=None if subsampling is None else list(subsampling),
    )
    if subsampling is not None:  # the GGN of the loss on these samples
        X, y = X[list(subsampling)], y[list(subsampling)]
    columns, p = dense_columns(model, loss_func, X, y)
    probabilities = p if weighting == "probabilities" else None
    parts = hierarchy(ggn, y, probabilities="plain" if probabilities is None else p)
    return Case(
        setup,
        ggn,
        parts,
        columns,
        probabilities,
        dense_parts(columns, y, probabilities),
        dense_ggn(model, loss_func, X, y),
    )


def in_parameters(c: Case, coefficients: Tensor) -> Tensor:
    """Eigenvectors ``V @ coefficients`` from the dense columns, ``[D, K]``."""
    D = c.columns.shape[0]
    return c.columns.reshape(D, -1) @ coefficients


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_dense_columns_and_parts_sum_to_the_ggn(problem, weighting):
    """The test's own construction: ``V Vᵀ = G`` and Papyan's parts sum to it."""
    c = case(problem.name, weighting)
    D = c.G.shape[0]
    V = c.columns.reshape(D, -1)
    scale = c.G.abs().max()
    assert_within(V @ V.T, c.G, RTOL * scale)
    assert_within(sum(c.dense.values()), c.G, RTOL * scale)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_parts_sum_to_the_dense_ggn(problem, weighting):
    """``Σ_parts E diag(μ) Eᵀ = G``, every part from vivit's eigenpairs.

    Dropped eigenvalues are at most ``τ`` each (at most ``N·C`` of them), the
    kept ones within ``N·C·ε·λ_max``: ``RTOL·λ_max`` per part, and ``N·C·τ``.
    """
    c = case(problem.name, weighting)
    total = torch.zeros_like(c.G)
    for name in PARTS:
        part = c.parts.part(name)
        E = in_parameters(c, part.coefficients)
        total += E @ torch.diag(part.eigenvalues) @ E.T
    lam_max = c.parts.full.eigenvalues[0].item()
    tolerance = (
        len(PARTS) * RTOL * lam_max + c.parts.gram.shape[0] * c.parts.zero_tolerance
    )
    assert_within(total, c.G, tolerance)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_part_spectra_match_the_dense_parts(problem, weighting):
    """Each part's eigenvalues are the dense part's non-zero ones; ranks ≤ C, C(C−1)."""
    c = case(problem.name, weighting)
    C = c.columns.shape[2]
    lam_max = c.parts.full.eigenvalues[0].item()
    for name in ("full", *PARTS):
        part = c.parts.part(name)
        dense = c.G if name == "full" else c.dense[name]
        reference = torch.linalg.eigvalsh(dense)
        assert_top_eigvals(
            part.eigenvalues.flip(0), reference, RTOL * lam_max / reference.abs().max()
        )
        rest = reference[: reference.numel() - part.eigenvalues.numel()]
        assert (rest <= c.parts.zero_tolerance + RTOL * lam_max).all()
        E = in_parameters(c, part.coefficients)  # unit, orthogonal, eigenvectors
        assert_within(E.T @ E, torch.eye(E.shape[1], dtype=E.dtype), DIRECTION_REL)
    assert c.parts.class_means.eigenvalues.numel() <= C
    assert c.parts.cross_class.eigenvalues.numel() <= C * (C - 1)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_overlaps_match_dense_eigenvectors(problem, weighting):
    """``‖E_fullᵀ E_part‖_F² / k`` from Gram space equals that of dense eigenvectors."""
    c = case(problem.name, weighting)
    C = c.columns.shape[2]
    _, full_vectors = eigh_reference(c.G)
    for name in PARTS:
        evals, vectors = eigh_reference(c.dense[name])
        top_k = min(C, c.parts.part(name).eigenvalues.numel())
        if top_k == 0:
            continue
        part_space = vectors[:, -top_k:]
        for full_top_k in (C, 2 * C):
            full_space = full_vectors[:, -full_top_k:]
            expected = (full_space.T @ part_space).square().sum() / top_k
            actual = c.parts.overlap(name, top_k, full_top_k)
            assert abs(actual - expected.item()) <= DIRECTION_REL, (
                name,
                actual,
                expected,
            )


@pytest.mark.parametrize("problem", PROBLEMS[:2], ids=problem_ids(PROBLEMS[:2]))
def test_group_spectra_are_the_layer_blocks(problem):
    """Each group's spectrum is that of its diagonal block of the dense GGN."""
    c = case(problem.name, "plain")
    sizes = [sum(p.numel() for p in group) for group in c.ggn.param_groups]
    start = 0
    lam_max = c.parts.full.eigenvalues[0].item()
    for size, spectrum in zip(sizes, c.parts.group_spectra, strict=True):
        block = c.G[start : start + size, start : start + size]
        reference = torch.linalg.eigvalsh(block)
        assert_top_eigvals(spectrum, reference, RTOL * lam_max / reference.abs().max())
        start += size
    assert start == c.G.shape[0]


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_subsampled_ggn(weighting):
    """With ``subsampling``, the labels of those samples: the GGN of their loss."""
    c = case("mlp_relu-ce-mean", weighting, (4, 0, 2, 5))
    lam_max = c.parts.full.eigenvalues[0].item()
    for name in ("full", *PARTS):
        dense = c.G if name == "full" else c.dense[name]
        reference = torch.linalg.eigvalsh(dense)
        part = c.parts.part(name)
        assert_top_eigvals(
            part.eigenvalues.flip(0), reference, RTOL * lam_max / reference.abs().max()
        )


def test_groups_select_the_analysed_parameters():
    """``groups=[g]`` analyses that group's GGN block alone."""
    c = case("mlp_tanh-ce-sum", "plain")
    _, _, _, y = c.setup
    first = hierarchy(c.ggn, y, probabilities="plain", groups=[0])
    assert_within(first.gram, c.ggn.gram(0), 0.0)
    assert_within(
        first.full.eigenvalues.flip(0),
        c.ggn.eigvalsh(0)[-first.full.eigenvalues.numel() :],
        RTOL * first.full.eigenvalues[0].item(),
    )


def test_bad_input_is_refused():
    c = case("mlp_tanh-ce-mean", "plain")
    _, _, _, y = c.setup
    plain = functools.partial(hierarchy, c.ggn, probabilities="plain")
    with pytest.raises(InvalidArgumentError, match="1-d integer"):
        plain(y.double())
    with pytest.raises(InvalidArgumentError, match="not C rows for each of the 4"):
        plain(y[:4])
    with pytest.raises(InvalidArgumentError, match=r"must lie in \[0, 3\)"):
        plain(y + 3)
    with pytest.raises(InvalidArgumentError, match="groups is empty"):
        plain(y, groups=[])
    with pytest.raises(InvalidArgumentError, match="softmax.*'plain'"):  # no default
        hierarchy(c.ggn, y)
    for wrong, match in [
        (torch.ones(len(y), 2), "shape"),
        ("papyan", "or 'plain'"),
        (-torch.ones(len(y), 3), "non-negative"),
        (torch.rand(len(y), 3).softmax(0), "sum to 1"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            hierarchy(c.ggn, y, probabilities=wrong)
    with pytest.raises(InvalidArgumentError, match="No part 'class'"):
        c.parts.part("class")
    with pytest.raises(InvalidArgumentError, match="top_k must be a positive"):
        c.parts.overlap("class_means", 0)


def test_a_part_without_non_zero_eigenvalues_has_overlap_zero():
    c = case("mlp_tanh-ce-mean", "plain")
    empty = SpectrumPart(torch.zeros(0), c.parts.gram.new_zeros(len(c.parts.gram), 0))
    parts = dataclasses.replace(c.parts, class_means=empty)
    assert parts.overlap("class_means", 3) == 0.0
    assert c.parts.overlap("class_means", 3) > 0


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_float32_model(weighting):
    """A float32 model's float32 Gram matrix: the parts' eigenvalues within
    ``EIGVAL_RTOL[float32]·λ_max`` of the dense float64 parts of the same numbers."""
    c = case("mlp_relu-ce-sum", weighting)
    model, loss_func, X, y = prepare(get_problem("mlp_relu-ce-sum"), torch.float32)
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=layer_groups(model))
    probabilities = "plain" if c.probabilities is None else c.probabilities.float()
    parts = hierarchy(ggn, y, probabilities=probabilities)
    assert parts.gram.dtype == torch.float32
    lam_max = c.parts.full.eigenvalues[0].item()
    rtol = EIGVAL_RTOL[torch.float32]
    for name in ("full", *PARTS):
        dense = c.G if name == "full" else c.dense[name]
        reference = torch.linalg.eigvalsh(dense)
        evals = parts.part(name).eigenvalues.flip(0)
        assert_top_eigvals(evals, reference, rtol * lam_max / reference.abs().max())


def test_papyan_weighting_on_an_imbalanced_batch():
    """Labels 4 : 1 : 1: the parts with ``probabilities=p`` are Papyan's (dense,
    ``tests/analysis/dense.py``), the ``"plain"`` ones the plain-mean variant's,
    and the result names its weighting. The two class parts differ by far more
    than the tolerance (``EIGVAL_RTOL``, "Hierarchy of the spectrum", Precision):
    which of them a result holds matters."""
    model, loss_func, X, _ = prepare(get_problem("mlp_relu-ce-sum"), torch.float64)
    y = torch.tensor([0, 0, 0, 0, 1, 2])
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=layer_groups(model))
    columns, p = dense_columns(model, loss_func, X, y)
    G = dense_ggn(model, loss_func, X, y)
    lam_max = torch.linalg.eigvalsh(G)[-1].item()
    largest = {}
    for weighting, probabilities in (("probabilities", p), ("plain", None)):
        parts = hierarchy(ggn, y, probabilities="plain" if probabilities is None else p)
        assert parts.weighting == weighting
        dense = dense_parts(columns, y, probabilities)
        for name in PARTS:
            reference = torch.linalg.eigvalsh(dense[name])
            evals = parts.part(name).eigenvalues.flip(0)
            assert_top_eigvals(evals, reference, RTOL * lam_max / reference.abs().max())
        largest[weighting] = parts.class_means.eigenvalues[0].item()
    gap = abs(largest["probabilities"] - largest["plain"])
    assert gap > 1e3 * RTOL * lam_max, largest


def test_probabilities_of_a_float32_softmax_cast_up_are_accepted():
    """Their sum carries float32 rounding, within ``2·C·ε₃₂`` of one."""
    c = case("mlp_tanh-ce-mean", "plain")
    model, _, X, y = c.setup
    probabilities = model.float()(X.float()).softmax(1).double()
    model.double()
    parts = hierarchy(c.ggn, y, probabilities=probabilities)
    assert parts.weighting == "probabilities"
