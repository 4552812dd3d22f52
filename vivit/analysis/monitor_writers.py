"""Where a monitor's records go: a JSON lines file, TensorBoard."""

from __future__ import annotations

import warnings
from pathlib import Path

from vivit.analysis.monitor_record import to_json_line
from vivit.errors import MissingPackageWarning


class JsonLinesWriter:
    """Appends each record as one line of JSON to a file, flushed at once.

    Args:
        path: The file; created with its folders if missing, appended to if
            present (a resumed run continues it).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def write(self, record: dict[str, object]) -> None:
        """Append a record."""
        self._file.write(to_json_line(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def tensorboard_scalars(record: dict[str, object]) -> dict[str, float]:
    """The record's numbers by tag (``monitor/eigenvalues/1``, ...), ``None`` out."""
    scalars = {}
    for name, value in record.items():
        if isinstance(value, list):
            for k, entry in enumerate(value, start=1):
                if entry is not None:
                    scalars[f"monitor/{name}/{k}"] = entry
        elif isinstance(value, int | float) and name not in ("step", "time"):
            scalars[f"monitor/{name}"] = value
    return scalars


class TensorBoardWriter:
    """Writes each record's numbers as TensorBoard scalars at its step."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, object]) -> None:
        """Add the record's scalars."""
        for tag, value in tensorboard_scalars(record).items():
            self._writer.add_scalar(tag, value, record["step"], record["time"])
        self._writer.flush()

    def close(self) -> None:
        """Close the event file."""
        self._writer.close()


def tensorboard_writer(log_dir: str | Path) -> TensorBoardWriter | None:
    """A TensorBoard writer, or ``None`` with one warning if it cannot be imported."""
    try:
        return TensorBoardWriter(log_dir)
    except ImportError as error:
        warnings.warn(
            f"TensorBoard logging to {log_dir} was asked for, but "
            f"torch.utils.tensorboard cannot be imported ({error}): the records go "
            "to the JSON lines file only. Install it with `pip install tensorboard`.",
            MissingPackageWarning,
            stacklevel=3,
        )
        return None
