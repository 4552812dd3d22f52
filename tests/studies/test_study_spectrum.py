"""The spectrum study end to end on a tiny configuration."""

import math

import pytest
import torch
from studies.models import layer_groups

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL32,
    record,
    spectrum_sum_rel,
)
from tests.studies.study_helpers import read_results, run_tiny

METHODS = ("exact", "mc", "subsample", "block_diagonal")
N, C, K = 12, 10, 3


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    path = tmp_path_factory.mktemp("spectrum") / "run"
    assert run_tiny("spectrum", path) == 0
    return path


@pytest.fixture(scope="module")
def results(output):
    return read_results(output)


def test_documented_keys(results):
    assert results["study"] == "spectrum"
    for key in ("config", "seed", "device", "dtype", "versions", "data", "model"):
        assert key in results
    for key in ("results", "timings", "figures", "summary", "checkpoints"):
        assert key in results
    assert results["versions"]["vivit"] != "not installed"
    assert results["config"]["batch_size"] == N
    assert set(results["results"]["methods"]) == set(METHODS)
    assert results["data"]["num_classes"] == C


def test_exact_eigenvalues_positive_and_sorted(results):
    exact = results["results"]["methods"]["exact"]
    evals = exact["eigenvalues"]
    assert len(evals) == N * C == exact["gram_sizes"][0]
    assert evals == sorted(evals, reverse=True)
    top = exact["top_eigenvalues"]
    assert len(top) == K and all(v > 0 for v in top)
    assert top == evals[:K] or all(
        math.isclose(a, b, rel_tol=EIGVAL_RTOL[torch.float32])
        for a, b in zip(top, evals[:K], strict=True)
    )
    assert 0 < exact["num_nonzero"] <= N * (C - 1)
    assert exact["max_relative_error"] == 0
    # float32 eigenvectors of the same Gram matrix (docs/math.rst, "Tolerances")
    assert exact["subspace_overlap"] == pytest.approx(1, abs=EIGVEC_PRODUCT_REL32)


def test_approximations(results):
    methods = results["results"]["methods"]
    assert methods["mc"]["gram_sizes"] == [N]  # one MC sample per datum
    assert methods["subsample"]["gram_sizes"] == [N // 2 * C]
    blocks = methods["block_diagonal"]
    assert blocks["gram_sizes"] == [N * C] * len(blocks["blocks"]) == [N * C] * 4
    for name in METHODS:
        method = methods[name]
        assert len(method["relative_errors"]) == K
        assert math.isfinite(method["max_relative_error"])
        assert 0 <= method["mean_relative_error"] <= method["max_relative_error"]
        overlap = method["subspace_overlap"]
        assert -EIGVEC_PRODUCT_REL32 <= overlap <= 1 + EIGVEC_PRODUCT_REL32
        assert method["time_s"]["total"] > 0
        evals = method["eigenvalues"]
        assert evals == sorted(evals, reverse=True)


def test_block_diagonal_keeps_the_trace(results):
    """The block-diagonal approximation keeps the diagonal blocks, so the trace.

    Both from the same float32 factors, their Gram matrices formed and decomposed
    in ``gram_dtype``: within ``spectrum_sum_rel`` (docs/math.rst, "Tolerances of
    the tests", "Sums of eigenvalues").
    """
    methods = results["results"]["methods"]
    exact = sum(methods["exact"]["eigenvalues"])
    blocks = sum(methods["block_diagonal"]["eigenvalues"])
    gram_dtype = getattr(torch, results["results"]["gram_dtype"])
    rel = spectrum_sum_rel(N * C, gram_dtype)
    record(abs(blocks - exact), rel * exact)
    assert blocks == pytest.approx(exact, rel=rel)


def test_figure_and_model_written(output, results):
    assert results["figures"] == ["spectrum.png"]
    png = (output / "spectrum.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    state = torch.load(output / "model.pt", weights_only=True)
    assert set(state) == {f"{i}.{p}" for i in (0, 4, 8) for p in ("weight", "bias")} | {
        f"1.{p}"
        for p in (
            "weight",
            "bias",
            "running_mean",
            "running_var",
            "num_batches_tracked",
        )
    }


def test_checkpoint_round_trip(output, run, tmp_path):
    status, out, _ = run(
        "spectrum", tmp_path / "again", "--checkpoint", str(output / "model.pt")
    )
    assert status == 0
    again = run.results(tmp_path / "again")
    assert again["results"]["training"] is None
    assert "from --checkpoint" in out


def test_reproducible(results, run, tmp_path):
    assert run("spectrum", tmp_path / "same")[0] == 0
    same = run.results(tmp_path / "same")
    for name in METHODS:
        first, second = (
            results["results"]["methods"][name],
            same["results"]["methods"][name],
        )
        assert first["eigenvalues"] == second["eigenvalues"]
        assert first["subspace_overlap"] == second["subspace_overlap"]
    assert (
        results["results"]["training"]["batch_losses"]
        == (same["results"]["training"]["batch_losses"])
    )


def test_blocks_per_parameter(run, tmp_path):
    status, out, err = run("spectrum", tmp_path / "o", "--blocks", "parameter")
    assert status == 0, err
    blocks = run.results(tmp_path / "o")["results"]["methods"]["block_diagonal"]
    assert len(blocks["gram_sizes"]) == 8  # weight and bias of 4 layers
    assert "block-diagonal (8 parameters)" in out


def test_float32_model_accumulates_its_gram_in_float64(results, run, tmp_path):
    """``--gram-dtype auto`` (default): float64 Gram of the float32 model."""
    assert results["dtype"] == "float32"
    assert results["results"]["gram_dtype"] == "float64"
    exact = results["results"]["methods"]["exact"]
    status, out, err = run("spectrum", tmp_path / "f32", "--gram-dtype", "model")
    assert status == 0, err
    assert "in float32" in out and "eigenvalues resolved" in out
    f32 = run.results(tmp_path / "f32")["results"]
    assert f32["gram_dtype"] == "float32"
    exact32 = f32["methods"]["exact"]
    # the float32 Gram's tolerance is ε₃₂/ε₆₄ ≈ 5e8 times larger: fewer resolved
    assert exact32["zero_tolerance"] > 1e6 * exact["zero_tolerance"]
    assert exact32["num_nonzero"] <= exact["num_nonzero"]
    # the leading eigenvalues agree to float32 rounding of the Gram matrix
    for a, b in zip(exact32["top_eigenvalues"], exact["top_eigenvalues"], strict=True):
        assert a == pytest.approx(b, rel=EIGVAL_RTOL[torch.float32])


def test_auto_gram_dtype_falls_back_when_float64_does_not_fit(monkeypatch):
    from studies import spectrum

    from vivit import GramTooLargeError

    def refuse(*args):
        raise GramTooLargeError("too large")

    cpu = torch.device("cpu")
    assert spectrum.choose_gram_dtype("auto", torch.float32, 10, 1, cpu) == (
        torch.float64
    )
    assert spectrum.choose_gram_dtype("model", torch.float32, 10, 1, cpu) == (
        torch.float32
    )
    monkeypatch.setattr(spectrum, "check_gram_fits", refuse)
    assert spectrum.choose_gram_dtype("auto", torch.float32, 10, 1, cpu) == (
        torch.float32
    )
    assert spectrum.choose_gram_dtype("float64", torch.float32, 10, 1, cpu) == (
        torch.float64
    )


def test_layer_groups_hold_a_tied_weight_once():
    """An embedding tied to the output layer is in one block, not two."""
    embedding = torch.nn.Embedding(7, 4)
    head = torch.nn.Linear(4, 7)
    head.weight = embedding.weight
    model = torch.nn.Sequential(embedding, torch.nn.Tanh(), head)
    groups = layer_groups(model)
    ids = [id(p) for _, params in groups for p in params]
    assert sorted(ids) == sorted({id(p) for p in model.parameters()})
    assert [name for name, _ in groups] == ["0 (Embedding)", "2 (Linear)"]
