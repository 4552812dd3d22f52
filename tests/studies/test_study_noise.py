"""The noise study end to end on a tiny configuration."""

import pytest
import torch
from studies import noise

from tests.fixtures.checks import EIGVEC_PRODUCT_REL32, lambda_mean_rel, record
from tests.studies.study_helpers import read_results, run_tiny

K = 3


@pytest.fixture(scope="module")
def run_and_generator(tmp_path_factory):
    """The run's output, and whether torch's global generator was left alone."""
    path = tmp_path_factory.mktemp("noise") / "run"
    before = torch.get_rng_state()
    assert run_tiny("noise", path) == 0
    return path, torch.equal(torch.get_rng_state(), before)


@pytest.fixture(scope="module")
def output(run_and_generator):
    return run_and_generator[0]


@pytest.fixture(scope="module")
def results(output):
    return read_results(output)


def test_the_suites_generator_is_left_alone(run_and_generator):
    """The study seeds torch's global generator; run_tiny restores it."""
    assert run_and_generator[1]


def test_checkpoints(results):
    assert results["study"] == "noise"
    body = results["results"]
    assert len(body["batch_losses"]) == 4
    checkpoints = body["checkpoints"]
    assert [c["step"] for c in checkpoints] == [0, 2, 4]
    for c in checkpoints:
        evals = c["eigenvalues"]
        assert len(evals) == K and evals == sorted(evals, reverse=True)
        assert all(v > 0 for v in evals)
        for key in noise.STATISTICS:
            assert len(c[key]) == K
        assert all(v >= 0 for v in c["gamma_var"] + c["lambda_var"])
        assert all(v is None or v >= 0 for v in c["gamma_snr"] + c["lambda_snr"])
        assert all(v >= 0 for v in c["lambda_mean"])
        fraction = c["gradient_fraction_in_top_k"]
        assert 0 <= fraction <= 1 + EIGVEC_PRODUCT_REL32  # float32 directions
        for key in ("train_loss", "test_loss", "test_accuracy", "probe_loss"):
            assert key in c


def test_lambda_means_add_up_to_eigenvalues(results):
    """R Σ_n λ_nk = λ_k: for a mean-reduced loss the mean of λ_nk is λ_k.

    The float32 study's Gram matrix is float32 (the model's type): within
    ``lambda_mean_rel`` (docs/math.rst, "Tolerances of the tests", "Sums of
    eigenvalues").
    """
    assert results["dtype"] == "float32"
    num_classes = results["data"]["num_classes"]
    rel = lambda_mean_rel(results["config"]["batch_size"], num_classes, torch.float32)
    for c in results["results"]["checkpoints"]:
        for mean, value in zip(c["lambda_mean"], c["eigenvalues"], strict=True):
            record(abs(mean - value), rel * value)
            assert mean == pytest.approx(value, rel=rel)


def test_figure(output, results):
    assert results["figures"] == ["snr.png"]
    png = (output / "snr.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
