"""Spawning one process per rank of a gloo group, for the distributed tests.

A job is a module of this package run as ``python -m MODULE JOB RANK WORLD_SIZE
RENDEZVOUS_FILE OUT_DIR``: each rank saves its results to ``OUT_DIR/rank{RANK}.pt``.
A job that hangs is killed after ``JOB_TIMEOUT`` seconds and fails the test;
inside it every collective has a 45 s timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
