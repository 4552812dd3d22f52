"""The monitor's Lightning and Hugging Face Trainer adapters.

Without the package an adapter raises MissingPackageError naming it. With it
(both are in the test extra; torchvision, which both import and which does not
load beside the CPU build of torch that CI pins, is hidden first) the callback
records at the trainer's optimizer steps and leaves training as it was. A
missing package fails its tests in CI (tests/fixtures/optional_packages.py).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tests.fixtures.optional_packages import BROKEN, installed, run_beside
from tests.fixtures.problems import mlp
from vivit import InvalidArgumentError, MissingPackageError
from vivit.analysis import CurvatureMonitor, huggingface_callback, lightning_callback


def _monitor(**kwargs):
    model = mlp(4, 5, 3)
    return CurvatureMonitor(model, nn.CrossEntropyLoss(), top_k=2, **kwargs)


@pytest.mark.parametrize(
    "adapter, module, package",
    [
        (lightning_callback, "lightning.pytorch", "lightning"),
        (huggingface_callback, "transformers", "transformers"),
    ],
)
def test_missing_package_is_named(monkeypatch, adapter, module, package):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingPackageError, match=f"pip install {package}"):
        adapter(_monitor())


def test_huggingface_needs_a_fixed_batch():
    installed("transformers")
    with pytest.raises(InvalidArgumentError, match="fixed monitoring batch"):
        huggingface_callback(_monitor())


def _lightning_fit(callbacks, accumulate, root):
    pl = installed("lightning.pytorch")

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.2), nn.Linear(5, 3))
            self.loss_func = nn.CrossEntropyLoss()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, index):
            return self.loss_func(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)  # the weights and the dropout masks: the same in both fits
    module = Classifier()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    monitor = CurvatureMonitor(module, module.loss_func, every=2, top_k=2)
    trainer = pl.Trainer(
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        callbacks=[lightning_callback(monitor)] if callbacks else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=root,
    )
    trainer.fit(module, loader)
    return module, monitor


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback(accumulate, tmp_path):
    """The fits seed torch's global generator: restored for the tests after."""
    with torch.random.fork_rng(devices=[]):
        plain, _ = _lightning_fit(False, accumulate, tmp_path / "plain")
        monitored, monitor = _lightning_fit(True, accumulate, tmp_path / "monitored")
    steps = 6 // accumulate
    assert [r["step"] for r in monitor.records] == list(range(2, steps + 1, 2))
    for a, b in zip(plain.parameters(), monitored.parameters(), strict=True):
        assert torch.equal(a, b)


def test_huggingface_callback_steps_at_global_steps():
    """Called as the Trainer calls it: on_step_end with its state, then the end."""
    transformers = installed("transformers")
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    monitor = _monitor(batch=batch, every=2)
    callback = huggingface_callback(monitor)
    assert isinstance(callback, transformers.TrainerCallback)
    args, control = object(), transformers.TrainerControl()
    for step in range(1, 6):
        state = transformers.TrainerState(global_step=step)
        callback.on_step_end(args, state, control, model=monitor.model)
    callback.on_train_end(args, state, control)
    assert [r["step"] for r in monitor.records] == [2, 4]
    assert all(r["batch"] == "fixed" for r in monitor.records)


def test_adapters_hide_a_torchvision_that_cannot_load(tmp_path):
    """Built in a fresh interpreter whose torchvision fails as PyPI's wheel does."""
    installed("lightning.pytorch")
    installed("transformers")
    run_beside(
        tmp_path,
        BROKEN,
        """
        import sys
        import torch
        from torch import nn
        from vivit.analysis import (
            CurvatureMonitor, huggingface_callback, lightning_callback
        )

        model = nn.Sequential(nn.Linear(4, 3))
        batch = torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)
        monitor = CurvatureMonitor(model, nn.CrossEntropyLoss(), batch=batch)
        lightning_callback(monitor)
        huggingface_callback(monitor)
        assert sys.modules["torchvision"] is None
        """,
    )
