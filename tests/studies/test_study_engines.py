"""The studies on models only the func engine handles: ``--engine``, ``--model``
transformer and char-lstm, sequence data in ``--data``."""

import pytest
import torch

from tests.studies.study_helpers import read_results


@pytest.fixture(scope="module")
def sequence_data(tmp_path_factory):
    """Float sequences [N, 3, 4] with one label each, for the transformer."""
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(40, 3, 4, generator=gen)
    targets = (inputs.sum((1, 2)) > 0).long() + (inputs[:, 0, 0] > 1).long()
    path = tmp_path_factory.mktemp("data") / "sequences.pt"
    torch.save({"inputs": inputs, "targets": targets}, path)
    return path


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """Token sequences [N, 5] over 4 characters; the target is the next character."""
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 4, (40, 6), generator=gen)
    path = tmp_path_factory.mktemp("data") / "chars.pt"
    torch.save({"inputs": text[:, :-1], "targets": text[:, 1:]}, path)
    return path


@pytest.mark.parametrize("engine", ["auto", "func"])
def test_spectrum_of_a_transformer(run, tmp_path, sequence_data, engine):
    status, _, err = run(
        "spectrum", tmp_path / "o", "--model", "transformer", "--data",
        str(sequence_data), "--engine", engine, "--batch-size", "6",
    )  # fmt: skip
    assert status == 0, err
    exact = read_results(tmp_path / "o")["results"]["methods"]["exact"]
    assert len(exact["eigenvalues"]) == 6 * 3 and exact["num_nonzero"] > 0


def test_newton_on_a_char_lstm(run, tmp_path, char_data):
    status, _, err = run(
        "newton", tmp_path / "o", "--model", "char-lstm", "--data", str(char_data),
        "--engine", "func", "--batch-size", "4", "--steps", "2", "--eval-every", "1",
    )  # fmt: skip
    assert status == 0, err
    optimizers = read_results(tmp_path / "o")["results"]["optimizers"]
    for name in ("newton-constant", "newton-bootstrap"):
        assert optimizers[name]["status"] == "completed"
        assert all(d["directions"] > 0 for d in optimizers[name]["directions"])


def test_noise_on_a_char_lstm(run, tmp_path, char_data):
    status, _, err = run(
        "noise", tmp_path / "o", "--model", "char-lstm", "--data", str(char_data),
        "--engine", "func", "--batch-size", "4",
    )  # fmt: skip
    assert status == 0, err


def test_backpack_refuses_the_transformer(run, tmp_path, sequence_data):
    status, _, err = run(
        "spectrum", tmp_path / "o", "--model", "transformer", "--data",
        str(sequence_data), "--engine", "backpack",
    )  # fmt: skip
    assert status == 2
    assert "--engine func" in err
