"""The Gram algebra on random factors, against explicitly formed ``V``.

Every route of every product is forced once, so a wrong contraction in a route the
planner rarely picks cannot hide behind the route it usually picks. Every route
sums the same products in another order: ``REORDERED_REL`` of the largest entry
(``docs/math.rst``, "Tolerances of the tests", "Reordered sums").
"""

import itertools

import pytest
import torch

from tests.fixtures.checks import REORDERED_REL, assert_rel
from vivit.gram import DenseFactors, OuterProductFactors
from vivit.gram import outer as planner
from vivit.gram.factors import self_gram

SHAPES = [  # (N, C, G, T, O, P)
    (3, 2, 1, 1, 4, 5),  # Linear
    (2, 3, 1, 4, 3, 2),  # Linear on sequences
    (3, 2, 2, 5, 2, 3),  # grouped convolution
]
ROUTES = {
    "gram": ["through_v", "pairs", "sample_pairs"],
    "vmp": ["through_v", "factored"],
}


def random_factors(N, C, G, T, O, P, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(N, G, T, P, generator=gen, dtype=torch.float64)
    s = torch.randn(C, N, G, T, O, generator=gen, dtype=torch.float64)
    return OuterProductFactors(a, s, torch.Size([G * O, P])), a, s


def explicit_vt(a, s):
    """``Vᵀ`` row by row: row ``n·C + c`` is ``Σ_t s_nc[t] ⊗ a_n[t]`` per group."""
    C, N, G, T, O = s.shape
    rows = []
    for n, c in itertools.product(range(N), range(C)):
        row = torch.zeros(G, O, a.shape[-1], dtype=a.dtype)
        for g, t in itertools.product(range(G), range(T)):
            row[g] += torch.outer(s[c, n, g, t], a[n, g, t])
        rows.append(row.flatten())
    return torch.stack(rows)


@pytest.fixture(params=SHAPES, ids=lambda s: "N{}C{}G{}T{}O{}P{}".format(*s))
def shape(request):
    return request.param


def force(monkeypatch, name):
    monkeypatch.setattr(planner, "choose", lambda *routes, **kw: name)


def test_materialize_matches_explicit(shape):
    factors, a, s = random_factors(*shape)
    assert_rel(factors.materialize(), explicit_vt(a, s), REORDERED_REL)


@pytest.mark.parametrize("route", ROUTES["gram"])
def test_gram_and_cross_gram(shape, route, monkeypatch):
    N, C, G, T, O, P = shape
    factors, a, s = random_factors(*shape)
    other, a2, s2 = random_factors(N + 1, 1, G, T, O, P, seed=1)
    force(monkeypatch, route)
    vt, vt2 = explicit_vt(a, s), explicit_vt(a2, s2)
    assert_rel(factors.gram(), vt @ vt.T, REORDERED_REL)
    assert_rel(factors.gram(other), vt @ vt2.T, REORDERED_REL)


@pytest.mark.parametrize("route", ROUTES["vmp"])
def test_vmp_and_vtmp(shape, route, monkeypatch):
    factors, a, s = random_factors(*shape)
    vt = explicit_vt(a, s)
    u = torch.randn(4, vt.shape[0], dtype=torch.float64)
    w = torch.randn(4, *factors.param_shape, dtype=torch.float64)
    force(monkeypatch, route)
    expected = (u @ vt).reshape(4, *factors.param_shape)
    assert_rel(factors.vmp(u), expected, REORDERED_REL)
    assert_rel(factors.vtmp(w), w.flatten(1) @ vt.T, REORDERED_REL)


def test_select_keeps_sample_rows(shape):
    factors, a, s = random_factors(*shape)
    C = shape[1]
    samples = [shape[0] - 1, 0]
    rows = [n * C + c for n in samples for c in range(C)]
    selected = factors.select(samples).materialize()
    assert_rel(selected, factors.materialize()[rows], REORDERED_REL)


def test_dense_factors_products():
    columns = torch.randn(3, 2, 4, 5, dtype=torch.float64)  # [N, C, *p]
    dense = DenseFactors(columns)
    vt = columns.reshape(6, 20)
    other = DenseFactors(torch.randn(2, 1, 4, 5, dtype=torch.float64))
    u = torch.randn(3, 6, dtype=torch.float64)
    w = torch.randn(3, 4, 5, dtype=torch.float64)
    assert_rel(dense.gram(), vt @ vt.T, REORDERED_REL)
    assert_rel(dense.gram(other), vt @ other.materialize().T, REORDERED_REL)
    assert_rel(dense.vmp(u), (u @ vt).reshape(3, 4, 5), REORDERED_REL)
    assert_rel(dense.vtmp(w), w.flatten(1) @ vt.T, REORDERED_REL)
    # a selection copies the sample's columns: no arithmetic, bit for bit
    assert torch.equal(dense.select([2]).materialize(), vt[4:6])


def test_planner_prefers_cheap_route_within_budget():
    cheap_big = planner.Route("cheap_big", flops=1, memory=100)
    costly_small = planner.Route("costly_small", flops=10, memory=1)
    assert planner.choose(cheap_big, costly_small, budget=4000) == "cheap_big"
    assert planner.choose(cheap_big, costly_small, budget=40) == "costly_small"
    assert planner.choose(cheap_big, costly_small, budget=0) == "costly_small"


def test_planner_budget_counts_bytes_of_the_dtype():
    big = planner.Route("big", flops=1, memory=100)
    small = planner.Route("small", flops=10, memory=1)
    # 100 entries are 400 bytes in float32, 800 in float64
    assert planner.choose(big, small, dtype=torch.float32, budget=400) == "big"
    assert planner.choose(big, small, dtype=torch.float64, budget=400) == "small"
    assert planner.budget_entries(torch.float64, 2**30) == 2**27
    assert planner.budget_entries(torch.float16, 2**30) == 2**29


CHUNKED = [  # (N, C, G, T, O, P), budget in bytes, number of feature blocks
    ((3, 2, 1, 4, 5, 3), 6 * 2 * 3 * 8, 3),  # one group split into 2+2+1 features
    ((3, 2, 4, 3, 2, 3), 6 * 4 * 3 * 8, 2),  # whole groups, two per block
    ((3, 2, 3, 3, 2, 3), 6 * 3 * 3 * 8, 3),  # one group per block, O=2 > 1 fits
    ((3, 2, 2, 3, 2, 3), 1, 4),  # nothing fits: one feature at a time
]


@pytest.mark.parametrize(("shape", "budget", "blocks"), CHUNKED)
def test_through_v_in_feature_blocks(shape, budget, blocks, monkeypatch):
    """A budget smaller than ``V`` forms it a block of output features at a time."""
    N, C, G, T, O, P = shape
    factors, a, s = random_factors(*shape)
    other, a2, s2 = random_factors(N + 1, 1, G, T, O, P, seed=1)
    monkeypatch.setattr(planner, "MEMORY_BUDGET_BYTES", budget)
    formed = []
    original = OuterProductFactors._materialize

    def spy(self, groups, features):
        formed.append(original(self, groups, features))
        return formed[-1]

    monkeypatch.setattr(OuterProductFactors, "_materialize", spy)
    vt, vt2 = explicit_vt(a, s), explicit_vt(a2, s2)
    gram = factors._gram_through_v(factors, factors._features_per_chunk(N * C))
    assert_rel(gram, vt @ vt.T, REORDERED_REL)
    assert len(formed) == blocks
    assert sum(block.shape[1] for block in formed) == G * O * P
    cross = factors._gram_through_v(other, factors._features_per_chunk(2 * N * C + 1))
    assert_rel(cross, vt @ vt2.T, REORDERED_REL)


@pytest.mark.parametrize(
    ("route", "equation", "budget", "blocks"),
    [
        ("pairs", "ngtp,mgup->nmgtu", 8, 3),
        # one sample's pairwise products with `other`: (C·12 + 4)·G·T·T = 112
        ("pairs", "ngtp,mgup->nmgtu", 2 * 112 * 8, 2),
        ("sample_pairs", "ntp,mup->mntu", 8, 3),
        # one sample's intermediates with `other`: 2·4·T·(3·O + T) = 176
        ("sample_pairs", "ntp,mup->mntu", 2 * 176 * 8, 2),
    ],
)
def test_sample_blocks_within_budget(route, equation, budget, blocks, monkeypatch):
    """The routes through sample pairs work in chunks of samples within the budget."""
    N, C, G, T, O, P = 3, 2, 1, 2, 3, 2
    factors, a, s = random_factors(N, C, G, T, O, P)
    other, a2, s2 = random_factors(N + 1, 3, G, T, O, P, seed=1)
    monkeypatch.setattr(planner, "MEMORY_BUDGET_BYTES", budget)
    force(monkeypatch, route)
    calls = []
    original = torch.einsum

    def spy(equation, *operands):
        calls.append(equation)
        return original(equation, *operands)

    monkeypatch.setattr("vivit.gram.outer.einsum", spy)
    vt, vt2 = explicit_vt(a, s), explicit_vt(a2, s2)
    assert_rel(factors.gram(other), vt @ vt2.T, REORDERED_REL)
    assert calls.count(equation) == blocks
    assert_rel(factors.gram(), vt @ vt.T, REORDERED_REL)


@pytest.mark.parametrize(
    ("T", "O", "P", "route"),
    [
        (64, 64, 576, "through_v"),
        (16, 128, 1152, "sample_pairs"),
        (4, 256, 2304, "pairs"),
    ],
    ids=["8x8", "4x4", "2x2"],
)
def test_planner_routes_of_resnet18_convolutions(T, O, P, route):
    """ResNet-18's 3x3 convolutions at 32x32 (N = 64, C = 10): the measured fastest.

    One thread, seconds of through_v / pairs / sample_pairs: 8x8 1.2 / 42 / 5.6,
    4x4 4.2 / 3.4 / 1.8, 2x2 17 / 0.31 / 0.91 (``COPY_WORK`` in vivit/gram/outer.py).
    """
    a = torch.zeros(64, 1, T, P)
    s = torch.zeros(10, 64, 1, T, O)
    factors = OuterProductFactors(a, s, torch.Size([O, P]))
    assert factors._gram_route(factors).name == route


@pytest.mark.parametrize(
    ("T", "O", "P", "route"),
    [(64, 64, 576, "through_v"), (4, 256, 2304, "factored")],
    ids=["8x8", "2x2"],
)
def test_planner_routes_of_resnet18_eigenvectors(T, O, P, route):
    """``V u`` of 10 vectors, ResNet-18 with one Monte-Carlo sample (N = 64).

    One thread, seconds through V / factored: 8x8 0.005 / 0.034, 2x2 0.095 / 0.029
    (``COPY_WORK`` in vivit/gram/outer.py).
    """
    factors = OuterProductFactors(
        torch.zeros(64, 1, T, P), torch.zeros(1, 64, 1, T, O), torch.Size([O, P])
    )
    assert factors._product_route(10).name == route


def test_gram_stays_within_budget_when_no_route_fits(monkeypatch):
    """With a tiny budget the planner takes the route with the smallest block."""
    factors, a, s = random_factors(3, 2, 1, 6, 4, 3)
    monkeypatch.setattr(planner, "MEMORY_BUDGET_BYTES", 8)
    vt = explicit_vt(a, s)
    assert_rel(factors.gram(), vt @ vt.T, REORDERED_REL)


@pytest.mark.parametrize(
    ("shape", "dense"),
    [
        ((2, 3, 1, 16, 2, 3), True),  # V: 36 entries, factors 288
        ((2, 3, 1, 4, 2, 3), False),  # V: 36, factors 72: smaller, not by 4x
        ((2, 3, 1, 1, 4, 5), False),
    ],
    ids=["many-positions", "few-positions", "linear"],
)
def test_compact_keeps_the_smaller_form(shape, dense):
    factors, a, s = random_factors(*shape)
    compact = factors.compact()
    assert isinstance(compact, DenseFactors) == dense
    assert (compact is factors) != dense
    vt = explicit_vt(a, s)
    u = torch.randn(4, vt.shape[0], dtype=torch.float64)
    assert_rel(compact.materialize(), vt, REORDERED_REL)
    assert_rel(compact.gram(), vt @ vt.T, REORDERED_REL)
    expected = (u @ vt).reshape(4, *factors.param_shape)
    assert_rel(compact.vmp(u), expected, REORDERED_REL)
    assert_rel(compact.gram(factors), vt @ vt.T, REORDERED_REL)
    assert_rel(factors.gram(compact), vt @ vt.T, REORDERED_REL)


def test_planner_picks_pairs_for_plain_linear_and_v_for_large_images():
    linear, _, _ = random_factors(32, 10, 1, 1, 64, 128)
    conv, _, _ = random_factors(8, 10, 1, 1024, 16, 27)
    chosen = []
    original = planner.choose

    def spy(*routes, **kwargs):
        chosen.append(original(*routes, **kwargs))
        return chosen[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner, "choose", spy)
        linear.gram()
        conv.gram()
    assert chosen == ["pairs", "through_v"]


@pytest.mark.parametrize("rows", [5, 512, 1001])
def test_self_gram_mirrors_lower_triangle(rows):
    vt = torch.randn(rows, 7, dtype=torch.float64)
    gram = self_gram(vt)
    assert_rel(gram, vt @ vt.T, REORDERED_REL)
    if rows >= 512:  # the blocked path mirrors, so it is exactly symmetric
        assert torch.equal(gram, gram.T)


@pytest.mark.parametrize("rows", [5, 600])
def test_self_gram_adds_into_out(rows):
    vt, vt2 = torch.randn(2, rows, 7, dtype=torch.float64)
    out = self_gram(vt2)
    result = self_gram(vt, out=out)
    assert result is out
    assert_rel(out, vt @ vt.T + vt2 @ vt2.T, REORDERED_REL)
    if rows >= 512:
        assert torch.equal(out, out.T)
