"""Spawning one process per rank of a gloo group, for the distributed tests.

A job is a module of this package run as ``python -m MODULE JOB RANK WORLD_SIZE
RENDEZVOUS_FILE OUT_DIR``: each rank saves its results to ``OUT_DIR/rank{RANK}.pt``.
A job that hangs is killed after ``JOB_TIMEOUT`` seconds and fails the test;
inside it every collective has a 45 s timeout.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.fixtures.checks import assert_rel

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a whole job may take (typically 5-20 s) before it is killed.
JOB_TIMEOUT = 150


def launch(
    world_size: int, out: Path, module: str = "tests.distributed.jobs"
) -> list[dict]:
    """Run job ``world_size`` of ``module`` on that many ranks; every rank's results."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    command = [sys.executable, "-m", module, str(world_size)]
    processes = [
        subprocess.Popen(
            [*command, str(rank), str(world_size), str(out / "rendezvous"), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=JOB_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"The {world_size}-rank job hung (killed after {JOB_TIMEOUT} s).")
    for rank, (process, log) in enumerate(zip(processes, logs, strict=True)):
        assert process.returncode == 0, f"rank {rank} failed:\n{log}"
    return [
        torch.load(out / f"rank{rank}.pt", weights_only=False)
        for rank in range(world_size)
    ]


def run_rank(results: Callable[[int, int, int], dict]) -> None:
    """The rank side of a job: ``python -m MODULE JOB RANK WORLD_SIZE RENDEZVOUS OUT``.

    Joins the gloo group (every collective with a 45 s timeout), saves
    ``results(job, rank, world_size)`` to ``OUT/rank{RANK}.pt`` and leaves the
    group; a failure prints its traceback and exits with 1 (:func:`launch`
    shows it).

    Args:
        results: The job's computation on this rank.
    """
    try:
        job, rank, world_size = (int(arg) for arg in sys.argv[1:4])
        rendezvous, out = sys.argv[4:6]
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=45),
        )
        try:
            torch.save(results(job, rank, world_size), f"{out}/rank{rank}.pt")
        finally:
            torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def assert_raised_on_every_rank(
    results: list[dict], errors: dict[str, str], last: int
) -> None:
    """Each case failed on rank ``last`` with its error, on the others naming it.

    Args:
        results: Every rank's results, with ``"failures"``: case -> (type, text).
        errors: The error type each case raises on the rank that fails.
        last: The rank that fails.
    """
    world_size = len(results)
    for rank, result in enumerate(results):
        for case, error in errors.items():
            kind, message = result["failures"][case]
            if rank == last:
                assert kind == error, (case, kind, message)
            else:
                assert kind == "DistributedError", (case, kind, message)
                assert f"Rank {last} of {world_size} failed ({error}:" in message


def assert_training_is_that_of_the_union(
    ranks: list[dict[str, torch.Tensor]], expected: dict[str, torch.Tensor]
) -> None:
    """The replicas are bit-identical and equal one process on the union batches.

    Args:
        ranks: Every rank's training results (losses, final parameters).
        expected: The same of one process trained on the union batches.
    """
    for key in ranks[0]:
        for other in ranks[1:]:
            assert torch.equal(ranks[0][key], other[key]), f"replicas differ: {key}"
    for key, value in expected.items():
        assert_rel(ranks[0][key], value)
