"""Data for the studies: the bundled digits, user files, splits and batches."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from studies.errors import StudyError

DIGITS = "scikit-learn digits (8x8, 10 classes)"


@dataclass(frozen=True)
class Dataset:
    """A classification data set split into training and test samples.

    Attributes:
        train_inputs: ``[N_train, *shape]`` inputs: floating point, or int64 tokens.
        train_targets: ``[N_train]`` or ``[N_train, *T]`` class indices (int64).
        test_inputs: ``[N_test, *shape]`` floating-point inputs.
        test_targets: ``[N_test]`` class indices (int64).
        num_classes: Number of classes ``C`` (largest label + 1).
        source: Where the data came from, for the report.
    """

    train_inputs: Tensor
    train_targets: Tensor
    test_inputs: Tensor
    test_targets: Tensor
    num_classes: int
    source: str

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample."""
        return tuple(self.train_inputs.shape[1:])

    def to(self, device: torch.device, dtype: torch.dtype) -> Dataset:
        """Move the data to a device and cast the inputs.

        Args:
            device: Target device.
            dtype: Floating-point type of floating inputs (tokens stay int64).

        Returns:
            The moved data set.
        """

        def move(inputs: Tensor) -> Tensor:
            if inputs.is_floating_point():
                return inputs.to(device, dtype)
            return inputs.to(device)

        return replace(
            self,
            train_inputs=move(self.train_inputs),
            train_targets=self.train_targets.to(device),
            test_inputs=move(self.test_inputs),
            test_targets=self.test_targets.to(device),
        )

    def as_float(self) -> Dataset:
        """Integer inputs as float32 (for models without an embedding).

        Returns:
            The data set with floating-point inputs.
        """
        return replace(
            self,
            train_inputs=self.train_inputs.to(torch.float32),
            test_inputs=self.test_inputs.to(torch.float32),
        )

    def describe(self) -> dict:
        """Facts about the data set for ``results.json``.

        Returns:
            Source, sizes, input shape and number of classes.
        """
        return {
            "source": self.source,
            "num_train": len(self.train_targets),
            "num_test": len(self.test_targets),
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
        }


def digits() -> tuple[Tensor, Tensor]:
    """scikit-learn's bundled handwritten digits (no download).

    Returns:
        Inputs ``[1797, 1, 8, 8]`` scaled to ``[0, 1]`` and targets ``[1797]``.

    Raises:
        StudyError: If scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise StudyError(
            "The default data are scikit-learn's digits, but scikit-learn is not "
            "installed: pip install scikit-learn (or pass --data FILE)."
        ) from None
    bunch = load_digits()
    inputs = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return inputs, torch.as_tensor(bunch.target, dtype=torch.int64)


def read_data_file(path: Path) -> tuple[Tensor, Tensor]:
    """Read ``inputs`` and ``targets`` from a ``.pt`` or ``.npz`` file.

    Args:
        path: The file.

    Returns:
        Inputs and targets as tensors, unchecked.

    Raises:
        StudyError: If the file is missing, unreadable or lacks the keys.
    """
    if not path.is_file():
        raise StudyError(f"--data {path}: no such file.")
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        try:
            content = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise StudyError(
                f"--data {path} cannot be read with torch.load: {error}"
            ) from None
        if isinstance(content, list | tuple) and len(content) == 2:
            content = {"inputs": content[0], "targets": content[1]}
    elif suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as archive:
                content = {key: archive[key] for key in archive.files}
        except Exception as error:
            raise StudyError(
                f"--data {path} cannot be read with numpy.load: {error}"
            ) from None
    else:
        raise StudyError(
            f"--data {path}: unknown file type {suffix!r}; use '.pt' (torch.save of "
            "{'inputs': ..., 'targets': ...}) or '.npz' (numpy.savez(FILE, "
            "inputs=..., targets=...))."
        )
    if not isinstance(content, dict) or not {"inputs", "targets"} <= set(content):
        found = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise StudyError(
            f"--data {path} must hold 'inputs' and 'targets' (found: {found})."
        )
    try:
        return torch.as_tensor(content["inputs"]), torch.as_tensor(content["targets"])
    except (TypeError, ValueError, RuntimeError) as error:
        raise StudyError(
            f"--data {path}: 'inputs' and 'targets' must be arrays: {error}"
        ) from None


def check_arrays(inputs: Tensor, targets: Tensor, source: str) -> tuple[Tensor, Tensor]:
    """Check shapes, types and the label range of a classification data set.

    Args:
        inputs: ``[N, *shape]`` inputs.
        targets: ``[N]`` class indices, or ``[N, *T]`` one per position.
        source: Name of the data for the messages.

    Returns:
        Inputs as float32 (integer inputs as int64 tokens) and targets as int64.

    Raises:
        StudyError: If the data cannot be used for classification.
    """
    if inputs.ndim < 2:
        raise StudyError(
            f"{source}: 'inputs' must have shape [N, *sample_shape] with at least "
            f"two axes, got shape {list(inputs.shape)}."
        )
    if not (inputs.is_floating_point() or inputs.dtype in _INTEGER_DTYPES):
        raise StudyError(f"{source}: 'inputs' must be numbers, got {inputs.dtype}.")
    if targets.ndim < 1 or targets.shape[0] != inputs.shape[0]:
        raise StudyError(
            f"{source}: 'targets' must have shape [N] = [{inputs.shape[0]}] (one class "
            f"index per input) or [N, *T] (one per position), got shape "
            f"{list(targets.shape)}."
        )
    if targets.dtype not in _INTEGER_DTYPES:
        raise StudyError(
            f"{source}: 'targets' must be integer class indices, got {targets.dtype}."
        )
    if inputs.shape[0] < 4:
        raise StudyError(f"{source}: needs at least 4 samples, got {inputs.shape[0]}.")
    if inputs.is_floating_point():
        inputs = inputs.to(torch.float32)
    else:
        inputs = inputs.to(torch.int64)
    if not inputs.isfinite().all():
        raise StudyError(f"{source}: 'inputs' contain NaN or infinite values.")
    targets = targets.to(torch.int64)
    low, high = int(targets.min()), int(targets.max())
    if low < 0:
        raise StudyError(
            f"{source}: labels must be class indices in [0, C), found {low}."
        )
    if high < 1:
        raise StudyError(f"{source}: needs at least two classes, all labels are 0.")
    return inputs, targets


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def split(
    inputs: Tensor, targets: Tensor, test_fraction: float, seed: int, source: str
) -> Dataset:
    """Split into training and test samples with a seeded permutation.

    Args:
        inputs: ``[N, *shape]`` inputs.
        targets: ``[N]`` class indices.
        test_fraction: Fraction of samples held out.
        seed: Seed of the permutation.
        source: Name of the data.

    Returns:
        The data set.
    """
    num_samples = inputs.shape[0]
    num_test = min(max(1, round(test_fraction * num_samples)), num_samples - 2)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    test, train = order[:num_test], order[num_test:]
    return Dataset(
        train_inputs=inputs[train],
        train_targets=targets[train],
        test_inputs=inputs[test],
        test_targets=targets[test],
        num_classes=int(targets.max()) + 1,
        source=source,
    )


def load_dataset(path: Path | None, test_fraction: float, seed: int) -> Dataset:
    """The default digits or a user's data file, checked and split.

    Args:
        path: Data file, or ``None`` for the digits.
        test_fraction: Fraction of samples held out for testing.
        seed: Seed of the split.

    Returns:
        The data set (on the CPU, float32 inputs).
    """
    if path is None:
        inputs, targets = digits()
        source = DIGITS
    else:
        inputs, targets = read_data_file(path)
        source = str(path)
    inputs, targets = check_arrays(
        inputs, targets, f"--data {path}" if path else source
    )
    return split(inputs, targets, test_fraction, seed, source)


class BatchStream:
    """Mini-batch indices: shuffled epochs, reproducible from a seed.

    Args:
        num_samples: Number of training samples.
        batch_size: Samples per batch (``<= num_samples``).
        seed: Seed of the shuffling.

    Raises:
        StudyError: If the batch is larger than the training set.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int):
        if batch_size > num_samples:
            raise StudyError(
                f"--batch-size {batch_size} exceeds the {num_samples} training "
                "samples; choose a smaller batch."
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self._generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.int64)

    def next(self) -> Tensor:
        """The next batch; a new epoch starts when too few samples remain.

        Returns:
            ``[batch_size]`` indices into the training set.
        """
        if len(self._order) < self.batch_size:
            self._order = torch.randperm(self.num_samples, generator=self._generator)
        batch, self._order = (
            self._order[: self.batch_size],
            self._order[self.batch_size :],
        )
        return batch

    def take(self, count: int) -> list[Tensor]:
        """The next ``count`` batches.

        Args:
            count: How many.

        Returns:
            A list of index tensors.
        """
        return [self.next() for _ in range(count)]
