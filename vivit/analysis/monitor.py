"""The GGN's curvature every ``k`` training steps, also as Lightning or HF callbacks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_damping, check_model, check_positive_int
from vivit.analysis.monitor_record import RecordWriter, curvature_record
from vivit.directional.gram_space import Damping
from vivit.errors import InvalidArgumentError
from vivit.linalg.iterative import check_seed
from vivit.lowrank import LowRankGGN
from vivit.model_inputs import map_inputs
from vivit.optional_packages import hide_broken_torchvision, import_optional
from vivit.options import CurvatureOptions, check_option_names

Batch = tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]]


class CurvatureMonitor:
    """Records the GGN's curvature every ``every`` training steps.

    Call :meth:`step` after each ``optimizer.step()``; every ``every``-th call
    records :data:`vivit.analysis.monitor_record.FIELDS` in evaluation mode, leaving
    ``.grad``, training flags, torch's global generators and hooks as they were.

    Args:
        model: The network being trained.
        loss_func: Its loss module.
        every: Steps between two records.
        top_k: Number of leading eigendirections recorded.
        path: JSON lines file the records are appended to (``None``: none).
        batch: A fixed monitoring batch or loader (``None``: each :meth:`step`'s).
        damping: ``δ ≥ 0`` or a rule, of the Newton step whose angle is recorded.
        params: The parameters monitored (``None``: every trainable one).
        seed: Seed of the Monte-Carlo generator (unless ``options`` name one).
        tensorboard: TensorBoard log directory (``None``: none); warns if missing.
        **options: Options of :class:`~vivit.options.CurvatureOptions`.

    Attributes:
        records: Every record taken, in order.
        run: This monitor's run id, in each record (``read_records(path, run=...)``).
        uses_fixed_batch: Whether a fixed monitoring batch was given.

    Raises:
        InvalidArgumentError: For a malformed argument or an unknown option.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        *,
        every: int = 10,
        top_k: int = 10,
        path: str | Path | None = None,
        batch: Batch | None = None,
        damping: float | Damping = 1.0,
        params: Sequence[Parameter] | None = None,
        seed: int = 0,
        tensorboard: str | Path | None = None,
        **options: object,
    ):
        check_model(model)
        check_positive_int(every, "every", "steps between two records")
        check_positive_int(top_k, "top_k", "leading directions recorded")
        check_damping(damping)
        check_seed(seed)
        check_option_names(options, " or of CurvatureMonitor")
        checked = CurvatureOptions(**options)
        if checked.mc_samples > 0 and checked.generator is None:
            checked = checked.replace(generator=torch.Generator().manual_seed(seed))
        self.model, self.loss_func, self.options = model, loss_func, checked
        self.every, self.top_k, self.damping = every, top_k, damping
        self._groups = None if params is None else [list(params)]
        self._batch, self.uses_fixed_batch = _kept_copy(batch), batch is not None
        self.records: list[dict[str, object]] = []
        self._steps = 0
        self._writer = RecordWriter(path, tensorboard)
        self.run = self._writer.run

    def step(
        self, batch: Batch | None = None, *, index: int | None = None
    ) -> dict[str, object] | None:
        """Count a training step; record the curvature if it is a monitored one.

        Args:
            batch: The batch the step trained on (``None`` with a fixed one).
            index: The step's index (``None``: the calls so far, this one included).

        Returns:
            The record if this step was monitored, else ``None``.

        Raises:
            InvalidArgumentError: For a missing or superfluous batch, or an index < 0.
        """
        if index is None:
            index = self._steps + 1
        elif isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgumentError(
                f"index must be an integer >= 0 (the step's index), got {index!r}."
            )
        self._steps = index
        if index % self.every:
            self._monitored_batch(batch)  # a wrong call fails at every step
            return None
        return self.record(batch, index=index)

    __call__ = step

    def record(
        self, batch: Batch | None = None, *, index: int | None = None
    ) -> dict[str, object]:
        """Record the curvature now, whatever the step (e.g. before training).

        Args:
            batch: As for :meth:`step`.
            index: The step index recorded (``None``: the steps counted so far).

        Raises:
            InvalidArgumentError: For a missing or superfluous batch.
        """
        start = time.perf_counter()
        data = self._monitored_batch(batch)
        training = {module: module.training for module in self.model.modules()}
        self.model.eval()
        try:
            ggn = LowRankGGN.from_options(
                self.model, self.loss_func, data, self._groups, self.options
            )
            curvature = curvature_record(ggn, self.top_k, self.damping)
        finally:
            for module, flag in training.items():
                module.training = flag
        record = {
            "step": self._steps if index is None else index,
            "time": time.time(),
            "overhead_s": time.perf_counter() - start,
            "batch": "fixed" if self.uses_fixed_batch else "current",
            "run": self.run,
            **curvature,
        }
        self.records.append(record)
        self._writer.write(record)
        return record

    def _monitored_batch(self, batch: Batch | None) -> Batch:
        """The batch to monitor: the fixed one, or the one passed."""
        if self.uses_fixed_batch and batch is not None:
            raise InvalidArgumentError(
                "This monitor has a fixed monitoring batch (batch= at construction): "
                "call step() without a batch, or build it with batch=None to "
                "monitor the batch of each step."
            )
        if not self.uses_fixed_batch and batch is None:
            raise InvalidArgumentError(
                "This monitor follows the current batch: pass the batch the step "
                "trained on, step((inputs, targets)), or give a fixed monitoring "
                "batch at construction (batch=...)."
            )
        return self._batch if self.uses_fixed_batch else batch

    def close(self) -> None:
        """Close the JSON lines file and TensorBoard's writer."""
        self._writer.close()

    def __enter__(self) -> CurvatureMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kept_copy(batch: object) -> object:
    """A fixed mini-batch's tensors cloned (buffers may be reused); else ``batch``."""
    if isinstance(batch, tuple | list) and len(batch) == 2:
        inputs, targets = batch
        if isinstance(targets, Tensor):
            with contextlib.suppress(TypeError):  # inputs that are not tensors
                return map_inputs(inputs, Tensor.clone), targets.clone()
    return batch


def lightning_callback(monitor: CurvatureMonitor) -> Any:
    """A Lightning ``Callback``: steps ``monitor`` at each new ``global_step``.

    With the training batch unless the monitor has a fixed one; closes it at the end.

    Args:
        monitor: The monitor; its ``model`` is the network whose output
            ``loss_func`` takes (the ``LightningModule`` if ``forward`` returns it).

    Returns:
        A ``lightning.pytorch.Callback`` for ``Trainer(callbacks=[...])``.

    Raises:
        MissingPackageError: If ``lightning`` cannot be imported.
    """
    hide_broken_torchvision()
    pl = import_optional("lightning.pytorch", "lightning", "The Lightning adapter")

    class CurvatureMonitorCallback(pl.Callback):
        """Steps the monitor after each optimizer step (not while accumulating)."""

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
    """A Hugging Face ``TrainerCallback``: steps ``monitor`` at each ``global_step``.

    Args:
        monitor: A monitor with a fixed batch (the ``Trainer`` gives callbacks none).

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
        """Steps the monitor after every optimizer step."""

        def __init__(self) -> None:
            self.monitor = monitor

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            monitor.step(index=state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            monitor.close()

    return CurvatureMonitorCallback()
