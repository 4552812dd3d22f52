"""Factor forms found at the function level against explicit columns of ``V``.

The func engine records the calls a parameter goes through (``F.linear``,
``torch.addmm``, ``F.embedding``, ``F.layer_norm``, ``F.rms_norm``, the
projections inside ``F.multi_head_attention_forward``) and keeps factor forms
(``docs/math.rst``, "Layer structure"). With the recording switched off the same
engine computes every such parameter's columns explicitly (one-hot per-sample
backward passes, checked against the dense float64 reference in
``test_func_engine.py``). Both hold the same ``V`` of the same float64 model:
its Gram blocks, ``V u`` and ``Vᵀ w`` agree up to reordered sums
(``REORDERED_REL``, ``docs/math.rst``, "Tolerances of the tests"), while a
wrong owner of a row, a dropped use of a tied table, a missing cross term or a
transposed weight is an O(1) error.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.test_func_engine import func_reference
from tests.fixtures.checks import REORDERED_REL, assert_rel
from tests.fixtures.recurrent_problems import RECURRENT_PROBLEMS
from vivit import LowRankGGN
from vivit.engines.func import FuncEngine, engine, functional, vjp
from vivit.engines.func.functional import FunctionCapture
from vivit.gram import (
    DenseFactors,
    EmbeddingFactors,
    OuterProductFactors,
    SumFactors,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop:UserWarning"
)

RECURRENT = [p.name for p in RECURRENT_PROBLEMS]
VARIANTS = {
    "exact": {},
    "mc": {"mc_samples": 2},
    "subsampled": {"subsampling": [2, 0]},
    "chunked": {"engine": FuncEngine(memory_budget=1)},
}


def _factors(name: str, options: dict) -> tuple[list, list, list]:
    """Each parameter's GGN and gradient factors (one group per parameter)."""
    model, loss_func, X, y = func_reference(name).setup
    params = [p for p in model.parameters() if p.requires_grad]
    options = {"engine": "func", **options}
    ggn = LowRankGGN(
        model,
        loss_func,
        (X, y),
        param_groups=[[p] for p in params],
        generator=torch.Generator().manual_seed(0),
        **options,
    )
    ggn.directional_derivatives(top_k=1)  # keeps the gradient factors
    groups = [ggn._group(i) for i in range(len(params))]
    return (
        params,
        [g.ggn_factors[0] for g in groups],
        [g.grad_factors[0] for g in groups],
    )


@pytest.fixture
def explicit(monkeypatch):
    """Factors with the function-level recording off: explicit columns."""

    def run(name: str, options: dict):
        with monkeypatch.context() as patch:
            patch.setattr(FunctionCapture, "_use", lambda *args: None)
            return _factors(name, options)

    return run


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "name",
    [
        "causal-lm-ce-mean",
        "causal-lm-ce-sum",
        "conv1d-mse-sum",
        "conv1d-bce-mean",
        "padded-conv1d-ce-sum",
        "padded-conv1d-mse-mean",
        "transformer-ce-mean",
        "lstm-ce-sum",
        *RECURRENT,
    ],
)
def test_forms_match_explicit_columns(name, variant, explicit):
    """Gram blocks, V·u, Vᵀ·w of every parameter: factor forms = explicit columns."""
    options = VARIANTS[variant]
    params, ggn, grad = _factors(name, options)
    _, ggn_explicit, grad_explicit = explicit(name, options)
    gen = torch.Generator().manual_seed(1)
    for param, form, columns, form_g, columns_g in zip(
        params, ggn, ggn_explicit, grad, grad_explicit, strict=True
    ):
        assert isinstance(columns, DenseFactors)
        assert_rel(form.gram(), columns.gram(), REORDERED_REL)
        assert_rel(form.gram(form_g), columns.gram(columns_g), REORDERED_REL)
        u = torch.randn(2, form.num_rows, generator=gen, dtype=param.dtype)
        w = torch.randn(2, *param.shape, generator=gen, dtype=param.dtype)
        assert_rel(form.vmp(u), columns.vmp(u), REORDERED_REL)
        assert_rel(form.vtmp(w), columns.vtmp(w), REORDERED_REL)
        assert_rel(form.materialize(), columns.materialize(), REORDERED_REL)
        rows = [1, 0]
        assert_rel(form.select(rows).gram(), columns.select(rows).gram(), REORDERED_REL)


def _forms(monkeypatch, name: str) -> tuple[list[str], dict]:
    """The parameters the engine gives explicit columns, and every GGN factor."""
    model = func_reference(name).setup.model
    names = {id(p): n for n, p in model.named_parameters()}
    explicit = []
    uses = engine._Forward.uses

    def spy(self, output, factor=None):
        uses_of, rows = uses(self, output, factor)
        if factor is None:  # the whole batch's
            explicit.append(
                sorted(names[id(p)] for p in self.params if id(p) not in uses_of)
            )
        return uses_of, rows

    monkeypatch.setattr(engine._Forward, "uses", spy)
    params, ggn, _ = _factors(name, {})
    return explicit, {names[id(p)]: f for p, f in zip(params, ggn, strict=True)}


def test_causal_lm_forms(monkeypatch):
    """Tied table: lookup plus output layer; only the position table falls back."""
    explicit, forms = _forms(monkeypatch, "causal-lm-ce-mean")
    tied = forms["tokens.weight"]
    assert isinstance(tied, SumFactors)
    assert {type(p) for p in tied.parts} == {EmbeddingFactors, OuterProductFactors}
    for name in ("block.self_attn.in_proj_weight", "block.self_attn.out_proj.weight"):
        assert isinstance(forms[name], OuterProductFactors)
    # looked up for every sample alike: its rows have no single owner
    assert explicit == [["positions.weight"]]
    assert isinstance(forms["positions.weight"], DenseFactors)


def test_sequence_first_conv1d_forms(monkeypatch):
    """[T, N, d] activations, merged rows and addmm's [in, out] weight: no fallback."""
    explicit, forms = _forms(monkeypatch, "conv1d-mse-sum")
    assert explicit == [[]]
    assert isinstance(forms["embedding.weight"], EmbeddingFactors)
    for name in ("mlp.weight", "head.weight"):
        assert isinstance(forms[name], OuterProductFactors)
        assert forms[name].transposed
    assert isinstance(forms["attention.in_proj_weight"], OuterProductFactors)


@pytest.mark.parametrize("name", ["lstm-ce-mean", *RECURRENT])
def test_recurrent_forms(monkeypatch, name):
    """Every weight of a recurrent layer (or cell) has a factor form, none falls back.

    Evaluated step by step (``docs/math.rst``, "Recurrent layers"): the input
    and recurrent weights (and an LSTM's projection) are Linear-like weights
    used at every step, the biases their vectors summed.
    """
    explicit, forms = _forms(monkeypatch, name)
    assert explicit and all(names == [] for names in explicit)  # every pass
    recurrent = [n for n in forms if n.startswith(("lstm", "layer", "cell"))]
    weights = [n for n in recurrent if ".weight" in n]
    assert weights
    for param in weights:
        assert isinstance(forms[param], OuterProductFactors), param
    for param in set(recurrent) - set(weights):
        assert isinstance(forms[param], DenseFactors), param  # from the vectors


@pytest.mark.parametrize("variant", ["exact", "mc", "subsampled", "chunked"])
def test_vectorized_fallback_matches_one_hot_batches(variant, explicit, monkeypatch):
    """Explicit columns by vmap over the samples = by one-hot batches."""
    taken = []
    per_sample = vjp.per_sample_vjp

    def spy(*args, **kwargs):
        columns = per_sample(*args, **kwargs)
        taken.append(columns is not None)
        return columns

    monkeypatch.setattr(f"{FuncEngine.__module__}.per_sample_vjp", spy)
    results = []
    for vectorized in (True, False):
        monkeypatch.setattr(
            vjp.ExplicitColumns,
            "__init__",
            lambda self, flag=vectorized: setattr(self, "vectorized", flag),
        )
        results.append(explicit("causal-lm-ce-sum", VARIANTS[variant]))
    assert taken and all(taken)  # only the first run's: the second never vmaps
    (_, by_vmap, by_vmap_grad), (_, one_hot, one_hot_grad) = results
    for columns, reference in zip(
        by_vmap + by_vmap_grad, one_hot + one_hot_grad, strict=True
    ):
        assert_rel(columns.materialize(), reference.materialize(), REORDERED_REL)


def test_explicit_columns_route():
    """One chunk: one-hot batches; several: the faster, one-hot if vmap fails."""
    calls = []

    def vectorized():
        calls.append("vmap")
        return [torch.zeros(1)]

    def one_hot():
        calls.append("one-hot")
        return [torch.ones(1)]

    route = vjp.ExplicitColumns()
    assert route(vectorized, one_hot, more_chunks=False)[0] == 1
    assert calls == ["one-hot"] and route.vectorized is None
    route(vectorized, one_hot, more_chunks=True)  # times both
    assert calls[1:] == ["vmap", "one-hot"] and route.vectorized is not None
    failing = vjp.ExplicitColumns()
    assert failing(lambda: None, one_hot, more_chunks=True)[0] == 1
    assert failing.vectorized is False


@pytest.mark.parametrize("batch", [5, 20], ids=["one-digit", "two-digits"])
def test_sample_rows_reads_owners_and_refuses_shared_rows(batch):
    """Rows in [T, N] order are each read as their sample's; rows that every
    sample reaches (a table added to all) have no owner (docs/math.rst, "Layer
    structure")."""
    gen = torch.Generator().manual_seed(0)
    positions, features = 3, 4
    x = torch.randn(batch, positions, features, generator=gen, requires_grad=True)
    table = torch.randn(positions, features, generator=gen, requires_grad=True)
    seq_first = x.transpose(0, 1) * 1.5  # row t·N + n belongs to sample n
    output = torch.tanh(seq_first.transpose(0, 1) + table).sum(-1)
    probes = functional.probe_vectors(output.detach()[None], gen)
    at_rows, at_table = torch.autograd.grad(
        output, [seq_first, table], probes, is_grads_batched=True
    )
    rows = functional.sample_rows(at_rows.reshape(len(probes), -1, features), batch)
    expected = torch.arange(positions)[None] * batch + torch.arange(batch)[:, None]
    assert torch.equal(rows, expected)
    assert functional.sample_rows(at_table, batch) is None
