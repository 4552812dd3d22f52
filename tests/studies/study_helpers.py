"""Shared constants and helpers of the study tests (imported by name, not conftest)."""

import importlib
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
EXP = ROOT / "exp"
FACTORIES = Path(__file__).resolve().parent / "factories.py"

#: Options of a run that takes seconds.
TINY = {
    "spectrum": [
        "--train-steps",
        "5",
        "--batch-size",
        "12",
        "--top-k",
        "3",
        "--timing-repeats",
        "2",
    ],  # fmt: skip
    "noise": ["--steps", "4", "--every", "2", "--batch-size", "12", "--top-k", "3"],
    "newton": ["--steps", "6", "--eval-every", "3", "--batch-size", "16"],
    "monitor": ["--steps", "4", "--every", "2", "--batch-size", "12", "--top-k", "3"],
    "approximations": [
        "--train-steps",
        "5",
        "--batch-size",
        "12",
        "--top-k",
        "3",
        "--mc-samples",
        "1",
        "4",
    ],  # fmt: skip
    "hierarchy": [
        "--train-steps",
        "5",
        "--batch-size",
        "12",
        "--lanczos-steps",
        "10",
        "--probes",
        "4",
    ],  # fmt: skip
}


def run_tiny(study, output, *options):
    """Run a study in-process on the tiny configuration; return its exit status.

    A study seeds torch's global generator (``--seed``); its state is restored
    afterwards, so that the tests after a study draw what they would without it.
    """
    module = importlib.import_module(f"studies.{study}")
    argv = [*TINY[study], "--no-progress", "--output", str(output), *options]
    with torch.random.fork_rng(devices=[]):
        return module.main(argv)


def read_results(output):
    """The ``results.json`` a run wrote."""
    return json.loads((Path(output) / "results.json").read_text())


class Runner:
    """Run a study in-process and capture what it printed."""

    def __init__(self, capsys):
        self.capsys = capsys

    def __call__(self, study, output, *options):
        """Run ``study`` with ``options``; return (exit status, stdout, stderr)."""
        status = run_tiny(study, output, *options)
        captured = self.capsys.readouterr()
        return status, captured.out, captured.err

    results = staticmethod(read_results)
