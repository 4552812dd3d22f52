"""StackedFactors against the explicitly stacked ``Vᵀ = [V_1ᵀ; V_2ᵀ; …]``.

Blocks of different factor types (outer-product and dense) and sizes, as a data
loader's batches give them. Products and Gram matrices sum the same terms in another
order: ``REORDERED_REL`` of the largest entry (``docs/math.rst``, "Tolerances of the
tests", "Reordered sums"). ``materialize`` concatenates the blocks' own columns,
each multiplied by its scale as the explicit ``Vᵀ`` is: equal bit for bit.
"""

import pytest
import torch

from tests.fixtures.checks import REORDERED_REL, assert_rel
from vivit.gram import DenseFactors, OuterProductFactors, StackedFactors

C, G, T, O, P = 2, 1, 3, 4, 5


def outer(N, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(N, G, T, P, generator=gen, dtype=torch.float64)
    s = torch.randn(C, N, G, T, O, generator=gen, dtype=torch.float64)
    return OuterProductFactors(a, s, torch.Size([G * O, P]))


def dense(N, seed):
    gen = torch.Generator().manual_seed(seed)
    return DenseFactors(torch.randn(N, C, G * O, P, generator=gen, dtype=torch.float64))


@pytest.fixture
def blocks():
    """Three blocks of 3, 2 and 1 samples; the middle one dense."""
    return [outer(3, 0), dense(2, 1), outer(1, 2)]


def stacked(blocks):
    return torch.cat([b.materialize() for b in blocks])


def test_gram_of_blocks(blocks):
    factors = StackedFactors(blocks)
    vt = stacked(blocks)
    assert factors.num_samples == 6 and factors.num_rows == 12
    assert torch.equal(factors.materialize(), vt)
    assert_rel(factors.gram(), vt @ vt.T, REORDERED_REL)
    # cross-Grams with plain factors and with other block factors, both sides
    other = outer(4, 3)
    assert_rel(factors.gram(other), vt @ other.materialize().T, REORDERED_REL)
    assert_rel(other.gram(factors), other.materialize() @ vt.T, REORDERED_REL)
    assert_rel(blocks[1].gram(factors), vt[6:10] @ vt.T, REORDERED_REL)
    two = StackedFactors([dense(1, 4), outer(2, 5)])
    assert_rel(factors.gram(two), vt @ stacked(two.blocks).T, REORDERED_REL)


def test_products(blocks):
    factors = StackedFactors(blocks)
    vt = stacked(blocks)
    gen = torch.Generator().manual_seed(9)
    u = torch.randn(3, 12, generator=gen, dtype=torch.float64)
    w = torch.randn(3, G * O, P, generator=gen, dtype=torch.float64)
    assert_rel(factors.vmp(u), (u @ vt).reshape(3, G * O, P), REORDERED_REL)
    assert_rel(factors.vtmp(w), w.flatten(1) @ vt.T, REORDERED_REL)


def test_scaled_to_and_nesting(blocks):
    factors = StackedFactors(blocks)
    vt = stacked(blocks)
    assert torch.equal(factors.scaled(0.5).materialize(), 0.5 * vt)
    assert torch.equal(factors.materialize(), vt)
    single = factors.to(torch.float32)
    assert single.dtype == torch.float32 and factors.dtype == torch.float64
    assert factors.to(torch.float64) is factors
    nested = StackedFactors([StackedFactors(blocks[:2]), blocks[2]])
    assert len(nested.blocks) == 3
    assert_rel(nested.gram(), vt @ vt.T, REORDERED_REL)


def test_select_across_blocks(blocks):
    factors = StackedFactors(blocks)
    vt = stacked(blocks)
    for samples in ([4], [0, 1], [5, 0, 3, 4], [2, 3, 4, 5]):
        rows = [n * C + c for n in samples for c in range(C)]
        selected = factors.select(samples)
        assert_rel(selected.materialize(), vt[rows], REORDERED_REL)
        assert_rel(selected.gram(), vt[rows] @ vt[rows].T, REORDERED_REL)
    assert len(factors.select([3, 4]).blocks) == 1  # consecutive: one block
    assert factors.select([]).num_rows == 0
    with pytest.raises(IndexError, match="out of range"):
        factors.select([6])


def test_blocks_must_agree(blocks):
    with pytest.raises(ValueError, match="at least one block"):
        StackedFactors([])
    with pytest.raises(ValueError, match="disagree"):
        StackedFactors([blocks[0], DenseFactors(torch.randn(2, C, 3, P))])
    with pytest.raises(ValueError, match="disagree"):
        StackedFactors([blocks[0], blocks[1].to(torch.float32)])


def test_scales_are_applied_lazily(blocks):
    """Scaled blocks equal the stacked scaled columns; no factor is copied."""
    scales = [0.5, 2.0, 3.0]
    factors = StackedFactors(blocks, scales)
    vt = torch.cat([s * b.materialize() for b, s in zip(blocks, scales, strict=True)])
    assert factors.tensors()[0] is blocks[0].tensors()[0]
    assert torch.equal(factors.materialize(), vt)
    assert_rel(factors.gram(), vt @ vt.T, REORDERED_REL)
    other = StackedFactors([dense(2, 7)], [4.0])
    vt_other = 4.0 * other.blocks[0].materialize()
    assert_rel(factors.gram(other), vt @ vt_other.T, REORDERED_REL)
    assert_rel(other.gram(factors), vt_other @ vt.T, REORDERED_REL)
    u = torch.randn(2, 12, dtype=torch.float64)
    w = torch.randn(2, G * O, P, dtype=torch.float64)
    assert_rel(factors.vmp(u), (u @ vt).reshape(2, G * O, P), REORDERED_REL)
    assert_rel(factors.vtmp(w), w.flatten(1) @ vt.T, REORDERED_REL)
    rows = [n * C + c for n in (5, 0, 4) for c in range(C)]
    assert_rel(factors.select([5, 0, 4]).materialize(), vt[rows], REORDERED_REL)
    nested = StackedFactors([factors, blocks[0]], [2.0, 1.0]).materialize()
    assert torch.equal(nested, torch.cat([2 * vt, blocks[0].materialize()]))
    assert torch.equal(factors.scaled(2.0).materialize(), 2 * vt)
    with pytest.raises(ValueError, match="2 scales for 3 sample blocks"):
        StackedFactors(blocks, [1.0, 2.0])
