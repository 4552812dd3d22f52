"""The noise study end to end on a tiny configuration."""

import pytest
from studies import noise

from tests.fixtures.checks import EIGVEC_PRODUCT_REL32, record
from tests.studies.study_helpers import read_results, run_tiny

K = 3
#: Mean of λ_nk against λ_k in the float32 study: a measured spread kept with a
#: stated margin of at least 10×.
MEAN_REL = 1e-3


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    path = tmp_path_factory.mktemp("noise") / "run"
    assert run_tiny("noise", path) == 0
    return path


@pytest.fixture(scope="module")
def results(output):
    return read_results(output)


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
    """R Σ_n λ_nk = λ_k: for a mean-reduced loss the mean of λ_nk is λ_k."""
    for c in results["results"]["checkpoints"]:
        for mean, value in zip(c["lambda_mean"], c["eigenvalues"], strict=True):
            record(abs(mean - value), MEAN_REL * value)
            assert mean == pytest.approx(value, rel=MEAN_REL)


def test_figure(output, results):
    assert results["figures"] == ["snr.png"]
    png = (output / "snr.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
