"""Results of a study: output directory, ``results.json``, figures, summary."""

from __future__ import annotations

import json
import math
import platform
import time
from argparse import Namespace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from studies.errors import StudyError

RESULTS_FILE = "results.json"

#: Distributions whose versions every ``results.json`` records.
_DISTRIBUTIONS = (
    "vivit",
    "torch",
    "backpack-for-pytorch",
    "numpy",
    "scipy",
    "scikit-learn",
    "matplotlib",
    "curvlinops-for-pytorch",
)


def number(value: float | None, digits: int = 3) -> str:
    """A number for the summaries, readable at any magnitude (``1.2e-05``, ``0.31``).

    Args:
        value: The number.
        digits: Significant digits.

    Returns:
        The number with ``digits`` significant digits, or ``n/a`` for ``None``,
        NaN and infinities.
    """
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.{digits}g}"


def wrapped_values(values: list[float], per_line: int = 10) -> list[str]:
    """Numbers as indented lines of at most ``per_line`` values.

    Args:
        values: The numbers.
        per_line: Values per line.

    Returns:
        The lines (none for no values).
    """
    return [
        "  " + ", ".join(number(v) for v in values[start : start + per_line])
        for start in range(0, len(values), per_line)
    ]


def model_summary(study: str, results: dict, args: Namespace) -> str:
    """The summary line of a trained or loaded model (``train_or_load``'s studies).

    Args:
        study: The study's title (``Spectrum``, ``Hierarchy``, ...).
        results: The study's results with ``training``, ``metrics`` and
            ``num_parameters``.
        args: Parsed command-line options (``--model``, ``--checkpoint``).

    Returns:
        The line: model, size, training state, train loss and test accuracy.
    """
    metrics, trained = results["metrics"], results["training"]
    state = (
        f"after {trained['steps']} SGD steps"
        if trained
        else ("from --checkpoint" if args.checkpoint else "at initialisation")
    )
    return (
        f"{study} study: model {args.model} ({results['num_parameters']:,} "
        f"parameters) {state}: train loss {number(metrics['train_loss'])}, test "
        f"accuracy {100 * metrics['test_accuracy']:.1f} %."
    )


def default_output(study: str) -> Path:
    """``runs/<study>-<timestamp>`` relative to the working directory.

    Args:
        study: Name of the study.

    Returns:
        The path.
    """
    return Path("runs") / f"{study}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_output(path: Path, overwrite: bool) -> Path:
    """Refuse an existing output directory unless overwriting is allowed.

    Nothing is created here: the directory is written when the study is done.

    Args:
        path: The output directory.
        overwrite: Whether an existing directory may be reused.

    Returns:
        The path.

    Raises:
        StudyError: If the path exists (and may not be overwritten) or is a file.
    """
    if path.exists() and not path.is_dir():
        raise StudyError(f"--output {path} exists and is not a directory.")
    if path.exists() and not overwrite:
        raise StudyError(
            f"The output directory {path} exists; pass another --output, or "
            "--overwrite to replace its results."
        )
    return path


def versions() -> dict[str, str]:
    """Versions of Python and the libraries that shape the results.

    Returns:
        Name to version (``"not installed"`` where missing).
    """
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for name in _DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def jsonable(value: Any) -> Any:
    """Convert results to JSON types; non-finite numbers become ``null``.

    Args:
        value: Nested dicts, lists, tuples, tensors, arrays, numbers, paths.

    Returns:
        The same structure with JSON-compatible leaves.
    """
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, torch.Tensor):
        return jsonable(value.detach().cpu().tolist())
    if isinstance(value, np.ndarray | np.generic):
        return jsonable(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bool | int | str) or value is None:
        return value
    return str(value)


def config(args: Namespace) -> dict:
    """The parsed command-line options.

    Args:
        args: The parsed arguments.

    Returns:
        Option name to value.
    """
    return jsonable(vars(args))


def write(
    output: Path,
    payload: dict,
    figures: dict[str, Any],
    summary: list[str],
    checkpoints: dict[str, dict] | None = None,
) -> None:
    """Create the output directory, write figures and ``results.json``, print.

    Args:
        output: The output directory.
        payload: Everything for ``results.json`` (figures, checkpoints and summary
            are added).
        figures: File name to matplotlib figure.
        summary: Lines of the human summary.
        checkpoints: File name to a ``state_dict`` to save with ``torch.save``.
    """
    from studies.plots import save

    checkpoints = checkpoints or {}
    output.mkdir(parents=True, exist_ok=True)
    for name, figure in figures.items():
        save(figure, output / name)
    for name, state in checkpoints.items():
        torch.save({k: v.detach().cpu() for k, v in state.items()}, output / name)
    payload = {
        **payload,
        "figures": sorted(figures),
        "checkpoints": sorted(checkpoints),
        "summary": summary,
    }
    text = json.dumps(jsonable(payload), indent=1, allow_nan=False)
    (output / RESULTS_FILE).write_text(text + "\n")
    print("\n".join(summary))
    print(f"Results: {output / RESULTS_FILE}")
    for name in sorted(figures):
        print(f"Figure:  {output / name}")
    for name in sorted(checkpoints):
        print(f"Model:   {output / name}")
