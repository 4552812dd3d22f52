"""The studies on Hugging Face models (tiny random GPT-2, BERT, ViT).

``--output-field``, keyword inputs in ``--data``, next-token targets, and what a
study refuses.

The GPT-2 spectrum is checked against the dense float64 reference of the same
weights and samples (``EIGVAL_RTOL``, ``docs/math.rst``, "Precision and the
numerical zero").
"""

import re

import numpy as np
import pytest
import torch
from torch import nn

from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.optional_packages import installed
from tests.fixtures.reference import dense_ggn
from tests.studies.study_helpers import read_results
from vivit.huggingface import IGNORE_INDEX, token_logits

hf_models = installed("tests.fixtures.hf_models")  # needs transformers

from studies.data import load_dataset  # noqa: E402
from studies.errors import StudyError  # noqa: E402
from studies.training import accuracy, evaluate  # noqa: E402

#: torch.func has no batching rule for SDPA's CPU backward: slower, still exact
pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop:UserWarning"
)
FACTORIES = hf_models.__file__
VOCAB, T, CLASSES = hf_models.VOCAB, 5, hf_models.CLASSES


def _tokens(num: int) -> dict[str, np.ndarray]:
    """Token ids with padding on the right of some rows and the left of others."""
    rng = np.random.default_rng(0)
    mask = np.ones((num, T), dtype=np.int64)
    mask[::3, 3:] = 0
    mask[1::3, :1] = 0
    return {"input_ids": rng.integers(0, VOCAB, (num, T)), "attention_mask": mask}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    """A causal language model's data: input_ids and attention_mask, no targets."""
    path = tmp_path_factory.mktemp("data") / "tokens.npz"
    np.savez(path, **_tokens(20))
    return path


@pytest.fixture(scope="module")
def classified_tokens(tmp_path_factory):
    """Sequences with one class each, for BERT."""
    path = tmp_path_factory.mktemp("data") / "sequences.npz"
    targets = np.random.default_rng(1).integers(0, CLASSES, 20)
    np.savez(path, **_tokens(20), targets=targets)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """1x4x4 images with one class each, as ViT's keyword pixel_values."""
    rng = np.random.default_rng(2)
    path = tmp_path_factory.mktemp("data") / "images.npz"
    pixel_values = rng.standard_normal((20, 1, 4, 4)).astype(np.float32)
    np.savez(path, pixel_values=pixel_values, targets=rng.integers(0, CLASSES, 20))
    return path


def test_gpt2_spectrum_is_the_reference_ggn_of_its_next_tokens(
    run, tmp_path, token_file
):
    """The held-out set's GGN of the trained GPT-2, from a data file with no targets
    (next tokens, padding ignored), equals the dense float64 reference; the
    block-diagonal stage holds the tied head/embedding weight once."""
    status, _, err = run(
        "spectrum", tmp_path / "o", "--model", f"{FACTORIES}:gpt2",
        "--output-field", "logits", "--data", str(token_file),
        "--curvature-data", "test", "--dtype", "float64", "--batch-size", "4",
    )  # fmt: skip
    assert status == 0, err
    results = read_results(tmp_path / "o")
    data = load_dataset(token_file, 0.2, 0)
    model = hf_models.gpt2().double().eval()
    model.load_state_dict(torch.load(tmp_path / "o" / "model.pt"))
    reference = dense_ggn(
        model, nn.CrossEntropyLoss(), data.test_inputs, data.test_targets,
        output=token_logits,
    )  # fmt: skip
    exact = results["results"]["methods"]["exact"]["eigenvalues"]
    assert len(exact) == len(data.test_targets) * VOCAB * T
    assert_top_eigvals(
        torch.tensor(exact, dtype=torch.float64).flip(0),  # stored descending
        torch.linalg.eigvalsh(reference),
        EIGVAL_RTOL[torch.float64],
    )
    ids, real = data.test_inputs["input_ids"], data.test_inputs["attention_mask"] == 1
    counted = real[:, :-1] & real[:, 1:]  # both the token and the next are real
    assert counted.any() and not counted.all()
    assert torch.equal(data.test_targets[:, :-1][counted], ids[:, 1:][counted])
    assert (data.test_targets[:, :-1][~counted] == IGNORE_INDEX).all()
    assert (data.test_targets[:, -1] == IGNORE_INDEX).all()
    described = results["model"]
    names = [layer["name"] for layer in described["layers"]]
    assert "transformer.wte (Embedding)" in names
    assert not any(name.startswith("lm_head") for name in names)
    assert sum(layer["num_parameters"] for layer in described["layers"]) == sum(
        p.numel() for p in model.parameters()
    )


@pytest.mark.parametrize("study", ["noise", "newton", "monitor", "approximations"])
def test_studies_run_bert_on_keyword_token_inputs(
    run, tmp_path, classified_tokens, study
):
    status, _, err = run(
        study, tmp_path / "o", "--model", f"{FACTORIES}:bert", "--output-field",
        "logits", "--data", str(classified_tokens), "--batch-size", "4",
    )  # fmt: skip
    assert status == 0, err
    assert read_results(tmp_path / "o")["data"]["input_shape"] == {
        "input_ids": [T], "attention_mask": [T],
    }  # fmt: skip


def test_hierarchy_of_a_vit_on_pixel_values(run, tmp_path, images):
    status, _, err = run(
        "hierarchy", tmp_path / "o", "--model", f"{FACTORIES}:vit",
        "--output-field", "logits", "--data", str(images), "--batch-size", "4",
    )  # fmt: skip
    assert status == 0, err


GPT2 = ["--model", f"{FACTORIES}:gpt2"]


@pytest.mark.parametrize(
    "study, options, message",
    [
        ("spectrum", GPT2, "returns CausalLMOutput.*--output-field"),
        ("spectrum", [*GPT2, "--output-field", "scores"], "scores"),
        ("spectrum", ["--model", "cnn"], "one input tensor.*input_ids"),
        ("hierarchy", [*GPT2, "--output-field", "logits"],
         r"one label per sample, but the targets have shape \[16, 5\]"),
    ],
)  # fmt: skip
def test_what_a_study_cannot_do_is_refused(
    run, tmp_path, token_file, study, options, message
):
    status, _, err = run(study, tmp_path / "o", "--data", str(token_file), *options)
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_a_built_in_model_refuses_an_output_field(run, tmp_path):
    status, _, err = run("spectrum", tmp_path / "o", "--output-field", "logits")
    assert status == 2 and "drop --output-field" in err


def test_keyword_inputs_without_targets_need_input_ids(run, tmp_path):
    path = tmp_path / "pixels.npz"
    np.savez(path, pixel_values=np.zeros((8, 1, 4, 4), dtype=np.float32))
    status, _, err = run(
        "spectrum", tmp_path / "o", "--model", f"{FACTORIES}:vit",
        "--output-field", "logits", "--data", str(path),
    )  # fmt: skip
    assert status == 2 and "has no 'targets'" in err and "'input_ids'" in err


def test_accuracy_leaves_ignored_targets_out():
    """Two positions predict class 0 and 1; the second target is ignored."""
    logits = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]]])  # [1, C=3, T=2]
    assert accuracy(logits, torch.tensor([[0, IGNORE_INDEX]])) == 1.0
    assert accuracy(logits, torch.tensor([[1, IGNORE_INDEX]])) == 0.0
    assert accuracy(logits, torch.tensor([[0, 0]])) == 0.5


def test_evaluating_only_ignored_targets_is_refused():
    """All targets ``-100``: nothing to evaluate, said, not divided by zero."""
    model = nn.Linear(3, 2)
    targets = torch.full((4,), IGNORE_INDEX)
    with pytest.raises(StudyError, match="Every one of the 4 targets"):
        evaluate(model, nn.CrossEntropyLoss(), torch.randn(4, 3), targets)
