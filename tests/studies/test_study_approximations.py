"""The approximation study end to end on a tiny configuration."""

import importlib.util

import pytest

from tests.studies.study_helpers import read_results, run_tiny

ROWS = ["mc-1", "mc-4", "subsampled", "block_diagonal", "diagonal", "kfac", "ekfac"]
CURVLINOPS = importlib.util.find_spec("curvlinops") is not None


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    path = tmp_path_factory.mktemp("approximations") / "run"
    assert run_tiny("approximations", path) == 0
    return path


def test_every_row_and_setting_is_recorded(output):
    results = read_results(output)
    assert results["study"] == "approximations"
    assert results["figures"] == ["approximations.png"]
    assert (output / "approximations.png").stat().st_size > 0
    assert "curvlinops-for-pytorch" in results["versions"]
    audit = results["results"]["audit"]
    assert audit["top_k"] == 3 and audit["damping"] == 0.1
    assert audit["num_samples"] == 12
    assert [row["name"] for row in audit["rows"]] == ROWS
    expected = "ok" if CURVLINOPS else "not installed"
    assert [row["status"] for row in audit["rows"][-2:]] == [expected] * 2
    for row in audit["rows"]:
        if row["status"] != "ok":
            continue
        assert len(row["relative_errors"]) == len(row["principal_cosines"]) == 3
        assert all(0 <= c <= 1 for c in row["principal_cosines"])
        assert -1 <= row["step_cosine"] <= 1
    assert "Approximation audit" in "\n".join(results["summary"])


def test_the_study_runs_without_curvlinops(tmp_path, monkeypatch):
    from vivit.analysis import audit

    monkeypatch.setattr(audit, "curvlinops_installed", lambda: False)
    assert run_tiny("approximations", tmp_path / "run") == 0
    rows = read_results(tmp_path / "run")["results"]["audit"]["rows"]
    assert [row["status"] for row in rows[-2:]] == ["not installed"] * 2
