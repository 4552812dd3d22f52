"""Monitor study: the GGN's curvature every k steps of SGD, and what it costs.

Trains the model with SGD and steps a :class:`vivit.analysis.CurvatureMonitor`
after every optimizer step. Every ``--every`` steps it records the top
eigenvalues, the gradient's share in their span, the SNRs of ``γ`` and ``λ`` per
direction and the angle between the damped Newton step and ``−∇L``, on the
current batch or a fixed monitoring batch (``--monitor-batch``), into
``records.jsonl``; the summary says what the monitor cost per step.
``--plot FILE`` only draws the records of a JSON lines file (of its last run).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from studies.cli import (
    add_sgd_options,
    base_parser,
    non_negative_float,
    positive_int,
    study_main,
)
from studies.context import prepare
from studies.curvature import engine_errors
from studies.data import BatchStream
from studies.errors import StudyError
from studies.plots import monitor_figure, save
from studies.report import number, write
from studies.training import evaluate_splits, gradient_step
from vivit import InvalidArgumentError
from vivit.analysis import CurvatureMonitor, read_records, runs

STUDY = "monitor"
RECORDS_FILE = "records.jsonl"


def build_parser() -> argparse.ArgumentParser:
    """The monitor study's command line.

    Returns:
        The parser.
    """
    parser = base_parser(STUDY, __doc__.split("\n\n", 1)[0])
    study = parser.add_argument_group("monitor study")
    study.add_argument("--steps", type=positive_int, default=300, help="SGD steps.")
    study.add_argument(
        "--every", type=positive_int, default=20, help="Steps between two records."
    )
    study.add_argument(
        "--top-k",
        type=positive_int,
        default=10,
        help="Leading eigendirections recorded.",
    )
    study.add_argument(
        "--monitor-batch",
        choices=("current", "fixed"),
        default="current",
        help="Curvature of the batch each step trained on, or of one fixed "
        "monitoring batch of --batch-size training samples.",
    )
    study.add_argument(
        "--damping",
        type=non_negative_float,
        default=1.0,
        help="Damping δ of the Newton step whose angle to -∇L is recorded.",
    )
    add_sgd_options(study)
    study.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help="Only draw the records of FILE (a monitor's JSON lines; its last "
        "run) into FILE with the suffix .png; nothing is trained.",
    )
    return parser


def run(args: argparse.Namespace) -> dict | None:
    """Run the monitor study, or only draw a file's records (``--plot``).

    Args:
        args: Parsed command-line options.

    Returns:
        The content of ``results.json`` (``None`` with ``--plot``).

    Raises:
        StudyError: For input the study cannot work with.
    """
    if args.plot is not None:
        plot(args.plot)
        return None
    setup = prepare(args, STUDY)
    if args.batch_size < 2:
        raise StudyError("--batch-size must be at least 2 to estimate SNRs.")
    data, loss_func = setup.data, setup.loss_func
    model = copy.deepcopy(setup.model)
    num_train = len(data.train_targets)
    batches = BatchStream(num_train, args.batch_size, setup.seed(1))
    fixed = None
    if args.monitor_batch == "fixed":
        index = BatchStream(num_train, args.batch_size, setup.seed(2)).next()
        fixed = data.train_batch(index)
    setup.output.mkdir(parents=True, exist_ok=True)
    (setup.output / RECORDS_FILE).unlink(missing_ok=True)  # --overwrite
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    monitor = CurvatureMonitor(
        model,
        loss_func,
        every=args.every,
        top_k=args.top_k,
        path=setup.output / RECORDS_FILE,
        batch=fixed,
        damping=args.damping,
        engine=args.engine,
    )
    training_time, losses = 0.0, []
    with monitor, engine_errors("Monitoring curvature"):
        for step in tqdm(range(args.steps), desc="SGD", disable=args.no_progress):
            index = batches.next()
            inputs, targets = data.train_batch(index)
            start = time.perf_counter()
            loss, _ = gradient_step(model, optimizer, loss_func, inputs, targets)
            training_time += time.perf_counter() - start
            if not math.isfinite(loss):
                raise StudyError(f"SGD diverged at step {step} (loss {loss}).")
            losses.append(loss)
            monitor.step(None if fixed is not None else (inputs, targets))
    records = monitor.records
    overhead = sum(r["overhead_s"] for r in records)
    results = {
        "steps": args.steps,
        "every": args.every,
        "top_k": args.top_k,
        "monitor_batch": args.monitor_batch,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": args.momentum,
        "damping": args.damping,
        "batch_losses": losses,
        "final": evaluate_splits(model, loss_func, data),
        "records_file": RECORDS_FILE,
        "overhead": {
            "training_step_s": training_time / args.steps,
            "per_record_s": overhead / len(records) if records else 0.0,
            "per_step_s": overhead / args.steps,
            "relative_to_training": overhead / training_time,
        },
    }
    payload = setup.payload(
        results, {"training_s": training_time, "monitor_s": overhead}
    )
    write(
        setup.output,
        payload,
        {"monitor.png": monitor_figure(records)},
        summarize(results, records, args),
    )
    return payload


def plot(path: Path) -> Path:
    """Draw a monitor's records into ``path`` with the suffix ``.png``.

    Args:
        path: The JSON lines file.

    Returns:
        The figure's path.

    Raises:
        StudyError: If the file cannot be read as records or holds none.
    """
    try:
        records = read_records(path)
    except InvalidArgumentError as error:
        raise StudyError(str(error)) from None
    if not records:
        raise StudyError(f"{path} holds no records to plot.")
    target = path.with_suffix(".png")
    save(monitor_figure(records), target)
    others = len(runs(path)) - 1
    earlier = f"; {others} earlier run(s) in the file not drawn" if others else ""
    print(
        f"Figure:  {target} ({len(records)} records of run {records[0]['run']}"
        f"{earlier})"
    )
    return target


def _median(values: list[float | None]) -> float | None:
    """Median with ``None`` (infinite SNR) counted as the largest value."""
    finite = sorted(v for v in values if v is not None)
    ordered = finite + [math.inf] * (len(values) - len(finite))
    return statistics.median(ordered) if ordered else None


def summarize(results: dict, records: list[dict], args: argparse.Namespace) -> list:
    """The human summary of the monitor study.

    Args:
        results: The study's results.
        records: The monitor's records.
        args: Parsed command-line options.

    Returns:
        Lines to print.
    """
    cost = results["overhead"]
    lines = [
        f"Monitor study: model {args.model}, SGD (lr {args.lr}, momentum "
        f"{args.momentum}) for {args.steps} steps, batch {args.batch_size}; "
        f"top-{args.top_k} curvature of the {args.monitor_batch} batch every "
        f"{args.every} steps. Final test accuracy "
        f"{100 * results['final']['test_accuracy']:.1f} %.",
        f"{'step':>6} {'loss':>8} {'λ_1':>9} {'λ_k':>9} {'grad in top-k':>13} "
        f"{'med SNR γ':>10} {'med SNR λ':>10} {'Newton ∠':>9} {'cost [s]':>9}",
    ]
    for r in records:
        share = r["gradient_share"]
        angle = r["newton_angle_deg"]
        lines.append(
            f"{r['step']:>6} {number(r['loss']):>8} {number(r['eigenvalues'][0]):>9} "
            f"{number(r['eigenvalues'][-1]):>9} "
            f"{'n/a' if share is None else f'{100 * share:.1f} %':>13} "
            f"{number(_median(r['gamma_snr'])):>10} "
            f"{number(_median(r['lambda_snr'])):>10} "
            f"{'n/a' if angle is None else f'{angle:.1f}°':>9} "
            f"{r['overhead_s']:>9.3f}"
        )
    lines.append(
        f"Overhead: {cost['per_record_s']:.3f} s per record, "
        f"{1e3 * cost['per_step_s']:.2f} ms per training step on average "
        f"({100 * cost['relative_to_training']:.0f} % of the training time; one "
        f"SGD step takes {1e3 * cost['training_step_s']:.2f} ms)."
    )
    return lines


main = study_main(build_parser, run)
