"""The spectrum study over the whole held-out set (``--curvature-data test``).

The held-out set is passed to vivit as a DataLoader of ``--batch-size`` batches;
its exact spectrum must be that of LowRankGGN on the concatenated held-out set
with the study's trained model (float32 model, float64 Gram matrix: float32
factors computed batch by batch instead of at once, so within the float32-factor
bound of docs/math.rst, "Tolerances of the tests", of ``λ_max``; a missing
rescaling of the batches would be off by a factor of up to 3).
"""

import pytest
import torch
from studies.data import load_dataset
from studies.models import build_model

from tests.fixtures.checks import factor_product_bound
from tests.studies.study_helpers import read_results, run_tiny
from vivit import LowRankGGN

TEST_FRACTION, N_BATCH, C = 0.02, 12, 10


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    path = tmp_path_factory.mktemp("heldout") / "run"
    options = ["--curvature-data", "test", "--test-fraction", str(TEST_FRACTION)]
    assert run_tiny("spectrum", path, *options, "--timing-repeats", "1") == 0
    return path


def test_whole_held_out_set(output):
    results = read_results(output)
    data = load_dataset(None, TEST_FRACTION, results["seed"])
    num_test = len(data.test_targets)
    assert num_test > 2 * N_BATCH  # several batches, the last one shorter
    spectrum = results["results"]
    assert spectrum["curvature_data"] == "test"
    assert spectrum["num_samples"] == num_test
    methods = spectrum["methods"]
    assert methods["exact"]["gram_sizes"] == [num_test * C]
    assert methods["mc"]["gram_sizes"] == [num_test]
    assert methods["subsample"]["gram_sizes"] == [N_BATCH * C]
    assert "whole held-out set" in results["summary"][1]

    model = build_model("cnn", data)
    model.load_state_dict(torch.load(output / "model.pt", weights_only=True))
    ggn = LowRankGGN(
        model.eval(),
        torch.nn.CrossEntropyLoss(),
        (data.test_inputs, data.test_targets),
        gram_dtype=torch.float64,
    )
    expected = ggn.eigvalsh().flip(0)
    actual = torch.tensor(methods["exact"]["eigenvalues"], dtype=torch.float64)
    bound = factor_product_bound(expected.max().item())  # ‖δG̃‖ ≥ |δλ|
    assert (actual - expected).abs().max() <= bound
