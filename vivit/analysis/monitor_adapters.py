"""A CurvatureMonitor as a PyTorch Lightning or Hugging Face Trainer callback.

Both packages are optional, imported when an adapter is built, a broken
torchvision hidden first (:func:`~vivit.huggingface.hide_broken_torchvision`).
"""

from __future__ import annotations

from typing import Any

from vivit.analysis.monitor import CurvatureMonitor
from vivit.errors import InvalidArgumentError
from vivit.optional_packages import hide_broken_torchvision, import_optional


def lightning_callback(monitor: CurvatureMonitor) -> Any:
    """A Lightning ``Callback`` that steps ``monitor`` after each optimizer step.

    At the trainer's ``global_step`` (once per accumulated step), with the
    training batch unless the monitor has a fixed one; closes the monitor when
    training ends.

    Args:
        monitor: The monitor; its ``model`` is the network whose output
            ``loss_func`` takes (the ``LightningModule`` if its ``forward``
            returns it).

    Returns:
        A ``lightning.pytorch.Callback`` for ``Trainer(callbacks=[...])``.

    Raises:
        MissingPackageError: If ``lightning`` cannot be imported.
    """
    hide_broken_torchvision()
    pl = import_optional("lightning.pytorch", "lightning", "The Lightning adapter")

    class CurvatureMonitorCallback(pl.Callback):
        """Steps a :class:`~vivit.analysis.CurvatureMonitor` during ``fit``."""

        def __init__(self) -> None:
            self.monitor, self._last = monitor, None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._last = trainer.global_step

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, index: int
        ) -> None:
            if trainer.global_step == self._last:  # accumulating: no step yet
                return
            self._last = trainer.global_step
            data = None if monitor.uses_fixed_batch else tuple(batch)
            monitor.step(data, index=trainer.global_step)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            monitor.close()

    return CurvatureMonitorCallback()


def huggingface_callback(monitor: CurvatureMonitor) -> Any:
    """A Hugging Face ``TrainerCallback`` that steps ``monitor`` after each step.

    At the trainer state's ``global_step``; closes the monitor when training ends.

    Args:
        monitor: A monitor with a fixed monitoring batch (the ``Trainer`` hands
            no batches to callbacks).

    Returns:
        A ``transformers.TrainerCallback`` for ``Trainer(callbacks=[...])``.

    Raises:
        MissingPackageError: If ``transformers`` cannot be imported.
        InvalidArgumentError: If the monitor follows the current batch.
    """
    hide_broken_torchvision()
    transformers = import_optional(
        "transformers", "transformers", "The Hugging Face Trainer adapter"
    )
    if not monitor.uses_fixed_batch:
        raise InvalidArgumentError(
            "The Hugging Face Trainer does not hand its batches to callbacks: build "
            "the CurvatureMonitor with a fixed monitoring batch (batch=...)."
        )

    class CurvatureMonitorCallback(transformers.TrainerCallback):
        """Steps a :class:`~vivit.analysis.CurvatureMonitor` during training."""

        def __init__(self) -> None:
            self.monitor = monitor

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            monitor.step(index=state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            monitor.close()

    return CurvatureMonitorCallback()
