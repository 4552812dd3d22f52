"""The hierarchy study end to end on a tiny configuration.

Its numbers are checked against the identities of ``docs/math.rst``: the parts'
traces sum to the GGN's ("Hierarchy of the spectrum": ``G = G_class + G_cross +
G_within``, each part's dropped eigenvalues at most ``τ``, each kept one within
``N·C·ε·λ_max``), their ranks are at most ``C`` and ``C(C−1)``, and the SLQ
measure counts ``N·C`` eigenvalues within its Wasserstein bound ("Spectral
density by stochastic Lanczos quadrature").
"""

import pytest
import torch

from tests.fixtures.checks import EIGVAL_RTOL, rounding_rel
from tests.studies.study_helpers import read_results, run_tiny

N, C = 12, 10
PARTS = ("class_means", "cross_class", "within_class")


@pytest.fixture(scope="module", params=["probabilities", "plain"])
def results(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("hierarchy") / "run"
    assert run_tiny("hierarchy", path, "--weighting", request.param) == 0
    return read_results(path)


def test_documented_keys(results):
    assert results["study"] == "hierarchy"
    for key in ("config", "seed", "device", "dtype", "versions", "data", "model"):
        assert key in results
    assert results["figures"] == ["hierarchy.png"]
    assert results["checkpoints"] == ["model.pt"]
    numbers = results["results"]
    assert numbers["num_samples"] == N and numbers["num_classes"] == C
    assert numbers["gram_dtype"] == "float64"
    assert set(numbers["spectra"]) == {"full", *PARTS}
    assert len(numbers["layers"]) == 4


def test_parts_add_up_to_the_ggn(results):
    numbers = results["results"]
    spectra, tolerance = numbers["spectra"], numbers["zero_tolerance"]
    for values in [*spectra.values(), *numbers["layers"].values()]:
        assert values == sorted(values, reverse=True)
    assert all(v > tolerance for name in spectra for v in spectra[name])
    assert len(spectra["class_means"]) <= C
    assert len(spectra["cross_class"]) <= C * (C - 1)
    assert len(spectra["full"]) <= N * (C - 1)
    lam_max = spectra["full"][0]
    per_eigenvalue = tolerance + EIGVAL_RTOL[torch.float64] * lam_max
    total = sum(numbers["traces"][name] for name in PARTS)
    assert abs(total - numbers["traces"]["full"]) <= 3 * N * C * per_eigenvalue
    for name in PARTS:
        overlap = numbers["overlaps"][name]
        assert -rounding_rel(N * C) <= overlap["in_top_C"] <= overlap["in_top_C2"]
        assert overlap["in_top_C2"] <= 1 + rounding_rel(N * C)


def test_density_against_the_exact_spectrum(results):
    density = results["results"]["density"]
    assert density["dim"] == N * C
    assert len(density["nodes"]) == len(density["weights"]) == 10 * 4
    assert abs(sum(density["weights"]) - N * C) <= N * C * rounding_rel(10)
    assert 0 <= density["wasserstein_distance"] <= density["wasserstein_bound"]
    for entry in density["counts_above"]:
        assert 0 <= entry["slq"] <= N * C + 1e-9 and 0 <= entry["exact"] <= N * C


def test_per_position_targets_are_refused(tmp_path, capsys):
    """The hierarchy needs one label per sample: a sequence model is told so."""
    (tmp_path / "sequence.py").write_text(
        "from torch import nn\n\n"
        "def make():\n"
        "    return nn.Sequential(nn.Linear(6, 12), nn.Unflatten(1, (3, 4)))\n"
    )
    generator = torch.Generator().manual_seed(0)
    data = {
        "inputs": torch.randn(60, 6, generator=generator),
        "targets": torch.randint(0, 3, (60, 4), generator=generator),
    }
    torch.save(data, tmp_path / "data.pt")
    status = run_tiny(
        "hierarchy", tmp_path / "out", "--model", f"{tmp_path / 'sequence.py'}:make",
        "--data", str(tmp_path / "data.pt"),
    )  # fmt: skip
    assert status == 2
    assert "one label per sample" in capsys.readouterr().err
