"""What every study does first: output, device, data, model, checks."""

from __future__ import annotations

import time
from argparse import Namespace
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from studies import models
from studies.cli import resolve_device, resolve_dtype
from studies.curvature import check_supported, loss_function
from studies.data import Dataset, load_dataset
from studies.report import check_output, config, default_output, versions


@dataclass
class Setup:
    """The checked ingredients of a study.

    Attributes:
        study: Name of the study.
        args: Parsed command-line options.
        output: Output directory (not yet created).
        device: Device of model and data.
        dtype: Floating-point type of model and data.
        data: The data set, on ``device``.
        model: The initial model (random or from ``--checkpoint``), on ``device``,
            not extended with BackPACK: copy it for each run.
        loss_func: Mean-reduced cross-entropy, extended with BackPACK.
        started: ``time.perf_counter()`` at the start.
    """

    study: str
    args: Namespace
    output: Path
    device: torch.device
    dtype: torch.dtype
    data: Dataset
    model: nn.Module
    loss_func: nn.Module
    started: float = field(default_factory=time.perf_counter)

    def seed(self, offset: int) -> int:
        """A seed derived from ``--seed``, one per random stream of the run.

        Args:
            offset: Distinguishes the streams (batches, MC samples, bootstrap).

        Returns:
            The seed.
        """
        return self.args.seed * 1000 + offset

    def generator(self, offset: int) -> torch.Generator:
        """A CPU random generator seeded with :meth:`seed`.

        Args:
            offset: Distinguishes the streams of one run.

        Returns:
            The generator.
        """
        return torch.Generator().manual_seed(self.seed(offset))

    def payload(self, results: dict, timings: dict) -> dict:
        """The common part of ``results.json`` around a study's results.

        Args:
            results: The study's numbers.
            timings: Wall-clock times in seconds.

        Returns:
            The document (figures and summary are added when it is written).
        """
        return {
            "study": self.study,
            "config": config(self.args),
            "seed": self.args.seed,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "versions": versions(),
            "data": self.data.describe(),
            "model": models.describe(self.model, self.args.model),
            "results": results,
            "timings": {
                **timings,
                "total_s": time.perf_counter() - self.started,
            },
        }


def prepare(args: Namespace, study: str) -> Setup:
    """Check every input of a study before the work starts.

    The output directory is checked first, then the device, data, model,
    checkpoint, and finally whether vivit can compute the model's curvature (on two
    samples), so that a bad input fails in seconds, not after training.

    Args:
        args: Parsed command-line options.
        study: Name of the study.

    Returns:
        The setup.
    """
    started = time.perf_counter()
    output = check_output(args.output or default_output(study), args.overwrite)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    torch.manual_seed(args.seed)
    data = load_dataset(args.data, args.test_fraction, args.seed)
    model = models.build_model(args.model, data)
    if (
        not data.keyword_inputs
        and not data.train_inputs.is_floating_point()
        and not models.takes_tokens(model)
    ):
        data = data.as_float()
    if args.checkpoint is not None:
        models.load_checkpoint(model, args.checkpoint, args.model)
    model = models.with_output_field(model, args.model, args.output_field)
    model = model.to(device, dtype)
    data = data.to(device, dtype)
    sample, _ = data.train_batch(slice(0, 2))
    num_outputs = models.check_model_fits(
        model, sample, data.num_classes, data.train_targets.shape[1:]
    )
    data = replace(data, num_classes=num_outputs)
    loss_func = loss_function()
    check_supported(
        model, loss_func, data.train_inputs, data.train_targets, args.engine
    )
    return Setup(
        study=study,
        args=args,
        output=output,
        device=device,
        dtype=dtype,
        data=data,
        model=model,
        loss_func=loss_func,
        started=started,
    )
