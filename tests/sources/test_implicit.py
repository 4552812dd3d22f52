"""The implicit route (``route="implicit"``) against the dense float64 reference
and the Gram route (``docs/math.rst``, "Implicit GGN-vector products").

Tolerances (:ref:`math-test-tolerances`): ``G v`` is the dense reference's sum in
another order (``REORDERED_REL`` of ``‖G‖·‖v‖``); eigenvalues of block Krylov on
``G`` within ``tol·λ_max`` (``EIGVAL_RTOL``, the iterative solvers' bound);
``γ``, ``λ`` and Newton steps of the leading directions, products with
eigenvectors (``EIGVEC_PRODUCT_REL``).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import vivit.memory.plan
from tests.fixtures.checks import (
    EIGVAL_RTOL,
    REORDERED_REL,
    REORDERED_REL32,
    align_signs,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
    flat_evecs,
    rounding_rel,
)
from tests.fixtures.func_problems import (
    FUNC_PROBLEMS,
    PADDED_PROBLEMS,
    NoForwardMode,
)
from tests.fixtures.memory import available, smallest_basis_memory
from tests.fixtures.reference import dense_ggn
from vivit import (
    FewerEigenpairsWarning,
    LowRankGGN,
    RoundingFloorWarning,
    StreamingGGN,
)
from vivit.eigenpairs import warn_unresolved_eigenpairs
from vivit.errors import (
    InvalidArgumentError,
    ModelChangedError,
    ProductsTooLargeError,
    UnsupportedLayerError,
)
from vivit.linalg.iterative import SolverReport
from vivit.linalg.solvers import numerical_zero_tolerance
from vivit.linalg.top_k import IMPLICIT_BLOCK
from vivit.memory import estimate_memory
from vivit.memory.plan import ESTIMATE_FACTOR
from vivit.optim import DampedNewton
from vivit.sources import implicit as implicit_source

PROBLEMS = {p.name: p for p in FUNC_PROBLEMS + PADDED_PROBLEMS}
TOP_K = 3


def _assert_product(actual: torch.Tensor, G: torch.Tensor, v: torch.Tensor) -> None:
    """``G v`` within ``REORDERED_REL·‖G‖·‖v‖`` (reordered sums)."""
    bound = REORDERED_REL * G.norm(2).item() * v.norm(dim=0).max().item()
    assert (actual - G @ v).abs().max().item() <= bound


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_ggn_vector_products_match_dense(name):
    s = PROBLEMS[name].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets), route="implicit")
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    v = torch.randn(
        G.shape[0], 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    _assert_product(ggn.operator().matvec(v), G, v)
    assert ggn.engine == "implicit"


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_eigenpairs_match_dense(name):
    s = PROBLEMS[name].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets), route="implicit")
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    evals, evecs = ggn.eigh(top_k=TOP_K)
    report = ggn.solver_report()
    assert report.solver == "ggn_krylov" and report.converged
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])
    nc = ggn._source.group(0).num_rows
    assert_eigenpairs(evals, evecs, G, nc, tol=report.tolerance)
    assert report.tolerance == report.requested_tolerance  # no rounding floor


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_narrow_blocks_match_dense(name):
    """Top 8 in blocks of ``IMPLICIT_BLOCK``: every problem's spectrum is
    certain without a wider block (``docs/math.rst``, "Narrow blocks")."""
    s = PROBLEMS[name].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets), route="implicit")
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    evals, evecs = ggn.eigh(top_k=8)
    report = ggn.solver_report()
    assert report.block_size == IMPLICIT_BLOCK and report.widened is None
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])
    nc = ggn._source.group(0).num_rows
    assert_eigenpairs(evals, evecs, G, nc, tol=report.tolerance)


@pytest.mark.parametrize("name", ["causal-lm-ce-mean", "twice-bce-sum"])
def test_one_group_per_layer_matches_the_blocks_of_dense(name):
    """Parameter groups: each group's products run while the other groups'
    parameters require grad, and equal the dense GGN's diagonal blocks."""
    s = PROBLEMS[name].setup()
    groups = [list(m.parameters(recurse=False)) for m in s.model.modules()]
    groups = [g for g in groups if g]
    ggn = LowRankGGN(
        s.model,
        s.loss_func,
        (s.inputs, s.targets),
        param_groups=groups,
        route="implicit",
    )
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    order = {id(p): i for i, p in enumerate(s.model.parameters())}
    sizes = [p.numel() for p in s.model.parameters()]
    offsets = torch.tensor([0, *sizes]).cumsum(0).tolist()
    for index, group in enumerate(groups):
        rows = torch.cat(
            [
                torch.arange(offsets[order[id(p)]], offsets[order[id(p)] + 1])
                for p in group
            ]
        )
        block = G[rows][:, rows]
        evals, _ = ggn.eigh(top_k=min(4, len(rows)), group=index)
        assert_top_eigvals(
            evals, torch.linalg.eigvalsh(block), EIGVAL_RTOL[torch.float64]
        )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_copies_of_multiple_eigenvalues_are_all_found(reduction):
    """A linear layer under MSE: ``G = c Σ x̃ x̃ᵀ ⊗ I₃``, every eigenvalue three
    times. Blocks of ``b = IMPLICIT_BLOCK ≤ 3`` see clusters of ``b`` above smaller
    eigenvalues, so the top 7 are solved again with ``b = 7`` and match the
    reference."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(4, 3).double()
    X = torch.randn(6, 4, dtype=torch.float64, generator=generator)
    y = torch.randn(6, 3, dtype=torch.float64, generator=generator)
    loss_func = nn.MSELoss(reduction=reduction)
    ggn = LowRankGGN(model, loss_func, (X, y), route="implicit")
    G = dense_ggn(model, loss_func, X, y)
    evals, evecs = ggn.eigh(top_k=7)
    report = ggn.solver_report()
    assert report.block_size == 7
    assert f"{IMPLICIT_BLOCK} Ritz values" in report.widened
    reference = torch.linalg.eigvalsh(G)
    # the two leading eigenvalues, three copies each (the reference's own D·ε)
    triples = reference[-6:].view(2, 3)
    assert (triples - triples[:, :1]).abs().max() <= REORDERED_REL * reference[-1]
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float64])
    assert_eigenpairs(evals, evecs, G, ggn._source.group(0).num_rows, report.tolerance)


@pytest.mark.parametrize("name", ["lstm-ce-mean", "lstm-ce-sum", "twice-bce-sum"])
@pytest.mark.parametrize("subsampling", [None, [2, 0]])
def test_directional_and_newton_match_gram_route(name, subsampling):
    s = PROBLEMS[name].setup()
    data = (s.inputs, s.targets)
    implicit = LowRankGGN(
        s.model, s.loss_func, data, route="implicit", subsampling=subsampling
    )
    gram = LowRankGGN(s.model, s.loss_func, data, subsampling=subsampling)
    ours, theirs = implicit.newton(top_k=TOP_K), gram.newton(top_k=TOP_K)
    assert_rel(ours.directional.evals, theirs.directional.evals)
    assert_rel(ours.directional.lambdas, theirs.directional.lambdas)
    gammas = theirs.directional.gammas
    assert_rel(align_signs(ours.directional.gammas, gammas), gammas)
    assert_rel(
        flat_evecs([s.unsqueeze(0) for s in ours.step]),
        flat_evecs([s.unsqueeze(0) for s in theirs.step]),
    )
    for a, b in zip(implicit.gradient(), gram.gradient(), strict=True):
        assert_rel(a, b, REORDERED_REL)


@pytest.mark.parametrize("name", ["lstm-ce-mean", "causal-lm-ce-sum"])
def test_passes_of_fewer_vectors_match_dense(monkeypatch, name):
    """Where one vector's tangents fill :data:`PASS_BYTES` (here 1 byte), every
    product and γ/λ pass takes one vector at a time; the results equal the
    reference and the Gram route."""
    monkeypatch.setattr(vivit.memory.plan, "PASS_BYTES", 1)
    s = PROBLEMS[name].setup()
    data = (s.inputs, s.targets)
    implicit = LowRankGGN(s.model, s.loss_func, data, route="implicit")
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    v = torch.randn(G.shape[0], 4, dtype=G.dtype, generator=torch.Generator())
    _assert_product(implicit.operator().matvec(v), G, v)
    gram = LowRankGGN(s.model, s.loss_func, data)
    ours, theirs = implicit.newton(top_k=TOP_K), gram.newton(top_k=TOP_K)
    assert_rel(ours.directional.evals, theirs.directional.evals)
    assert_rel(ours.directional.lambdas, theirs.directional.lambdas)
    gammas = theirs.directional.gammas
    assert_rel(align_signs(ours.directional.gammas, gammas), gammas)
    assert implicit.plan.pass_width(TOP_K) == 1  # one vector per pass


@pytest.mark.parametrize("name", ["lstm-ce-mean", "groupnorm-bce-mean"])
def test_loader_and_chunks_equal_one_batch(name):
    s = PROBLEMS[name].setup()
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    loader = [(s.inputs[:1], s.targets[:1]), (s.inputs[1:], s.targets[1:])]
    v = torch.randn(G.shape[0], 2, dtype=torch.float64)
    for data, chunk_size in [(loader, None), ((s.inputs, s.targets), 2)]:
        ggn = LowRankGGN(
            s.model, s.loss_func, data, route="implicit", chunk_size=chunk_size
        )
        _assert_product(ggn.operator().matvec(v), G, v)
        assert_rel(
            ggn.loss, s.loss_func(s.model(s.inputs), s.targets).detach(), REORDERED_REL
        )


def test_blocks_whose_targets_are_all_ignored_carry_no_weight():
    """A chunk or loader batch without a counted target adds nothing (as in the
    Gram route, ``docs/math.rst``, "Data sets and processes")."""
    torch.manual_seed(0)
    model = nn.Linear(2, 4).double()
    loss_func = nn.CrossEntropyLoss(ignore_index=-100)
    X = torch.randn(4, 2, dtype=torch.float64)
    y = torch.tensor([-100, 1, 3, -100])
    G = dense_ggn(model, loss_func, X, y)
    v = torch.randn(G.shape[0], 2, dtype=torch.float64)
    loader = [(X[:1], y[:1]), (X[1:], y[1:])]
    for data, chunk_size in [(loader, None), ((X, y), 1)]:
        ggn = LowRankGGN(
            model, loss_func, data, route="implicit", chunk_size=chunk_size
        )
        _assert_product(ggn.operator().matvec(v), G, v)
        assert_rel(ggn.loss, loss_func(model(X), y).detach(), REORDERED_REL)


@pytest.mark.parametrize("name", ["lstm-ce-mean", "lstm-ce-sum"])
def test_float32_lstm_products_match_dense(name):
    """oneDNN's float32 LSTM has no JVP: the native kernel runs instead.

    A float32 product is the float64 one reordered and rounded in float32
    (``REORDERED_REL32`` of ``‖G‖·‖v‖``).
    """
    s, s32 = PROBLEMS[name].setup(), PROBLEMS[name].setup(torch.float32)
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    ggn = LowRankGGN(
        s32.model, s32.loss_func, (s32.inputs, s32.targets), route="implicit"
    )
    v = torch.randn(G.shape[0], 2, generator=torch.Generator().manual_seed(0))
    actual = ggn.operator().matvec(v).double()
    bound = REORDERED_REL32 * G.norm(2).item() * v.norm(dim=0).max().item()
    assert (actual - G @ v.double()).abs().max().item() <= bound
    assert torch.backends.mkldnn.enabled  # restored after the passes


def test_subsampled_products_match_dense():
    s = PROBLEMS["transformer-ce-mean"].setup()
    subsampling = [3, 1]
    ggn = LowRankGGN(
        s.model,
        s.loss_func,
        (s.inputs, s.targets),
        route="implicit",
        subsampling=subsampling,
    )
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets, subsampling=subsampling)
    v = torch.randn(G.shape[0], 2, dtype=torch.float64)
    _assert_product(ggn.operator().matvec(v), G, v)


def test_damped_newton_runs_implicit():
    s = PROBLEMS["twice-mse-mean"].setup()
    before = [p.detach().clone() for p in s.model.parameters()]
    optimizer = DampedNewton(
        s.model.parameters(),
        top_k=2,
        route="implicit",
        model=s.model,
        loss_func=s.loss_func,
    )
    optimizer.step(data=(s.inputs, s.targets))
    after = list(s.model.parameters())
    assert any((a - b).abs().max() > 0 for a, b in zip(after, before, strict=True))


def _implicit():
    s = PROBLEMS["twice-mse-mean"].setup()
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets), route="implicit")
    return s, ggn


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda g: g.gram(), "forms neither V nor the Gram"),
        (lambda g: g.eigvalsh(), "forms neither V nor the Gram"),
        (lambda g: g.zero_tolerance(), "forms neither V nor the Gram"),
        (lambda g: g.eigh(), "pass top_k"),
        (lambda g: g.eigh(top_k=2, solver="dense"), "never forms"),
    ],
)
def test_refuses_what_needs_the_gram_matrix(call, match):
    _, ggn = _implicit()
    with pytest.raises(InvalidArgumentError, match=match):
        call(ggn)


def test_refuses_a_large_part_of_the_spectrum(monkeypatch):
    """More than a quarter of the ``min(D, N·C·T)`` non-zero pairs (and more
    than ``FEW_PAIRS``) is refused before any product, pointing to the dense
    solver; up to that bound the pairs are computed."""
    monkeypatch.setattr(implicit_source, "FEW_PAIRS", 2)
    s, ggn = _implicit()
    rank = min(ggn._source.group(0).num_rows, ggn._source.group(0).num_params)
    passes = ggn._source.passes
    with pytest.raises(InvalidArgumentError, match="solver='dense'"):
        ggn.eigh(top_k=rank // 4 + 1)
    assert ggn._source.passes == passes
    evals, _ = ggn.eigh(top_k=rank // 4)
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])


@pytest.mark.parametrize(
    "options, match",
    [
        ({"mc_samples": 1}, "Monte-Carlo"),
        ({"gram_dtype": torch.float64}, "gram_dtype"),
        ({"engine": "backpack"}, "runs no engine"),
    ],
)
def test_refuses_options(options, match):
    s = PROBLEMS["twice-mse-mean"].setup()
    with pytest.raises(InvalidArgumentError, match=match):
        LowRankGGN(
            s.model, s.loss_func, (s.inputs, s.targets), route="implicit", **options
        )


def test_refuses_implicit_on_gram_routes_and_iterators():
    s = PROBLEMS["twice-mse-mean"].setup()
    data = (s.inputs, s.targets)
    with pytest.raises(InvalidArgumentError, match="chosen at construction"):
        LowRankGGN(s.model, s.loss_func, data).eigh(top_k=2, solver="implicit")
    with pytest.raises(InvalidArgumentError, match="route of LowRankGGN"):
        StreamingGGN(s.model, s.loss_func, [data], route="implicit")
    with pytest.raises(InvalidArgumentError, match="passed over once"):
        LowRankGGN(s.model, s.loss_func, iter([data]), route="implicit")


def test_refuses_a_changed_model():
    s, ggn = _implicit()
    with torch.no_grad():
        next(s.model.parameters()).add_(1.0)
    with pytest.raises(ModelChangedError):
        ggn.eigh(top_k=2)


class TwiceJVP(NoForwardMode):
    """The same, with a JVP rule twice its backward: ``J v`` of another function."""

    generate_vmap_rule = False

    @staticmethod
    def jvp(ctx, tangent):
        return 2 * tangent

    @staticmethod
    def vmap(info, in_dims, x):
        return x.clone(), in_dims[0]


class LinearThen(nn.Module):
    """A Linear layer followed by an autograd function."""

    def __init__(self, function: type[torch.autograd.Function]):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.function = function

    def forward(self, x):
        return self.function.apply(self.lin(x))


def _mse_batch():
    return torch.randn(4, 3).double(), torch.randn(4, 2).double()


def test_unsupported_forward_ad_is_named():
    model = LinearThen(NoForwardMode).double()
    # the construction's check of forward against reverse mode finds it
    with pytest.raises(NotImplementedError, match="implicit route computes J v"):
        LowRankGGN(model, nn.MSELoss(), _mse_batch(), route="implicit")


def test_forward_and_reverse_mode_that_disagree_are_refused():
    model = LinearThen(TwiceJVP).double()
    with pytest.raises(
        UnsupportedLayerError, match="derivatives of this model disagree"
    ):
        LowRankGGN(model, nn.MSELoss(), _mse_batch(), route="implicit")


class PaddedTokens(nn.Module):
    """An embedding with a padding row, optionally tied to the output layer."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embedding = nn.Embedding(6, 3, padding_idx=0)
        self.head = nn.Linear(3, 6, bias=False)
        if tied:
            self.head.weight = self.embedding.weight

    def forward(self, x):
        return self.head(torch.tanh(self.embedding(x))).transpose(1, 2)


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_padding_rows_are_constants_as_in_reverse_mode(tied):
    """Reverse mode gives the padding row no gradient through the embedding
    (forward mode would give it a tangent): the GGN of the dense reference."""
    torch.manual_seed(0)
    model = PaddedTokens(tied).double()
    x = torch.tensor([[0, 1, 2, 0], [3, 0, 4, 5], [0, 0, 1, 2]])
    y = torch.randint(0, 6, (3, 4))
    loss_func = nn.CrossEntropyLoss()
    ggn = LowRankGGN(model, loss_func, (x, y), route="implicit")
    G = dense_ggn(model, loss_func, x, y)
    v = torch.randn(G.shape[0], 3, dtype=torch.float64)
    _assert_product(ggn.operator().matvec(v), G, v)


class ShiftedLogits(nn.Module):
    """A linear classifier plus ``scale`` times a learned shift of every logit.

    Cross-entropy's Hessian annihilates a shift of all logits, so ``J v`` along
    the shift is large and ``H J v`` cancels it: the float32 products round at
    about ``ε₃₂·scale²`` of ``‖G‖``, above the default tolerance ``100·ε₃₂``
    (the mechanism of GPT-2's products, ``docs/math.rst``, "Implicit GGN-vector
    products", "Rounding of the products").
    """

    def __init__(self, scale: float):
        super().__init__()
        self.linear = nn.Linear(6, 50)
        self.shift = nn.Parameter(torch.zeros(1))
        self.scale = scale

    def forward(self, x):
        return self.linear(x) + self.scale * self.shift


def test_float32_products_at_their_rounding_floor_match_dense():
    """The solver stagnated at the products' rounding (SolverNotConvergedError);
    it now accepts the pairs at twice the measured rounding ``ρ``, warns, and they
    are within ``1.5·tolerance·λ_max`` of the dense float64 reference ("The Gram
    matrix and exact eigenpairs", "Rounding floor of the products")."""
    torch.manual_seed(0)
    model, loss_func = ShiftedLogits(1e3), nn.CrossEntropyLoss()
    x, y = torch.randn(4, 6), torch.randint(0, 50, (4,))
    ggn = LowRankGGN(model, loss_func, (x, y), route="implicit")
    with pytest.warns(RoundingFloorWarning, match="float64 products"):
        evals, evecs = ggn.eigh(top_k=TOP_K)
    report = ggn.solver_report()
    assert report.converged and report.tolerance == 2 * report.rounding
    assert report.tolerance > report.requested_tolerance
    model64 = model.double()
    G = dense_ggn(model64, loss_func, x.double(), y)
    bound = 1.5 * report.tolerance
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), bound)
    vectors, evals = flat_evecs(evecs).T, evals.double()
    residual = (G @ vectors - vectors * evals).norm(dim=0).max()
    assert residual <= bound * evals.max()


class ScaledSequenceLinear(nn.Module):
    """A linear map of every position's features, scaled per feature, to logits.

    Output ``[N, C, T]``. Feature ``j`` scaled by ``s_j`` gives ``C − 1``
    eigenvalues of order ``s_j²`` (cross-entropy's Hessian has rank ``C − 1``)
    and ``G`` has the zero eigenvalues of the weights' shift of all logits: a
    spectrum of separated blocks ``1, 10⁻², 10⁻⁴`` and zeros.
    """

    def __init__(self, scales: list[float], classes: int):
        super().__init__()
        self.register_buffer("scales", torch.tensor(scales))
        self.linear = nn.Linear(len(scales), classes, bias=False)

    def forward(self, x):
        return self.linear(x * self.scales).transpose(1, 2)


def _assert_resolved_pairs(ggn, top_k, evals, evecs, G, zero):
    """The pairs a parameter-space solve returns are those above the residual bound
    ``τ_G = (r + ρ)·θ_max``, each within it of ``G``'s eigenpairs; the
    pairs it drops have eigenvalues of at most ``2·τ_G`` ("Without the Gram
    matrix: the residual bound")."""
    report = ggn.solver_report()
    rounding = report.rounding
    assert zero == ggn.zero_tolerance()
    assert report.residual <= report.tolerance
    expected = (report.residual + rounding) * evals.max().item()
    assert zero == pytest.approx(expected, rel=rounding_rel(3))  # ("Few operations")
    assert (evals > zero).all()
    reference = torch.linalg.eigvalsh(G)
    assert_top_eigvals(evals, reference, zero / reference.max().item())
    vectors = flat_evecs(evecs).T
    residuals = (G @ vectors - vectors * evals.double()).norm(dim=0)
    assert (residuals <= zero).all()
    dropped = reference[-top_k : -evals.numel()]
    assert (dropped <= 2 * zero).all()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("subsampling", [None, [0, 3, 5]])
def test_pairs_above_the_residual_bound_are_returned(reduction, subsampling):
    """Without a Gram matrix, the pairs returned are those the solver's residual
    bound resolves, ``(r + ρ)·θ_max``: the 12 non-zero eigenvalues among
    the top 13, down to ``10⁻⁴ λ_max``. The Gram matrix's numerical zero
    (``N·C·T·ε₃₂·λ_max = 7.2·10⁻⁴ λ_max`` for ``N·C·T = 6,000``) dropped 4 of
    them ("Without the Gram matrix: the residual bound")."""
    torch.manual_seed(0)
    model = ScaledSequenceLinear([1.0, 0.1, 0.01], 5)
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    x, y = torch.randn(6, 200, 3), torch.randint(0, 5, (6, 200))
    ggn = LowRankGGN(
        model, loss_func, (x, y), route="implicit", subsampling=subsampling
    )
    with pytest.warns(FewerEigenpairsWarning, match="1 of the 13 leading Ritz"):
        evals, evecs = ggn.eigh(top_k=13)
    report = ggn.solver_report()  # no floor: the rounding is measured, below tol/2
    assert report.tolerance == report.requested_tolerance
    assert report.rounding <= report.tolerance / 2
    G = dense_ggn(
        copy.deepcopy(model).double(), loss_func, x.double(), y, subsampling=subsampling
    )
    assert evals.numel() == 12
    # the 13th is a zero eigenvalue of G: within the numerical zero of a float64
    # eigendecomposition ("Precision and the numerical zero")
    reference = torch.linalg.eigvalsh(G)
    assert (reference[-13:-12] <= numerical_zero_tolerance(reference)).all()
    _assert_resolved_pairs(ggn, 13, evals, evecs, G, ggn.zero_tolerance())
    with pytest.warns(FewerEigenpairsWarning):
        directional = ggn.directional_derivatives(top_k=13)
    assert torch.equal(directional.evals, evals)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_pairs_below_the_rounding_floor_are_not_returned(reduction):
    """At the products' rounding floor (``ρ`` of order ``0.1 θ_max``, the shift of
    :class:`ShiftedLogits` on inputs of small norm) Ritz values at or below
    ``(r + ρ)·θ_max`` cannot be told from zero: they are dropped with a warning
    that names the float64 model, where the Gram rule kept them."""
    torch.manual_seed(0)
    model, loss_func = ShiftedLogits(1e3), nn.CrossEntropyLoss(reduction=reduction)
    scales = torch.tensor([1.0, 0.5, 0.2, 0.1, 0.05, 0.02])
    x, y = torch.randn(4, 6) * scales, torch.randint(0, 50, (4,))
    ggn = LowRankGGN(model, loss_func, (x, y), route="implicit")
    with (
        pytest.warns(RoundingFloorWarning),
        pytest.warns(FewerEigenpairsWarning, match=r"model\.double\(\)"),
    ):
        evals, evecs = ggn.eigh(top_k=100)
    assert ggn.solver_report().rounding is not None
    assert evals.numel() < 100
    G = dense_ggn(model.double(), loss_func, x.double(), y)
    _assert_resolved_pairs(ggn, 100, evals, evecs, G, ggn.zero_tolerance())


def test_kept_pairs_are_reported_and_judged_with_their_own_solve():
    """Pairs kept from an earlier solve (``tol=1e-6``) and returned after a solve at
    another tolerance: the report and the numerical zero are those of the solve
    that computed them, not of the latest one."""
    torch.manual_seed(0)
    model = ScaledSequenceLinear([1.0, 0.1, 0.01], 5)
    x, y = torch.randn(6, 20, 3), torch.randint(0, 5, (6, 20))
    ggn = LowRankGGN(model, nn.CrossEntropyLoss(), (x, y), route="implicit")
    evals, _ = ggn.eigh(top_k=5, tol=1e-6)
    first, zero = ggn.solver_report(), ggn.zero_tolerance()
    ggn.eigh(top_k=5, tol=1e-3)
    assert ggn.solver_report().requested_tolerance == 1e-3
    kept, _ = ggn.eigh(top_k=3, tol=1e-6)
    assert torch.equal(kept, evals[-3:])
    assert ggn.solver_report() is first
    assert ggn.zero_tolerance() == zero


@pytest.mark.parametrize(
    "residual, rounding, match",
    [
        (1e-8, 5e-8, r"model\.double\(\)"),
        (5e-8, 1e-8, r"A smaller tol"),
    ],
)
def test_the_unresolved_warning_names_the_term_that_sets_the_bound(
    residual, rounding, match
):
    """Below the tolerance, the bound ``(r + ρ)·θ_max`` is set by the larger term:
    where the products' rounding ``ρ`` exceeds the residual reached, a smaller
    tol cannot lower it and the warning names the float64 model instead."""
    report = SolverReport(
        solver="ggn_krylov",
        requested="ggn_krylov",
        residual=residual,
        tolerance=1e-5,
        converged=True,
        rounding=rounding,
        requested_tolerance=1e-5,
    )
    evals = torch.tensor([1e-9, 1.0])
    zero = residual + (5e-6 if rounding is None else rounding)
    source = SimpleNamespace(dtype=torch.float32)
    with pytest.warns(FewerEigenpairsWarning, match=match):
        warn_unresolved_eigenpairs(2, evals, 1, zero, report, source)


def _memory_for_the_smallest_basis(monkeypatch, s, top_k, subsampling=None):
    """Memory available: the products' estimate and a basis of ``k + 2·b`` columns.

    Returns that basis' columns, the default's, and the bytes.
    """
    default = estimate_memory(
        s.model, s.inputs, len(s.inputs), loss_func=s.loss_func, top_k=top_k,
        route="implicit", subsampling=subsampling,
    )  # fmt: skip
    params = sum(p.numel() for p in s.model.parameters())
    dtype = next(s.model.parameters()).dtype
    least, bytes_ = smallest_basis_memory(default, top_k, dtype, params)
    available(monkeypatch, bytes_)
    return least, default.basis_columns, bytes_


@pytest.mark.parametrize(
    "name",
    [
        "resnet-block-ce-mean",
        "transformer-mse-sum",
        "lstm-ce-mean",
        "lstm-ce-sum",
        "causal-lm-ce-sum",
        "conv1d-bce-mean",
    ],
)
@pytest.mark.parametrize("subsampling", [None, [2, 0]])
def test_a_basis_cut_by_memory_converges_to_dense(monkeypatch, name, subsampling):
    """Memory for only ``k + 2·b`` basis columns: the basis is cut to them, the
    solve restarts more often and meets the same bound, ``tol·λ_max`` of the dense
    float64 reference (``EIGVAL_RTOL``; "The Gram matrix and exact eigenpairs",
    "A basis cut by memory"), and the report says so."""
    s = PROBLEMS[name].setup()
    data, options = (s.inputs, s.targets), {"subsampling": subsampling}
    full = LowRankGGN(s.model, s.loss_func, data, route="implicit", **options)
    full.eigh(top_k=TOP_K)
    uncut = full.solver_report()
    least, default, _ = _memory_for_the_smallest_basis(
        monkeypatch, s, TOP_K, subsampling
    )
    assert least < default == uncut.basis_columns and uncut.basis_cut is None
    ggn = LowRankGGN(s.model, s.loss_func, data, route="implicit", **options)
    evals, evecs = ggn.eigh(top_k=TOP_K)
    report = ggn.solver_report()
    assert report.converged and report.basis_columns == least
    assert report.basis_cut == f"basis cut to {least} of {default} columns by memory"
    if subsampling is None:  # two samples' G has fewer pairs than the cut basis
        assert report.cycles > uncut.cycles
    G = dense_ggn(s.model, s.loss_func, s.inputs, s.targets, subsampling=subsampling)
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])
    nc = ggn._source.group(0).num_rows
    assert_eigenpairs(evals, evecs, G, nc, tol=report.tolerance)


def test_memory_below_the_smallest_basis_is_refused(monkeypatch):
    """A byte less than the products and ``k + 2·b`` columns, beyond the estimate's
    factor 1.5: refused before the first product, the cut basis named."""
    s = PROBLEMS["lstm-ce-mean"].setup()
    least, default, needed = _memory_for_the_smallest_basis(monkeypatch, s, TOP_K)
    available(monkeypatch, int(needed / ESTIMATE_FACTOR) - 1)
    ggn = LowRankGGN(s.model, s.loss_func, (s.inputs, s.targets), route="implicit")
    passes = ggn._source.passes
    with pytest.raises(
        ProductsTooLargeError, match="Refused before the first"
    ) as error:
        ggn.eigh(top_k=TOP_K)
    assert f"{least} columns (cut from {default} by memory)" in str(error.value)
    assert ggn._source.passes == passes  # no product ran
