"""One monitoring record from a LowRankGGN; where records go, and reading them back.

Fields: :data:`FIELDS`, defined in ``docs/math.rst``, "Curvature during training".
Each monitor (its :class:`RecordWriter`) has its own run id, in its records, so
the runs that appended to one file are told apart (:func:`runs`,
:func:`read_records`).
"""

from __future__ import annotations

import json
import math
import secrets
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

from vivit.analysis.approximations import cosine, flat
from vivit.directional.gram_space import Damping
from vivit.errors import InvalidArgumentError, MissingPackageWarning
from vivit.lowrank import LowRankGGN

#: Every field of a record: its JSON type and what it holds. Lists run over the
#: directions by descending eigenvalue; ``null`` in them (and for the scalars
#: marked so) stands for a value JSON cannot hold or that does not exist.
FIELDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "run": (
        (str, type(None)),
        "id of the monitor that wrote the record, one per CurvatureMonitor "
        "(null: written before records had run ids)",
    ),
    "step": (int, "index of the training step (the monitor's count or the caller's)"),
    "time": (float, "wall-clock time of the record, seconds since the epoch"),
    "overhead_s": (float, "seconds spent computing this record (writing excluded)"),
    "batch": (str, '"current" (the batch passed to step) or "fixed"'),
    "loss": (float, "the loss on the monitored batch at the current parameters"),
    "eigenvalues": (list, "the top-k GGN eigenvalues, descending"),
    "gradient_norm": (float, "‖∇L‖ on the monitored batch"),
    "gradient_share": (
        (float, type(None)),
        "‖P_k ∇L‖²/‖∇L‖², the gradient's share in the top-k span (null: ∇L = 0)",
    ),
    "gamma_snr": (list, "SNR mean²/variance of γ_·k (null: infinite, variance 0)"),
    "lambda_snr": (list, "SNR mean²/variance of λ_·k (null: infinite, variance 0)"),
    "dampings": (list, "δ_k of the Newton step (null: direction skipped)"),
    "newton_angle_deg": (
        (float, type(None)),
        "angle between the damped Newton step and −∇L in degrees, in [0, 90] "
        "(null: the step or the gradient is zero)",
    ),
}


#: What :func:`read_records` selects by default: the run started last.
LAST = "last"
#: What selects every run of a file, in the file's order.
ALL = "all"


def new_run_id() -> str:
    """A fresh run id: the UTC start time and 48 random bits, ``20250101T120000Z-…``.

    The bits come from :mod:`secrets` (the operating system's source): torch's and
    Python's global random generators are left as they were.
    """
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{started}-{secrets.token_hex(6)}"


def _finite_or_none(values: Tensor) -> list[float | None]:
    """Floats, with the infinities JSON cannot hold as ``None``."""
    return [v if math.isfinite(v) else None for v in values.tolist()]


def newton_angle_deg(step: Tensor, gradient: Tensor) -> float | None:
    """Angle in degrees between a flattened step and ``−∇L`` (``None`` if one is 0)."""
    step_cosine = cosine(step, gradient)
    if step_cosine is None:
        return None
    return math.degrees(math.acos(min(1.0, max(-1.0, -step_cosine))))


def curvature_record(
    ggn: LowRankGGN, top_k: int, damping: float | Damping
) -> dict[str, object]:
    """The fields of :data:`FIELDS` but step, time, overhead and batch."""
    newton = ggn.newton(top_k, damping=damping)
    directional = newton.directional
    order = directional.evals.argsort(descending=True)
    gradient = flat(ggn.gradient())
    norm2 = float(gradient @ gradient)
    in_span = float(directional.gamma_bar.to(torch.float64).pow(2).sum())
    return {
        "loss": float(ggn.loss),
        "eigenvalues": directional.evals[order].tolist(),
        "gradient_norm": math.sqrt(norm2),
        "gradient_share": in_span / norm2 if norm2 > 0 else None,
        "gamma_snr": _finite_or_none(directional.gamma_snr[order]),
        "lambda_snr": _finite_or_none(directional.lambda_snr[order]),
        "dampings": _finite_or_none(newton.dampings[order]),
        "newton_angle_deg": newton_angle_deg(flat(newton.step), gradient),
    }


def check_record(record: object, where: str) -> dict[str, object]:
    """``record`` (parsed JSON from ``where``) if it has :data:`FIELDS`; else raise.

    A record without ``run`` (written before run ids) gets ``run: None``.
    """
    if not isinstance(record, dict):
        raise InvalidArgumentError(
            f"{where} is not a monitoring record (a JSON object), got "
            f"{type(record).__name__}."
        )
    record.setdefault("run", None)
    missing = sorted(set(FIELDS) - set(record))
    if missing:
        raise InvalidArgumentError(
            f"{where} lacks the field(s) {missing} of a monitoring record: is it a "
            "file CurvatureMonitor wrote?"
        )
    for name, (kind, _) in FIELDS.items():
        value = record[name]
        allowed = kind if isinstance(kind, tuple) else (kind,)
        numeric = float in allowed and isinstance(value, int)
        if not (isinstance(value, allowed) or numeric) or isinstance(value, bool):
            raise InvalidArgumentError(
                f"{where}: field {name!r} must be "
                f"{' or '.join(k.__name__ for k in allowed)}, got {value!r}."
            )
    return record


def _all_records(path: str | Path) -> list[dict[str, object]]:
    """Every record of a monitor's JSON lines file, each checked, in its order."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"No monitoring records at {path}: not a file.")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            parsed = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidArgumentError(f"{where} is not JSON: {error}.") from None
        records.append(check_record(parsed, where))
    return records


def _run_ids(records: list[dict[str, object]]) -> list[str | None]:
    """The records' run ids, in the order of their first records."""
    return list(dict.fromkeys(record["run"] for record in records))


def runs(path: str | Path) -> list[str | None]:
    """The runs that wrote a monitor's JSON lines file, in the order they began.

    Args:
        path: The file :class:`~vivit.analysis.CurvatureMonitor` wrote.

    Returns:
        The run ids, ordered by the line of each run's first record; ``None`` stands
        for the records written before records had run ids (one run, or several
        that cannot be told apart).

    Raises:
        InvalidArgumentError: As :func:`read_records`.
    """
    return _run_ids(_all_records(path))


def read_records(path: str | Path, run: str | None = LAST) -> list[dict[str, object]]:
    """The records of one run (by default the last) of a monitor's JSON lines file.

    A monitor appends to its file, so a rerun (or a resumed training, whose new
    monitor is a new run) adds a run to the file; every record carries its run's
    id in ``run`` (:func:`runs` lists them). The default reads the run started
    last, the records a rerun just wrote; ``run="all"`` reads every run.

    Args:
        path: The file :class:`~vivit.analysis.CurvatureMonitor` wrote.
        run: ``"last"``: the run whose first record comes last; ``"all"``: every
            record; a run id from :func:`runs`: that run's; ``None``: the records
            written before records had run ids.

    Returns:
        One dict per non-empty line of the run(s), in the file's order; a record
        without an id has ``run: None``.

    Raises:
        InvalidArgumentError: If the file does not exist, a line is not JSON or
            not a record (naming the line), or the file holds no run ``run``.
    """
    if run is not None and not isinstance(run, str):
        raise InvalidArgumentError(
            f"run must be 'last', 'all', a run id (a string) or None, got {run!r}."
        )
    records = _all_records(path)
    ids = _run_ids(records)
    if run == ALL:
        return records
    if run == LAST:
        if not ids:
            return []
        run = ids[-1]
    elif run not in ids:
        raise InvalidArgumentError(
            f"{path} holds no records of run {run!r}; its runs are {ids} (None: "
            "records without a run id). Pass one of them, 'last' or 'all'."
        )
    return [record for record in records if record["run"] == run]


class RecordWriter:
    """Appends records to a JSON lines file and writes their numbers to TensorBoard.

    ``path`` (``None``: none) is created with its folders, or appended to (a rerun
    or a resumed training adds its run to the file); ``tensorboard`` is a log
    directory (``None``: none).

    Attributes:
        run: This writer's run id (:func:`new_run_id`), for its records' ``run``.
    """

    def __init__(self, path: str | Path | None, tensorboard: str | Path | None):
        self.run = new_run_id()
        self._file = self._summary = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a")  # noqa: SIM115 (closed by close)
        if tensorboard is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            warnings.warn(
                f"TensorBoard logging to {tensorboard} was asked for, but "
                f"torch.utils.tensorboard cannot be imported ({error}): the records "
                "go to the JSON lines file only. Install it with `pip install "
                "tensorboard`.",
                MissingPackageWarning,
                stacklevel=3,
            )
            return
        self._summary = SummaryWriter(log_dir=str(tensorboard))

    def write(self, record: dict[str, object]) -> None:
        """Append a record as strict JSON; its numbers to ``monitor/<field>[/<k>]``."""
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        if self._summary is None:
            return
        for name, value in record.items():
            tagged = {f"monitor/{name}": value} if name not in ("step", "time") else {}
            if isinstance(value, list):
                tagged = {f"monitor/{name}/{k}": v for k, v in enumerate(value, 1)}
            for tag, number in tagged.items():
                if isinstance(number, int | float):
                    self._summary.add_scalar(
                        tag, number, record["step"], record["time"]
                    )
        self._summary.flush()

    def close(self) -> None:
        """Close the file and TensorBoard's writer; later records go nowhere."""
        for writer in (self._file, self._summary):
            if writer is not None:
                writer.close()
        self._file = self._summary = None
