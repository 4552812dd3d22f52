"""The command line of the studies: help, user models and data, clear errors."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from studies import hierarchy, newton, noise, spectrum
from studies.models import mlp

from tests.studies.study_helpers import ROOT


@pytest.mark.parametrize("study", ["spectrum", "noise", "newton", "hierarchy"])
def test_help_from_the_repository_root(study):
    """``python exp/<study>.py --help`` works and explains every option."""
    done = subprocess.run(
        [sys.executable, f"exp/{study}.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    module = {
        "spectrum": spectrum,
        "noise": noise,
        "newton": newton,
        "hierarchy": hierarchy,
    }[study]
    for action in module.build_parser()._actions:
        for option in action.option_strings:
            assert option in done.stdout
        assert action.help, action.option_strings


def test_existing_output_is_refused(run, tmp_path):
    (tmp_path / "taken").mkdir()
    status, _, err = run("spectrum", tmp_path / "taken")
    assert status == 2
    assert "exists" in err and "--overwrite" in err
    status, _, _ = run("spectrum", tmp_path / "taken", "--overwrite")
    assert status == 0
    assert (tmp_path / "taken" / "results.json").is_file()


def test_checkpoint_of_another_model(run, tmp_path):
    torch.save(mlp((1, 8, 8), 10).state_dict(), tmp_path / "mlp.pt")
    status, _, err = run(
        "spectrum", tmp_path / "out", "--model", "cnn", "--checkpoint",
        str(tmp_path / "mlp.pt"),
    )  # fmt: skip
    assert status == 2
    assert "does not match --model cnn" in err
    assert "Missing key" in err or "Unexpected key" in err
    assert not (tmp_path / "out").exists()


def test_checkpoint_with_wrong_shapes(run, tmp_path):
    torch.save(mlp((1, 8, 8), 5).state_dict(), tmp_path / "five.pt")
    status, _, err = run(
        "noise", tmp_path / "out", "--model", "mlp", "--checkpoint",
        str(tmp_path / "five.pt"),
    )  # fmt: skip
    assert status == 2
    assert "size mismatch" in err


@pytest.mark.parametrize(
    "content", [[1, 2, 3], "not even a file"], ids=["not-a-state-dict", "garbage"]
)
def test_checkpoint_that_is_not_a_state_dict(run, tmp_path, content):
    path = tmp_path / "bad.pt"
    if isinstance(content, str):
        path.write_text(content)
    else:
        torch.save(content, path)
    status, _, err = run("spectrum", tmp_path / "out", "--checkpoint", str(path))
    assert status == 2
    assert "--checkpoint" in err


def test_missing_checkpoint(run, tmp_path):
    status, _, err = run("newton", tmp_path / "o", "--checkpoint", "/no/such.pt")
    assert status == 2 and "no such file" in err


def _save(path, inputs, targets):
    if path.suffix == ".npz":
        np.savez(path, inputs=np.asarray(inputs), targets=np.asarray(targets))
    else:
        torch.save(
            {"inputs": torch.as_tensor(inputs), "targets": torch.as_tensor(targets)},
            path,
        )


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_own_data(run, tmp_path, suffix):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(60, 6, generator=generator)
    targets = torch.randint(0, 3, (60,), generator=generator)
    _save(tmp_path / f"data{suffix}", inputs, targets)
    status, out, err = run(
        "spectrum", tmp_path / "out", "--model", "mlp", "--data",
        str(tmp_path / f"data{suffix}"),
    )  # fmt: skip
    assert status == 0, err
    results = run.results(tmp_path / "out")
    assert results["data"]["num_classes"] == 3
    assert results["data"]["input_shape"] == [6]
    assert results["data"]["num_train"] + results["data"]["num_test"] == 60
    exact = results["results"]["methods"]["exact"]
    assert len(exact["eigenvalues"]) == 12 * 3


BAD_DATA = {
    "inputs-1d": (torch.randn(20), torch.zeros(20, dtype=torch.int64), "inputs"),
    "length-mismatch": (torch.randn(20, 4), torch.zeros(19, dtype=torch.int64), "[N]"),
    "negative-label": (
        torch.randn(20, 4),
        -torch.ones(20, dtype=torch.int64),
        "[0, C)",
    ),
    "float-labels": (torch.randn(20, 4), torch.rand(20), "integer"),
    "one-class": (
        torch.randn(20, 4),
        torch.zeros(20, dtype=torch.int64),
        "two classes",
    ),
    "nan-inputs": (torch.full((20, 4), float("nan")), torch.arange(20) % 2, "NaN"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data(run, tmp_path, case):
    inputs, targets, expected = BAD_DATA[case]
    _save(tmp_path / "data.pt", inputs, targets)
    status, _, err = run(
        "spectrum", tmp_path / "out", "--model", "mlp", "--data",
        str(tmp_path / "data.pt"),
    )  # fmt: skip
    assert status == 2
    assert expected in err


def test_data_without_the_keys(run, tmp_path):
    np.savez(tmp_path / "data.npz", x=np.zeros((20, 3)), y=np.zeros(20))
    status, _, err = run("noise", tmp_path / "o", "--data", str(tmp_path / "data.npz"))
    assert status == 2 and "'inputs' and 'targets'" in err


def test_cnn_needs_images(run, tmp_path):
    _save(tmp_path / "data.pt", torch.randn(30, 5), torch.arange(30) % 3)
    status, _, err = run(
        "spectrum", tmp_path / "o", "--data", str(tmp_path / "data.pt")
    )
    assert status == 2
    assert "--model mlp" in err


def test_data_that_does_not_fit_the_model(run, tmp_path, factories):
    _save(tmp_path / "data.pt", torch.randn(30, 7), torch.arange(30) % 3)
    status, _, err = run(
        "spectrum", tmp_path / "o", "--model", f"{factories}:small_mlp", "--data",
        str(tmp_path / "data.pt"),
    )  # fmt: skip
    assert status == 2
    assert "cannot process inputs of shape [7]" in err


def test_labels_beyond_the_model_outputs(run, tmp_path, factories):
    status, _, err = run(
        "spectrum", tmp_path / "o", "--model", f"{factories}:three_outputs"
    )
    assert status == 2
    assert "labels go up to 9" in err and "3 outputs" in err


def test_model_factory(run, tmp_path, factories):
    status, _, err = run("noise", tmp_path / "o", "--model", f"{factories}:small_mlp")
    assert status == 0, err
    assert run.results(tmp_path / "o")["model"]["num_parameters"] == 64 * 8 + 8 + 90


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("no_such_module_xyz:make", "importing no_such_module_xyz failed"),
        ("{factories}:missing", "has no callable missing"),
        ("{factories}:not_a_module", "not a torch.nn.Module"),
        ("resnet", "MODULE:FACTORY"),
    ],
)
def test_bad_model_spec(run, tmp_path, factories, spec, expected):
    status, _, err = run(
        "spectrum", tmp_path / "o", "--model", spec.format(factories=factories)
    )
    assert status == 2
    assert expected in err


def test_unsupported_layer(run, tmp_path, factories):
    status, _, err = run(
        "newton",
        tmp_path / "o",
        "--model",
        f"{factories}:layernorm_mlp",
        "--engine",
        "backpack",
    )
    assert status == 2
    assert "cannot handle" in err and "LayerNorm" in err


@pytest.mark.parametrize("study", ["spectrum", "newton"])
def test_custom_forward_runs_with_or_without_converter(run, tmp_path, factories, study):
    # the engine converts a residual model itself; converted by the user works too
    for factory in ("residual", "residual_converted"):
        output = tmp_path / factory
        status, _, err = run(study, output, "--model", f"{factories}:{factory}")
        assert status == 0, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is available")
def test_cuda_without_gpu(run, tmp_path):
    status, _, err = run("spectrum", tmp_path / "o", "--device", "cuda")
    assert status == 2
    assert "no CUDA GPU is available" in err


def test_bad_device(run, tmp_path):
    status, _, err = run("spectrum", tmp_path / "o", "--device", "tpu")
    assert status == 2 and "--device" in err


def test_subsample_larger_than_the_batch(run, tmp_path):
    status, _, err = run("spectrum", tmp_path / "o", "--subsample-size", "13")
    assert status == 2 and "--subsample-size 13 exceeds --batch-size 12" in err


def test_batch_larger_than_the_data(run, tmp_path):
    status, _, err = run("noise", tmp_path / "o", "--batch-size", "5000")
    assert status == 2 and "exceeds" in err


@pytest.mark.parametrize(
    "options", [["--batch-size", "0"], ["--optimizers", "lbfgs"], ["--top-k", "none"]]
)
def test_invalid_option_values(run, tmp_path, options):
    with pytest.raises(SystemExit) as exit_info:
        run("newton", tmp_path / "o", *options)
    assert exit_info.value.code == 2


def test_whole_model_checkpoint_says_save_the_state_dict(run, tmp_path):
    torch.save(mlp((1, 8, 8), 10), tmp_path / "whole.pt")  # the model, pickled
    status, _, err = run(
        "spectrum", tmp_path / "out", "--model", "mlp", "--checkpoint",
        str(tmp_path / "whole.pt"),
    )  # fmt: skip
    assert status == 2
    assert "save `model.state_dict()`" in err
    assert "torch.nn.modules.container.Sequential" in err  # what the file holds
    assert "Weights only load failed" not in err and "\x1b" not in err


def test_damaged_checkpoint_message_is_plain(run, tmp_path):
    path = tmp_path / "damaged.pt"
    path.write_bytes(b"\x80\x02not a pickle at all")
    status, _, err = run("spectrum", tmp_path / "out", "--checkpoint", str(path))
    assert status == 2
    assert "model.state_dict()" in err and "\x1b" not in err
