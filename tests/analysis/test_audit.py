"""The approximation audit against dense float64 matrices (docs/math.rst,
"Approximation audit": every quantity and its bound)."""

import pytest
import torch
from torch import nn

from tests.fixtures.checks import EIGVAL_RTOL
from tests.fixtures.optional_packages import installed
from tests.fixtures.problems import Problem, problem_ids, select
from tests.fixtures.reference import (
    dense_ggn,
    dense_gradient,
    dense_mc_ggn,
    eigh_reference,
)
from vivit import InvalidArgumentError, ParamGroupError
from vivit.analysis import audit as audit_module
from vivit.analysis import audit_approximations
from vivit.analysis.approximations import (
    NAMED_LAYERS,
    refusal_reason,
    unsupported_layers,
)

RTOL = EIGVAL_RTOL[torch.float64]
TOP_K, DAMPING, SEED, MC = 3, 0.1, 7, 2
PROBLEMS = [
    p
    for p in select(architecture=["mlp_tanh", "cnn", "conv1d", "batchnorm1d"])
    if (p.loss, p.reduction) in {("ce", "mean"), ("mse", "sum"), ("ce", "sum")}
]


def _spectrum(G: torch.Tensor, k: int):
    """Top-k eigenvalues (descending), eigenvectors (rows), λ_max and gap_k."""
    evals, evecs = eigh_reference(G)
    evals, evecs = evals.flip(0), evecs.flip(1)
    gap = (evals[k - 1] - evals[k]).item()
    return evals[:k], evecs[:, :k].T, evals[0].item(), gap


def _block_mask(model, D):
    mask, start, sizes = torch.zeros(D, D, dtype=torch.bool), 0, []
    for module in model.modules():
        size = sum(p.numel() for p in module.parameters(recurse=False))
        if size:
            mask[start : start + size, start : start + size] = True
            start, sizes = start + size, [*sizes, size]
    return mask


def _check_row(row, G, Ghat, g, k):
    """Every number of a row against dense eigendecompositions, within its bound."""
    exact_values, U, lam_max, gap = _spectrum(G, k)
    approx_values, Uhat, hat_max, hat_gap = _spectrum(Ghat, k)
    errors = (approx_values - exact_values).abs() / exact_values
    error_bound = RTOL * (hat_max + (1 + errors) * lam_max) / exact_values
    assert torch.all(
        (torch.tensor(row.relative_errors, dtype=torch.float64) - errors).abs()
        <= error_bound
    )
    cosines = torch.linalg.svdvals(U @ Uhat.T)
    angle_bound = RTOL * (lam_max / gap + hat_max / max(hat_gap, RTOL * hat_max))
    # a multiple eigenvalue across rank k (a last Linear layer's block under MSE
    # is A ⊗ I_C) leaves the top-k space undefined: no angles to compare then
    angles_defined = angle_bound < 1e-6
    if angles_defined:
        assert torch.allclose(
            torch.tensor(row.principal_cosines, dtype=torch.float64),
            cosines,
            rtol=0,
            atol=angle_bound,
        )
        sines = (1 - cosines.square()).clamp(min=0).sqrt()
        assert row.largest_sine == pytest.approx(
            sines.max().item(), abs=angle_bound**0.5
        )
    eye = torch.eye(len(g), dtype=g.dtype)
    s = -torch.linalg.solve(G + DAMPING * eye, g)
    shat = -torch.linalg.solve(Ghat + DAMPING * eye, g)
    step_bound = 2 * RTOL * sum(m * (m + DAMPING) for m in (lam_max, hat_max))
    step_bound /= DAMPING**2
    assert row.step_cosine == pytest.approx(
        (s @ shat / (s.norm() * shat.norm())).item(), abs=step_bound
    )
    assert row.step_norm_ratio == pytest.approx(
        (shat.norm() / s.norm()).item(), rel=step_bound
    )
    return angles_defined


@pytest.mark.parametrize("engine", ["func", "backpack"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
def test_every_row_matches_dense_matrices(problem: Problem, engine: str):
    """The MC row with the func engine, which draws from the block's documented
    stream (BackPACK's engine seeds torch's global generator from it instead)."""
    model, loss_func, inputs, targets = problem.build(torch.float64)
    model.eval()
    subsampling = [0, 2, 3]
    mc = ("mc",) if engine == "func" else ()
    audit = audit_approximations(
        model,
        loss_func,
        (inputs, targets),
        top_k=TOP_K,
        damping=DAMPING,
        approximations=(*mc, "subsampled", "block_diagonal", "diagonal"),
        engine=engine,
        mc_samples=(MC,),
        subsampling=subsampling,
        seed=SEED,
    )
    G = dense_ggn(model, loss_func, inputs, targets)
    g = dense_gradient(model, loss_func, inputs, targets)
    exact_values, _, lam_max, _ = _spectrum(G, TOP_K)
    assert torch.allclose(
        torch.tensor(audit.exact_eigenvalues, dtype=torch.float64),
        exact_values,
        rtol=0,  # the bound alone: EIGVAL_RTOL·λ_max ("Tolerances of the tests")
        atol=RTOL * lam_max,
    )
    dense = {
        f"mc-{MC}": dense_mc_ggn(model, loss_func, [(inputs, targets)], MC, SEED),
        "subsampled": dense_ggn(
            model, loss_func, inputs, targets, subsampling=subsampling
        ),
        "block_diagonal": G * _block_mask(model, len(g)),
        "diagonal": torch.diag(torch.diagonal(G)),
    }
    if not mc:
        del dense[f"mc-{MC}"]
    assert [row.name for row in audit.rows] == list(dense)
    checked = []
    for row in audit.rows:
        assert row.status == "ok"
        checked.append(_check_row(row, G, dense[row.name], g, TOP_K))
    assert any(checked)  # angles compared on a row at least


@pytest.mark.parametrize(
    "problem",
    select(architecture=["mlp_tanh", "conv1d"], loss="ce"),
    ids=problem_ids(select(architecture=["mlp_tanh", "conv1d"], loss="ce")),
)
def test_kronecker_factored_rows_match_curvlinops_dense_matrices(problem: Problem):
    curvlinops = installed("curvlinops")
    model, loss_func, inputs, targets = problem.build(torch.float64)
    if problem.architecture == "conv1d":  # curvlinops: Linear and Conv2d only
        audit = audit_approximations(
            model, loss_func, (inputs, targets), approximations=("kfac",)
        )
        assert audit.rows[0].status == "unsupported"
        assert "Linear and Conv2d" in audit.rows[0].reason
        return
    audit = audit_approximations(
        model,
        loss_func,
        (inputs, targets),
        top_k=TOP_K,
        damping=DAMPING,
        approximations=("kfac", "ekfac"),
    )
    G = dense_ggn(model, loss_func, inputs, targets)
    g = dense_gradient(model, loss_func, inputs, targets)
    params = list(model.parameters())
    eye = torch.eye(len(g), dtype=torch.float64)
    for row, operator in zip(
        audit.rows,
        (curvlinops.KFACLinearOperator, curvlinops.EKFACLinearOperator),
        strict=True,
    ):
        K = (
            operator(
                model,
                loss_func,
                params,
                [(inputs, targets)],
                fisher_type="type-2",
                check_deterministic=False,
            )
            @ eye
        )
        assert row.status == "ok"
        assert _check_row(row, G, (K + K.T) / 2, g, TOP_K)


def test_without_curvlinops_the_kfac_rows_say_so(monkeypatch):
    model, loss_func, inputs, targets = select(architecture="mlp_tanh")[0].build()
    monkeypatch.setattr(audit_module, "curvlinops_installed", lambda: False)
    audit = audit_approximations(
        model,
        loss_func,
        (inputs, targets),
        approximations=("diagonal", "kfac", "ekfac"),
    )
    assert [r.status for r in audit.rows] == ["ok", "not installed", "not installed"]
    assert "pip install 'vivit[audit]'" in str(audit)
    assert audit.rows[1].step_cosine is None


def test_table_and_dicts_hold_every_row():
    model, loss_func, inputs, targets = select(architecture="mlp_tanh")[0].build()
    audit = audit_approximations(
        model,
        loss_func,
        (inputs, targets),
        top_k=2,
        mc_samples=(1, 3),
        approximations=("mc", "diagonal"),
    )
    rows = audit.as_rows()
    assert [r["name"] for r in rows] == ["mc-1", "mc-3", "diagonal"]
    assert audit.to_dict()["rows"] == rows
    assert rows[0]["max_relative_error"] == max(rows[0]["relative_errors"])
    text = str(audit)
    assert all(r["label"] in text for r in rows)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"approximations": ("kfac", "lbfgs")}, InvalidArgumentError, "lbfgs"),
        ({"approximations": "mc"}, InvalidArgumentError, "sequence"),
        ({"damping": 0.0}, InvalidArgumentError, "damping"),
        ({"top_k": 0}, InvalidArgumentError, "top_k"),
        ({"mc_samples": (1, 0)}, InvalidArgumentError, "mc_samples"),
        ({"param_groups": []}, ParamGroupError, "partition"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs, error, message):
    model, loss_func, inputs, targets = select(architecture="mlp_tanh")[0].build()
    with pytest.raises(error, match=message):
        audit_approximations(model, loss_func, (inputs, targets), **kwargs)


class _MixedLayers(nn.Module):
    """Embedding, Conv1d, affine LayerNorm and LSTM before a Linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.conv = nn.Conv1d(4, 4, 1)
        self.norm = nn.LayerNorm(4)
        self.lstm = nn.LSTM(4, 3, batch_first=True)
        self.head = nn.Linear(3, 3)

    def forward(self, tokens):
        hidden = self.conv(self.embed(tokens).transpose(1, 2)).transpose(1, 2)
        out, _ = self.lstm(self.norm(hidden))
        return self.head(out[:, -1])


def test_kronecker_factored_rows_name_the_layers_curvlinops_refuses():
    """Skipped, naming every unsupported layer and its parameters; frozen, computed."""
    installed("curvlinops")
    torch.manual_seed(0)
    model = _MixedLayers().double()
    data = (torch.randint(0, 7, (4, 3)), torch.randint(0, 3, (4,)))
    loss_func = nn.CrossEntropyLoss()
    kinds = ("kfac", "ekfac")
    audit = audit_approximations(model, loss_func, data, top_k=2, approximations=kinds)
    for row in audit.rows:
        assert row.status == "unsupported" and row.eigenvalues is None
        for layer in (
            "embed (Embedding: weight)",
            "conv (Conv1d: weight, bias)",
            "norm (LayerNorm: weight, bias)",
            "lstm (LSTM: weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0)",
        ):
            assert layer in row.reason
        assert "head" not in row.reason and "skipped" in row.reason
    for name in ("embed", "conv", "norm", "lstm"):
        getattr(model, name).requires_grad_(False)
    audit = audit_approximations(model, loss_func, data, top_k=2, approximations=kinds)
    assert [row.status for row in audit.rows] == ["ok", "ok"]


def test_a_refusal_counts_the_layers_it_does_not_name():
    layers = nn.Sequential(*[nn.LayerNorm(2) for _ in range(NAMED_LAYERS + 2)])
    named = unsupported_layers((nn.Linear,), layers, list(layers.parameters()))
    assert named[0] == "0 (LayerNorm: weight, bias)" and len(named) == len(layers)
    reason = refusal_reason("kfac", (nn.Linear,), named)
    assert f"{NAMED_LAYERS - 1} (LayerNorm" in reason
    assert f"{NAMED_LAYERS} (LayerNorm" not in reason and "and 2 more" in reason


def test_a_refusal_at_curvlinops_first_product_is_a_row_not_a_crash():
    """curvlinops' KFAC refuses soft BCE targets only when first multiplied."""
    installed("curvlinops")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    data = (
        torch.randn(6, 3, dtype=torch.float64),
        torch.rand(6, 2, dtype=torch.float64),
    )
    loss_func = nn.BCEWithLogitsLoss()
    kinds = ("kfac", "ekfac")
    audit = audit_approximations(model, loss_func, data, top_k=2, approximations=kinds)
    for row in audit.rows:
        assert row.status == "unsupported" and "curvlinops refuses" in row.reason
