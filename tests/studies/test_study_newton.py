"""The Newton study end to end on a tiny configuration."""

import math

import pytest
from studies import newton

from tests.studies.study_helpers import read_results, run_tiny


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    path = tmp_path_factory.mktemp("newton") / "run"
    assert run_tiny("newton", path) == 0
    return path


@pytest.fixture(scope="module")
def results(output):
    return read_results(output)


def test_every_optimizer_ran(results):
    optimizers = results["results"]["optimizers"]
    assert list(optimizers) == list(newton.OPTIMIZERS)
    for name, r in optimizers.items():
        assert r["status"] == "completed", name
        assert len(r["batch_loss"]) == len(r["batch_accuracy"]) == r["steps"] == 6
        assert [e["step"] for e in r["evaluations"]] == [0, 3, 6]
        assert r["wall_time_s"] > 0
        assert all(0 <= a <= 1 for a in r["batch_accuracy"])


def test_same_initialisation(results):
    initial = {
        name: r["initial"]["train_loss"]
        for name, r in results["results"]["optimizers"].items()
    }
    assert len(set(initial.values())) == 1


@pytest.mark.parametrize("name", ["newton-constant", "newton-bootstrap"])
def test_newton_decreases_the_loss(results, name):
    r = results["results"]["optimizers"][name]
    assert math.isfinite(r["final"]["train_loss"])
    assert r["final"]["train_loss"] < r["initial"]["train_loss"]
    assert all(d["directions"] > 0 for d in r["directions"])


def test_figure(output, results):
    assert results["figures"] == ["loss.png"]
    png = (output / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_optimizer_subset_and_top_k(run, tmp_path):
    status, out, _ = run(
        "newton", tmp_path / "subset", "--optimizers", "newton-constant,sgd",
        "--top-k", "5", "--steps", "2",
    )  # fmt: skip
    assert status == 0, out
    r = run.results(tmp_path / "subset")["results"]["optimizers"]
    assert list(r) == ["newton-constant", "sgd"]
    assert all(d["directions"] == 5 for d in r["newton-constant"]["directions"])
