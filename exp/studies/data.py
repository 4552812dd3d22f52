"""Data for the studies: the bundled digits, user files, splits and batches.

Inputs are one tensor ``[N, *shape]`` or, for models called with keyword
arguments (Hugging Face models), a dict of tensors with the samples along their
first axis (``input_ids``, ``attention_mask``, ``pixel_values``; see
:mod:`vivit.model_inputs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from studies.errors import StudyError
from vivit.huggingface import IGNORE_INDEX, causal_lm_targets
from vivit.model_inputs import ModelInputs, map_inputs, take_samples

DIGITS = "scikit-learn digits (8x8, 10 classes)"


@dataclass(frozen=True)
class Dataset:
    """A classification data set split into training and test samples.

    Attributes:
        train_inputs: ``[N_train, *shape]`` inputs (floating point, or int64
            tokens), or a dict of such tensors, the model's keyword arguments.
        train_targets: ``[N_train]`` or ``[N_train, *T]`` class indices (int64;
            :data:`~vivit.huggingface.IGNORE_INDEX` marks a position the loss
            skips).
        test_inputs: The held-out inputs, as ``train_inputs``.
        test_targets: Their class indices.
        num_classes: Number of classes ``C`` (largest label + 1).
        source: Where the data came from, for the report.
    """

    train_inputs: ModelInputs
    train_targets: Tensor
    test_inputs: ModelInputs
    test_targets: Tensor
    num_classes: int
    source: str

    @property
    def keyword_inputs(self) -> bool:
        """Whether the inputs are a dict, passed as ``model(**inputs)``."""
        return isinstance(self.train_inputs, Mapping)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample (of one input tensor).

        Raises:
            StudyError: For a dict of inputs, which have no single shape.
        """
        if self.keyword_inputs:
            raise StudyError(
                f"The built-in models take one input tensor, but the data hold the "
                f"model's keyword inputs {list(self.train_inputs)}: pass your model "
                "with --model MODULE:FACTORY (and --output-field for a Hugging Face "
                "model)."
            )
        return tuple(self.train_inputs.shape[1:])

    def train_batch(self, index: Tensor | slice) -> tuple[ModelInputs, Tensor]:
        """Some training samples.

        Args:
            index: Indices (or a slice) into the training set.

        Returns:
            Their inputs and targets.
        """
        return take_samples(self.train_inputs, index), self.train_targets[index]

    def test_batches(self, batch_size: int) -> list[tuple[ModelInputs, Tensor]]:
        """The held-out samples in order, in batches (the last may be smaller).

        Args:
            batch_size: Samples per batch.

        Returns:
            ``(inputs, targets)`` of every batch.
        """
        return [
            (
                take_samples(self.test_inputs, slice(start, start + batch_size)),
                self.test_targets[start : start + batch_size],
            )
            for start in range(0, len(self.test_targets), batch_size)
        ]

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
            train_inputs=map_inputs(self.train_inputs, move),
            train_targets=self.train_targets.to(device),
            test_inputs=map_inputs(self.test_inputs, move),
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
        if self.keyword_inputs:
            shape = {
                key: list(value.shape[1:]) for key, value in self.train_inputs.items()
            }
        else:
            shape = list(self.input_shape)
        return {
            "source": self.source,
            "num_train": len(self.train_targets),
            "num_test": len(self.test_targets),
            "input_shape": shape,
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


def read_data_file(path: Path) -> tuple[ModelInputs, Tensor | None]:
    """Read the inputs and targets of a ``.pt`` or ``.npz`` file.

    The inputs are the array ``inputs``, or, without it, every array other than
    ``targets``: the model's keyword inputs (``input_ids``, ``attention_mask``,
    ``pixel_values``, ...). ``targets`` may be absent only for such inputs.

    Args:
        path: The file.

    Returns:
        Inputs (a tensor or a dict of tensors) and targets (``None`` if absent),
        unchecked.

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
    keyword = isinstance(content, dict) and "inputs" not in content
    names = set(content) - {"targets"} if isinstance(content, dict) else set()
    if not names or not (keyword or "targets" in content):
        found = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise StudyError(
            f"--data {path} must hold 'inputs' and 'targets', or the model's keyword "
            "inputs (e.g. 'input_ids' and 'attention_mask') with optional 'targets' "
            f"(found: {found})."
        )
    try:
        arrays = {key: torch.as_tensor(value) for key, value in content.items()}
    except (TypeError, ValueError, RuntimeError) as error:
        raise StudyError(
            f"--data {path}: every entry must be an array: {error}"
        ) from None
    targets = arrays.pop("targets", None)
    return (arrays if keyword else arrays["inputs"]), targets


def next_token_targets(inputs: ModelInputs, source: str) -> Tensor:
    """The targets of a causal language model: each position's next token.

    Args:
        inputs: Keyword inputs with ``input_ids`` (and ``attention_mask``).
        source: Name of the data for the messages.

    Returns:
        :func:`vivit.huggingface.causal_lm_targets` of the inputs: padding and
        the last position are :data:`~vivit.huggingface.IGNORE_INDEX`.

    Raises:
        StudyError: If there are no token ids to predict.
    """
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        found = list(inputs) if isinstance(inputs, Mapping) else "inputs"
        raise StudyError(
            f"{source} has no 'targets' (found {found}): give 'inputs' and 'targets', "
            "or the model's keyword inputs with 'targets' (one class index per "
            "sample [N] or per position [N, T]), or with 'input_ids' and no "
            "'targets' (the next tokens are the targets, as for a causal language "
            "model)."
        )
    return causal_lm_targets(inputs["input_ids"], inputs.get("attention_mask"))


def _check_input_tensor(inputs: Tensor, name: str, source: str) -> Tensor:
    """One input tensor: at least two axes, finite numbers; float32 or int64."""
    if inputs.ndim < 2:
        raise StudyError(
            f"{source}: '{name}' must have shape [N, *sample_shape] with at least "
            f"two axes, got shape {list(inputs.shape)}."
        )
    if not (inputs.is_floating_point() or inputs.dtype in _INTEGER_DTYPES):
        raise StudyError(f"{source}: '{name}' must be numbers, got {inputs.dtype}.")
    if inputs.is_floating_point():
        inputs = inputs.to(torch.float32)
    else:
        inputs = inputs.to(torch.int64)
    if not inputs.isfinite().all():
        raise StudyError(f"{source}: '{name}' contain NaN or infinite values.")
    return inputs


def check_arrays(
    inputs: ModelInputs, targets: Tensor, source: str
) -> tuple[ModelInputs, Tensor]:
    """Check shapes, types and the label range of a classification data set.

    Args:
        inputs: ``[N, *shape]`` inputs, or a dict of them (keyword inputs).
        targets: ``[N]`` class indices, or ``[N, *T]`` one per position;
            :data:`~vivit.huggingface.IGNORE_INDEX` marks a skipped position.
        source: Name of the data for the messages.

    Returns:
        Inputs as float32 (integer inputs as int64 tokens) and targets as int64.

    Raises:
        StudyError: If the data cannot be used for classification.
    """
    if isinstance(inputs, Mapping):
        inputs = {
            key: _check_input_tensor(value, key, source)
            for key, value in inputs.items()
        }
        sizes = {key: value.shape[0] for key, value in inputs.items()}
        if len(set(sizes.values())) != 1:
            raise StudyError(
                f"{source}: the inputs differ in their number of samples (first "
                f"axis): {sizes}."
            )
        num_samples = next(iter(sizes.values()))
    else:
        inputs = _check_input_tensor(inputs, "inputs", source)
        num_samples = inputs.shape[0]
    if targets.ndim < 1 or targets.shape[0] != num_samples:
        raise StudyError(
            f"{source}: 'targets' must have shape [N] = [{num_samples}] (one class "
            f"index per input) or [N, *T] (one per position), got shape "
            f"{list(targets.shape)}."
        )
    if targets.dtype not in _INTEGER_DTYPES:
        raise StudyError(
            f"{source}: 'targets' must be integer class indices, got {targets.dtype}."
        )
    if num_samples < 4:
        raise StudyError(f"{source}: needs at least 4 samples, got {num_samples}.")
    targets = targets.to(torch.int64)
    counted = targets[targets != IGNORE_INDEX]
    if counted.numel() == 0:
        raise StudyError(
            f"{source}: every target is {IGNORE_INDEX} (ignored): nothing to learn."
        )
    low, high = int(counted.min()), int(counted.max())
    if low < 0:
        raise StudyError(
            f"{source}: labels must be class indices in [0, C) (or {IGNORE_INDEX} "
            f"for a position the loss skips), found {low}."
        )
    if high < 1:
        raise StudyError(f"{source}: needs at least two classes, all labels are 0.")
    return inputs, targets


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def split(
    inputs: ModelInputs,
    targets: Tensor,
    test_fraction: float,
    seed: int,
    source: str,
) -> Dataset:
    """Split into training and test samples with a seeded permutation.

    Args:
        inputs: ``[N, *shape]`` inputs, or a dict of them.
        targets: ``[N]`` or ``[N, *T]`` class indices.
        test_fraction: Fraction of samples held out.
        seed: Seed of the permutation.
        source: Name of the data.

    Returns:
        The data set.
    """
    num_samples = targets.shape[0]
    num_test = min(max(1, round(test_fraction * num_samples)), num_samples - 2)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    test, train = order[:num_test], order[num_test:]
    return Dataset(
        train_inputs=take_samples(inputs, train),
        train_targets=targets[train],
        test_inputs=take_samples(inputs, test),
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
        The data set (on the CPU, float32 or int64 inputs).
    """
    if path is None:
        inputs, targets = digits()
        source = DIGITS
    else:
        inputs, targets = read_data_file(path)
        source = str(path)
        if targets is None:
            targets = next_token_targets(inputs, f"--data {path}")
            source += " (targets: the next tokens)"
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
