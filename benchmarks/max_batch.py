"""The largest batch whose exact top-k GGN eigenpairs fit into a memory budget.

``python benchmarks/max_batch.py --device cuda --budget-gib 8`` doubles N from
``--start`` until a run does not fit, then bisects to ``--precision``. Each N runs in
a fresh process (``--worker``), which builds the problem and calls a method of
:data:`methods.METHODS` once (default ``vivit``; ``--top-k`` overrides its k):

- CUDA: the process may allocate at most ``--budget-gib``
  (``torch.cuda.set_per_process_memory_fraction``); a run fits if it raises no
  out-of-memory error. ``--budget-gib 0`` uses the whole card.
- CPU: a run fits if its peak resident set size (``VmHWM``, model, data and
  libraries included) stays within the budget; nothing caps it, so the machine
  needs more memory than the budget (or the kernel ends the process, which also
  counts as not fitting).

Prints one line per trial and a JSON summary; ``--output`` writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import methods
import torch
from measure import status_kib
from problems import PROBLEMS, make_problem

ROOT = Path(__file__).resolve().parent.parent
MARKER = "@@MAX-BATCH@@"


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run the method once at ``--batch-size``; report whether it fit."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the memory cap needs one
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(args.threads)
    if device.type == "cuda" and args.budget_gib > 0:
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, args.budget_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    methods.TOP_K = args.top_k
    model, loss_func, X, y = make_problem(args.problem, args.batch_size, 0, device)
    start = time.perf_counter()
    try:
        evals = methods.METHODS[args.method].run(model, loss_func, X, y)
    except torch.OutOfMemoryError as error:
        return {"fits": False, "reason": str(error).splitlines()[0][:200]}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = (status_kib("VmHWM") or 0) / 2**20
    fits = device.type == "cuda" or args.budget_gib <= 0 or peak <= args.budget_gib
    return {
        "fits": fits,
        "peak_gib": peak,
        "time_s": time.perf_counter() - start,
        "top_eigenvalue": None if evals is None else float(evals.max()),
    }


def trial(args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    """Run the worker for one N in a fresh process."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        f"--batch-size={batch_size}",
        f"--problem={args.problem}",
        f"--method={args.method}",
        f"--top-k={args.top_k}",
        f"--device={args.device}",
        f"--budget-gib={args.budget_gib}",
        f"--threads={args.threads}",
    ]
    variables = dict(os.environ)
    path = variables.get("PYTHONPATH")
    variables["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=variables, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"fits": None, "reason": f"timeout after {args.timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    tail = (done.stderr.strip().splitlines() or [""])[-1][:200]
    return {"fits": False, "reason": f"exit code {done.returncode}: {tail}"}


def search(args: argparse.Namespace) -> dict[str, Any]:
    """Doubling, then bisection; a timeout ends the search (result: a lower bound)."""
    trials: dict[int, dict[str, Any]] = {}

    def fits(n: int) -> bool | None:
        trials[n] = trial(args, n)
        print(f"N={n}: {trials[n]}", file=sys.stderr, flush=True)
        return trials[n]["fits"]

    low, high, n = 0, None, args.start
    while high is None:
        result = fits(n)
        if result is None:
            break
        if result:
            low, n = n, 2 * n
        else:
            high = n
    while high is not None and high - low > max(1, args.precision * low):
        middle = (low + high) // 2
        result = fits(middle)
        if result is None:
            break
        low, high = (middle, high) if result else (low, middle)
    return {
        "problem": args.problem,
        "method": args.method,
        "top_k": args.top_k,
        "device": args.device,
        "gpu": (
            torch.cuda.get_device_name(args.device)
            if args.device.startswith("cuda")
            else None
        ),
        "budget_gib": args.budget_gib,
        "largest_fitting_batch": low,
        "smallest_failing_batch": high,
        "trials": {str(k): v for k, v in sorted(trials.items())},
    }


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="3c3d", choices=sorted(PROBLEMS))
    parser.add_argument("--method", default="vivit", choices=list(methods.METHODS))
    parser.add_argument("--top-k", type=int, default=methods.TOP_K)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--start", type=int, default=128)
    parser.add_argument(
        "--precision", type=float, default=0.05, help="relative bracket width"
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--output", help="JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(MARKER + json.dumps(worker(args)), flush=True)
        return
    result = search(args)
    print(json.dumps(result, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
