"""The monitor study end to end on a tiny configuration, and its plot command."""

import json

import pytest
from studies import monitor

from tests.studies.study_helpers import read_results, run_tiny
from vivit.analysis import read_records

K = 3


@pytest.fixture(scope="module", params=["current", "fixed"])
def output(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("monitor") / "run"
    assert run_tiny("monitor", path, "--monitor-batch", request.param) == 0
    return path


def test_records_and_results(output):
    results = read_results(output)
    assert results["study"] == "monitor"
    body = results["results"]
    records = read_records(output / body["records_file"])
    assert [r["step"] for r in records] == [2, 4]
    assert {r["batch"] for r in records} == {body["monitor_batch"]}
    assert all(len(r["eigenvalues"]) == K for r in records)
    assert len(body["batch_losses"]) == 4
    overhead = body["overhead"]
    total = sum(r["overhead_s"] for r in records)
    # the same sums in the same order of the same floats (JSON keeps them exactly)
    assert overhead["per_step_s"] == total / 4
    assert overhead["per_record_s"] == total / 2
    assert results["timings"]["monitor_s"] == total
    assert "torch" in results["versions"] and results["config"]["every"] == 2


def test_figure(output):
    assert read_results(output)["figures"] == ["monitor.png"]
    png = (output / "monitor.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_plot_command(output, capsys):
    records = output / "records.jsonl"
    assert monitor.main(["--plot", str(records)]) == 0
    png = (output / "records.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "2 records" in capsys.readouterr().out


def test_plot_command_refuses_what_is_not_records(tmp_path, capsys):
    empty, broken = tmp_path / "empty.jsonl", tmp_path / "broken.jsonl"
    empty.write_text("")
    broken.write_text(json.dumps({"step": 1}) + "\n")
    assert monitor.main(["--plot", str(empty)]) == 2
    assert "holds no records" in capsys.readouterr().err
    assert monitor.main(["--plot", str(broken)]) == 2
    assert "lacks the field" in capsys.readouterr().err
    assert not (tmp_path / "broken.png").exists()
