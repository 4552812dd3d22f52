"""Property-based tests of the func engine on random small architectures BackPACK
cannot extend.

Hypothesis draws a sequence model on inputs ``[N, T, d]``: a stack of 1–3 blocks
among LayerNorm, GELU, a residual Linear, one Linear applied twice, multi-head
attention with a residual and a weight tied between two layers, then mean pooling
or flattening and a Linear head; a loss (MSE, CE, BCE-with-logits), its reduction
and a subsampling, in float64. Through ``engine="auto"`` (which must pick func):

- the Gram eigenvalues are the dense GGN's leading ones, |Δ| ≤ 1e-10 λ_max;
- ``eigh`` returns eigenpairs of the dense GGN (``checks.assert_eigenpairs``);
- the Newton step along the 3 leading directions with a constant damping is
  −Σ_k γ̄_k / (λ_k + δ) e_k, within
  ``DIRECTION_REL`` relative (nearly repeated eigenvalues, docs/math.rst).

The examples are derandomized (no example database), so the run is reproducible.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tests.fixtures.checks import (
    DIRECTION_REL,
    EIGVAL_RTOL,
    assert_eigenpairs,
    assert_top_eigvals,
    flat_evecs,
    record,
)
from tests.fixtures.hypothesis_settings import reproducible
from tests.fixtures.reference import dense_ggn, per_sample_gradients, reduction_factor
from vivit import LowRankGGN

pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop:UserWarning"
)

SETTINGS = reproducible(12)
BLOCKS = ("layernorm", "gelu", "residual", "twice", "attention", "tied")


class Block(nn.Module):
    """One drawn block on ``[N, T, d]``."""

    def __init__(self, kind: str, d: int):
        super().__init__()
        self.kind = kind
        if kind == "layernorm":
            self.layer = nn.LayerNorm(d)
        elif kind in ("residual", "twice"):
            self.layer = nn.Linear(d, d)
        elif kind == "attention":
            self.layer = nn.MultiheadAttention(
                d, 2 if d % 2 == 0 else 1, batch_first=True
            )
        elif kind == "tied":
            self.first, self.second = nn.Linear(d, d), nn.Linear(d, d, bias=False)
            self.second.weight = self.first.weight

    def forward(self, x):
        if self.kind == "layernorm":
            return self.layer(x)
        if self.kind == "gelu":
            return nn.functional.gelu(x)
        if self.kind == "residual":
            return x + torch.tanh(self.layer(x))
        if self.kind == "twice":
            return self.layer(torch.tanh(self.layer(x)))
        if self.kind == "attention":
            return x + self.layer(x, x, x, need_weights=False)[0]
        return self.second(torch.tanh(self.first(x)))


class SequenceModel(nn.Module):
    def __init__(self, kinds: list[str], d: int, positions: int, outputs: int, pool):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(kind, d) for kind in kinds))
        self.pool = pool
        self.head = nn.Linear(d if pool == "mean" else d * positions, outputs)

    def forward(self, x):
        h = self.blocks(x)
        return self.head(h.mean(1) if self.pool == "mean" else h.flatten(1))


@st.composite
def cases(draw):
    kinds = draw(st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=3))
    d = draw(st.integers(2, 4))
    positions = draw(st.integers(1, 3))
    outputs = draw(st.integers(2, 3))
    pool = draw(st.sampled_from(["mean", "flatten"]))
    loss = draw(st.sampled_from(["mse", "ce", "bce"]))
    reduction = draw(st.sampled_from(["mean", "sum"]))
    samples = draw(st.integers(2, 4))
    subsampling = draw(
        st.none() | st.lists(st.integers(0, samples - 1), min_size=1, unique=True)
    )
    seed = draw(st.integers(0, 2**16))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SequenceModel(kinds, d, positions, outputs, pool).double()
        inputs = torch.randn(samples, positions, d, dtype=torch.float64)
        if loss == "ce":
            targets = torch.randint(0, outputs, (samples,))
        elif loss == "bce":
            targets = torch.rand(samples, outputs, dtype=torch.float64)
        else:
            targets = torch.randn(samples, outputs, dtype=torch.float64)
    loss_func = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss}.get(
        loss, nn.BCEWithLogitsLoss
    )(reduction=reduction)
    return model, loss_func, inputs, targets, subsampling


@pytest.mark.filterwarnings("ignore::vivit.FewerEigenpairsWarning")  # top_k > rank
@SETTINGS
@given(cases())
def test_func_engine_on_random_sequence_models(case):
    model, loss_func, X, y, subsampling = case
    ggn = LowRankGGN(model, loss_func, (X, y), subsampling=subsampling)
    assert ggn.engine == "func"
    G = dense_ggn(model, loss_func, X, y, subsampling=subsampling)
    assert_top_eigvals(
        ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
    )
    evals, evecs = ggn.eigh()
    assert_eigenpairs(evals, evecs, G, ggn.eigvalsh().numel())

    # the leading directions: eigenvectors of tiny eigenvalues carry the error
    # ε·λ_max/√λ of V ẽ/√λ (tests/fixtures/checks.py), which the step does not need
    # to match
    evals, evecs = ggn.eigh(top_k=3)
    E = flat_evecs(evecs)
    grads = per_sample_gradients(model, loss_func, X, y)
    gamma_bar = reduction_factor(loss_func, len(X)) * (grads @ E.T).sum(0)
    expected = (-gamma_bar / (evals + 0.5)) @ E
    step = torch.cat([s.flatten() for s in ggn.newton_step(top_k=3, damping=0.5)])
    # random models have nearly repeated eigenvalues (symmetric weights): DIRECTION_REL
    tolerance = DIRECTION_REL * max(expected.norm().item(), 1e-30)
    record((step - expected).norm().item(), tolerance)
    assert (step - expected).norm() <= tolerance
