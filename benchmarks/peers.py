"""The side environment with the peers: ViViT 1.0.0 and curvlinops.

ViViT 1.0.0 (PyPI ``vivit-for-pytorch``) imports as ``vivit``, like this library, so
it cannot share an environment with it. The harness creates a virtual environment
under ``benchmarks/.venvs/peers`` (git-ignored) on first use::

    python -m venv benchmarks/.venvs/peers
    benchmarks/.venvs/peers/bin/pip install torch==<this torch> \\
        vivit-for-pytorch==1.0.0 curvlinops-for-pytorch==3.0.1

``torch`` is named in the same command so pip keeps the version (and the CPU or
CUDA build available to pip) of the main environment rather than resolving its own.
None of these packages is a dependency of this project.

ViViT 1.0.0 calls ``Tensor.symeig``, which PyTorch removed in 2.0;
:func:`apply_symeig_shim` puts it back on top of ``torch.linalg.eigh``.

The peers' iterative solver (``scipy``'s ``eigsh``) stops at the tolerance that
:func:`tolerances` computes with this library, in the harness's process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch
from problems import PROBLEMS

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(__file__).resolve().parent / ".venvs" / "peers"
PACKAGES = ("vivit-for-pytorch==1.0.0", "curvlinops-for-pytorch==3.0.1")


def python() -> Path:
    """The side environment's interpreter."""
    return VENV / "bin" / "python"


def ensure_env(log=print) -> str | None:
    """Create the side environment if it does not exist.

    Args:
        log: Where progress messages go.

    Returns:
        ``None`` if the environment is usable, else why not.
    """
    if python().exists():
        return None
    torch_version = torch.__version__.split("+")[0]
    commands = [
        [sys.executable, "-m", "venv", str(VENV)],
        [
            str(python()),
            "-m",
            "pip",
            "install",
            "--quiet",
            f"torch=={torch_version}",
            *PACKAGES,
        ],
    ]
    log(f"Creating the peers' environment {VENV} (once; a few minutes) ...")
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or [""])[-1]
            shutil.rmtree(VENV, ignore_errors=True)  # no half-built environment
            return f"creating {VENV} failed: {' '.join(command[:4])} ...: {tail}"
    return None


def tolerances(problems: list[str], choice: str) -> dict[str, float]:
    """The stopping tolerance of the peers' iterative solvers, per problem.

    Computed in the harness's process, which imports this library (the side
    environment imports ViViT 1.0 as ``vivit``).

    Args:
        problems: Names in :data:`problems.PROBLEMS`.
        choice: ``"library"``: this library's default for the data type of the
            problem's parameters (``vivit.linalg.iterative.default_tolerance`` of
            this repository, the copy the workers benchmark); ``"zero"``: ``0``
            (machine precision in ``scipy``'s ``eigsh``).

    Returns:
        Problem name -> tolerance.
    """
    if choice == "zero":
        return dict.fromkeys(problems, 0.0)
    if str(ROOT) not in sys.path:  # the copy the workers import (their PYTHONPATH)
        sys.path.insert(0, str(ROOT))
    from vivit.linalg.iterative import default_tolerance

    return {
        problem: default_tolerance(next(PROBLEMS[problem].build().parameters()).dtype)
        for problem in problems
    }


def apply_symeig_shim() -> None:
    """Give ``Tensor`` back its ``symeig`` (removed in PyTorch 2.0) for ViViT 1.0.0."""

    def symeig(self, eigenvectors=False, upper=True):
        uplo = "U" if upper else "L"
        if eigenvectors:
            return torch.linalg.eigh(self, UPLO=uplo)
        return torch.linalg.eigvalsh(self, UPLO=uplo), None

    torch.Tensor.symeig = symeig
