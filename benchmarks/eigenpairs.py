"""Benchmark: top-10 GGN eigenpairs, side by side with the peers, in one command.

``python benchmarks/eigenpairs.py`` (``--quick`` for a run of a few minutes,
``--help`` for every option) runs, for every problem and batch size N, every method
of :data:`methods.METHODS`: a plain forward+backward pass (the baseline), this
library (exact, MC-1, subsampled, per-layer groups), power iteration on GGN-vector
products, ViViT 1.0.0 and curvlinops + scipy ``eigsh``. The peers run in a side
environment the harness creates on first use (:mod:`peers`); their ``eigsh`` stops
at this library's default tolerance, which the harness computes
(:func:`peers.tolerances`, ``--peer-tol``). Methods that count their operator
products (:class:`methods.Outcome`) get time per product columns.
``--before TREE`` also runs every method of this library from ``TREE``, a
checkout of an earlier version, as ``<method>@before``, interleaved with this
version's (a change's effect, side by side in one run).

Each (problem, N, method) runs in a fresh Python process (``--worker``) of its
method's environment, which

1. sets the number of torch threads (``--threads``, default: the CPU cores this
   process may use), seeds torch and builds the model and a random mini-batch;
2. calls the method once as a warm-up (its time is recorded, not summarised);
3. calls it ``--repeats`` more times; each call is timed with
   ``time.perf_counter`` (after ``torch.cuda.synchronize`` on CUDA), and its CPU
   time (``time.process_time``, all threads of the process) is recorded: on a
   machine shared with other processes, CPU time tracks the work done far better
   than wall time (waiting for a core costs wall time, not CPU time; busy-waiting
   threads still add some);
4. measures the memory of the last timed call (the preparation below happens
   before its timer starts):

   - CPU: the peak resident set size (``VmHWM`` in ``/proc/self/status``) during
     the call minus the resident set size (``VmRSS``) just before it. Before the
     call the Python garbage collector runs, ``malloc_trim(0)`` hands the heap's
     free memory back to the kernel, and writing ``5`` to ``/proc/self/clear_refs``
     resets ``VmHWM`` to the current ``VmRSS``. The number is therefore the extra
     physical memory the call needs on top of the model, its gradients, the data
     and the loaded libraries. Where the reset is not allowed, the baseline is the
     ``VmHWM`` before the call (the increase is then a lower bound, ``hwm_reset`` is
     ``false`` in the JSON).
   - CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated`` during the call
     minus ``torch.cuda.memory_allocated`` before it (after
     ``torch.cuda.reset_peak_memory_stats``): tensors only.

Before every call the parameters' ``.grad`` are set to ``None``, outside the timed
region. The whole set of cases runs ``--rounds`` times, interleaved (round 1 of every
case, then round 2, ...), so slow drifts of the machine's load hit every method
alike. Summaries: median time over all timed calls of all rounds; ratios to the
baseline (and between this library and ViViT 1.0) as the median over rounds of
same-round ratios; peak memory as the median over rounds.

Other processes on the machine distort the timings (strongly so with several threads
per process). The column "others' load" is the average number of cores that other
processes kept busy while the case ran (busy time in ``/proc/stat`` minus the CPU
time of this benchmark's processes, over the wall time).

Output, under ``benchmarks/results/`` (``--output`` names the JSON file; the others
take its stem): ``eigenpairs-<label>.json`` (configuration, versions, machine, every
raw record and the summaries), ``.md`` (tables) and ``.png`` (time and peak memory
against N, log-log, one line per method). The label is the host name or GPU name,
with ``-quick`` for ``--quick``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import peers
import torch
from measure import OtherCpuLoad, PeakMemory
from methods import BASELINE, METHODS, TOP_K, as_outcome
from problems import PROBLEMS, make_problem

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULT_MARKER = "@@BENCHMARK-RESULT@@"
DEFAULT_PROBLEMS = ("mlp-relu", "3c3d")

# Worker -------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Time and measure one (problem, batch size, method) in this process."""
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    model, loss_func, X, y = make_problem(
        args.problem, args.batch_size, args.seed, device
    )
    method = METHODS[args.method]
    keywords = {"tol": args.tol} if method.takes_tol else {}
    others: list[float | None] = []

    cpu_times: list[float] = []
    products: list[int | None] = []

    def call():
        model.zero_grad(set_to_none=True)
        _sync(device)
        with OtherCpuLoad() as monitor:
            cpu_start = time.process_time()
            start = time.perf_counter()
            result = method.run(model, loss_func, X, y, **keywords)
            _sync(device)
            elapsed = time.perf_counter() - start
            cpu_times.append(time.process_time() - cpu_start)
        others.append(monitor.cores)
        outcome = as_outcome(result)
        products.append(outcome.products)
        return outcome, elapsed

    with PeakMemory(device, prepare=False) as warmup_memory:
        outcome, warmup_time = call()
    evals = outcome.evals
    evals = None if evals is None else sorted(evals.detach().cpu().tolist())
    times = [call()[1] for _ in range(args.repeats - 1)]
    model.zero_grad(set_to_none=True)
    with PeakMemory(device) as memory:  # the last timed call also measures memory
        times.append(call()[1])
    counted = [p for p in products[1:] if p is not None]  # of the timed calls
    return {
        "status": "ok",
        "num_params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "warmup_time_s": warmup_time,
        "times_s": times,
        "median_time_s": statistics.median(times),
        "cpu_times_s": cpu_times[1:],  # of the timed calls
        "median_cpu_s": statistics.median(cpu_times[1:]),
        "peak_mib": memory.peak_mib,
        "warmup_peak_mib": warmup_memory.peak_mib,
        "hwm_reset": memory.hwm_reset,
        "top_eigenvalues": evals,
        "other_cpu_cores_per_call": others,
        "products_per_call": products[1:],
        "products": statistics.median(counted) if counted else None,
        "product_operator": outcome.operator,
        "tol": args.tol if method.takes_tol else None,
    }


# Driver -------------------------------------------------------------------------


def _worker_env(env: str, args: argparse.Namespace) -> tuple[str, Path, dict[str, str]]:
    """Interpreter, worker script and environment variables of a worker of ``env``."""
    variables = dict(os.environ)
    # every worker's BLAS (numpy's, scipy's ARPACK) at the torch threads asked for
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        variables[name] = str(args.threads)
    if env == "peers":
        # ViViT 1.0 imports as `vivit`: keep this repository off the path
        variables.pop("PYTHONPATH", None)
        python = args.peers_python or str(peers.python())
        return python, Path(__file__).resolve(), variables
    root = Path(args.before).resolve() if env == "before" else ROOT
    path = variables.get("PYTHONPATH")
    variables["PYTHONPATH"] = str(root) + (os.pathsep + path if path else "")
    return sys.executable, root / "benchmarks" / "eigenpairs.py", variables


def add_before_methods(methods: list[str], tree: str) -> list[str]:
    """Each method of this library also as ``<method>@before``: run by ``tree``.

    ``tree`` is a checkout of an earlier version of the repository (e.g.
    ``git worktree add /tmp/before <commit>``); its own worker script and
    methods run, in this environment, interleaved with this version's.
    """
    with_before = []
    for name in methods:
        with_before.append(name)
        method = METHODS[name]
        if method.env == "main" and not method.baseline:
            description = f"{method.description} [before: {tree}]"
            METHODS[f"{name}@before"] = dataclasses.replace(
                method, description=description, env="before"
            )
            with_before.append(f"{name}@before")
    return with_before


def run_case(
    args: argparse.Namespace, problem: str, batch_size: int, method: str, rnd: int
) -> dict[str, Any]:
    """Run one case in a fresh subprocess and return its record."""
    record: dict[str, Any] = {
        "problem": problem,
        "batch_size": batch_size,
        "method": method,
        "round": rnd,
    }
    env = METHODS[method].env
    if env in args.unavailable:
        record["status"] = f"skipped: {args.unavailable[env]}"
        return record
    interpreter, script, variables = _worker_env(env, args)
    command = [
        interpreter,
        str(script),
        "--worker",
        f"--problem={problem}",
        f"--batch-size={batch_size}",
        f"--method={method.removesuffix('@before')}",
        f"--repeats={args.repeats}",
        f"--device={args.device}",
        f"--threads={args.threads}",
        f"--seed={args.seed}",
    ]
    if METHODS[method].takes_tol:
        command.append(f"--tol={args.peer_tolerances[problem]!r}")
    start = time.perf_counter()
    monitor = OtherCpuLoad()
    try:
        with monitor:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=args.timeout,
                env=variables,
            )
    except subprocess.TimeoutExpired:
        record["status"] = f"timeout after {args.timeout:.0f} s"
        return record
    finally:
        record["process_wall_s"] = time.perf_counter() - start
        record["other_cpu_cores"] = monitor.cores
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            record.update(json.loads(line[len(RESULT_MARKER) :]))
            return record
    reason = (
        "killed (out of memory?)"
        if done.returncode in (-9, 137)
        else f"exit code {done.returncode}"
    )
    tail = done.stderr.strip().splitlines()[-1:] or [""]
    record["status"] = f"failed: {reason}: {tail[0][:200]}"
    return record


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return f"{commit}{'-dirty' if dirty else ''}" or None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_info(device: torch.device) -> dict[str, Any]:
    """CPU, memory, platform and (on CUDA) GPU of this machine."""
    total_kib = None
    try:
        with open("/proc/meminfo") as meminfo:
            total_kib = int(meminfo.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    info = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": None if total_kib is None else round(total_kib / 2**20, 1),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def output_paths(args: argparse.Namespace, device: torch.device) -> Path:
    """The JSON file; the table and figure take its stem."""
    if args.output:
        return Path(args.output)
    if device.type == "cuda":
        label = torch.cuda.get_device_name(device)
    else:
        label = socket.gethostname()
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-").lower() or "cpu"
    return RESULTS_DIR / f"eigenpairs-{label}{'-quick' if args.quick else ''}.json"


def run_driver(args: argparse.Namespace) -> None:
    """Run every case in its own process, interleaved; write JSON, tables, figure."""
    import report

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested, but CUDA is not available.")
    problems = args.problems or list(DEFAULT_PROBLEMS)
    methods = args.methods or list(METHODS)
    if BASELINE not in methods:
        methods.insert(0, BASELINE)
    if args.before:
        methods = add_before_methods(methods, args.before)
    args.unavailable = {}
    args.peer_tolerances = (
        peers.tolerances(problems, args.peer_tol)
        if any(METHODS[m].takes_tol for m in methods)
        else {}
    )
    if any(METHODS[m].env == "peers" for m in methods):
        if args.no_peers:
            args.unavailable["peers"] = "--no-peers"
        elif not args.peers_python:
            problem = peers.ensure_env(log=lambda m: print(m, file=sys.stderr))
            if problem:
                print(f"Peers skipped: {problem}", file=sys.stderr)
                args.unavailable["peers"] = problem
    cases = []
    for problem in problems:
        spec = PROBLEMS[problem]
        sizes = args.batch_sizes or (
            spec.quick_batch_sizes if args.quick else spec.batch_sizes
        )
        cases += [(problem, n, m) for n in sizes for m in methods]

    load = os.getloadavg()[0]
    if device.type == "cpu" and load > 0.5:
        print(
            f"Warning: 1-minute load average is {load:.2f}; other processes compete "
            "for the CPU and distort the timings.",
            file=sys.stderr,
        )
    records = []
    start = time.perf_counter()
    for rnd in range(args.rounds):
        for problem, batch_size, method in cases:
            record = run_case(args, problem, batch_size, method, rnd)
            records.append(record)
            summary = (
                f"median {record['median_time_s']:.4f} s, "
                f"peak {record['peak_mib'] or 0:.1f} MiB, "
                f"products {record.get('products') or '–'}"
                if record.get("status") == "ok"
                else record["status"]
            )
            cores = record.get("other_cpu_cores")
            summary += f", others' load {'–' if cores is None else f'{cores:.2f}'}"
            print(
                f"[{time.perf_counter() - start:7.1f} s] round {rnd + 1}/"
                f"{args.rounds} {problem} N={batch_size} {method}: {summary}",
                file=sys.stderr,
                flush=True,
            )
    total = time.perf_counter() - start

    summaries = report.summarize(records)
    table = report.format_table(summaries)
    comparison = report.format_comparison(summaries, records)
    agreement = report.eigenvalue_agreement(summaries)
    busy = [r["other_cpu_cores"] for r in records if r.get("other_cpu_cores")]
    notes = [f"Total wall time: {total:.0f} s, {args.rounds} interleaved round(s)."]
    if args.peer_tolerances:
        values = ", ".join(f"{p} {t:.3g}" for p, t in args.peer_tolerances.items())
        notes.append(
            f"The peers' eigsh stopped at tol = {values} (--peer-tol "
            f"{args.peer_tol}; ARPACK's criterion ‖r‖ ≤ tol·|θ_i| per Ritz value, "
            "this library's ‖r‖ ≤ tol·θ_max)."
        )
    if busy and max(busy) > 0.1:
        notes.append(
            f"Other processes kept up to {max(busy):.2f} cores busy during a case "
            f"(median {statistics.median(busy):.2f}): absolute timings are "
            "inflated; the same-round ratios are the more robust numbers."
        )

    output = output_paths(args, device)
    output.parent.mkdir(parents=True, exist_ok=True)
    versions = {
        "torch": torch.__version__,
        "backpack-for-pytorch": _version("backpack-for-pytorch"),
        "vivit": _version("vivit"),
        "vivit_git_commit": _git_commit(),
        "numpy": _version("numpy"),
        "scipy": _version("scipy"),
        "peers": None if "peers" in args.unavailable else list(peers.PACKAGES),
    }
    command = " ".join(["python", *sys.argv])
    markdown = "\n\n".join(
        [
            f"# Top-{TOP_K} GGN eigenpairs: `{command}`",
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}, "
            f"{machine_info(device)['cpu_model']}, {args.threads} thread(s), "
            f"torch {torch.__version__}, vivit commit {versions['vivit_git_commit']}.",
            "## This library against ViViT 1.0 (same-round ratios)",
            comparison,
            "## Every method",
            table,
            "## Agreement of the top eigenvalue\n\n"
            + "\n".join(f"- {line}" for line in agreement),
            "## Methods\n\n" + report.legend(),
            "\n".join(notes),
        ]
    )
    print(markdown)
    output.with_suffix(".md").write_text(markdown + "\n")
    figure = output.with_suffix(".png")
    if report.plot(summaries, figure, f"top-{TOP_K} GGN eigenpairs, {command}"):
        print(f"Figure written to {figure}")
    output.write_text(
        json.dumps(
            {
                "benchmark": f"top-{TOP_K} eigenpairs of the GGN (cross-entropy)",
                "command": command,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "config": {
                    "problems": problems,
                    "methods": {m: METHODS[m].description for m in methods},
                    "rounds": args.rounds,
                    "repeats": args.repeats,
                    "warmup": 1,
                    "top_k": TOP_K,
                    "device": args.device,
                    "threads": args.threads,
                    "seed": args.seed,
                    "quick": args.quick,
                    "timeout_s": args.timeout,
                    "peer_tol": args.peer_tol,
                    "peer_tolerances": args.peer_tolerances,
                    "memory": (
                        "peak RSS (VmHWM) increase during one extra call over VmRSS "
                        "just before it, after gc, malloc_trim and an HWM reset"
                        if device.type == "cpu"
                        else "torch.cuda.max_memory_allocated - memory_allocated"
                    ),
                },
                "versions": versions,
                "machine": machine_info(device),
                "loadavg_1min": {"start": load, "end": os.getloadavg()[0]},
                "total_wall_s": total,
                "summaries": summaries,
                "eigenvalue_agreement": agreement,
                "notes": notes,
                "results": records,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"Results written to {output} (.md, .png beside it)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the driver and the worker."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small batches, one round (minutes)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds, each case in a fresh process (default 3, quick 1)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed calls per process, at least 1 (default 2, quick 1)",
    )
    parser.add_argument("--output", help="JSON file (default: results/...)")
    parser.add_argument(
        "--problems", nargs="+", choices=sorted(PROBLEMS), help="problems to run"
    )
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), help="methods to run"
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", help="override every problem's N"
    )
    parser.add_argument(
        "--no-peers",
        action="store_true",
        help="skip ViViT 1.0 and curvlinops (no side environment)",
    )
    parser.add_argument(
        "--peers-python",
        help="an interpreter that imports the peers (ViViT 1.0 as vivit, curvlinops) "
        "and not this library, used instead of creating benchmarks/.venvs/peers",
    )
    parser.add_argument(
        "--before",
        help="a checkout of an earlier version: every method of this library also "
        "runs from it, as <method>@before, side by side in this run",
    )
    parser.add_argument(
        "--peer-tol",
        choices=("library", "zero"),
        default="library",
        help="stopping tolerance of curvlinops' eigsh: this library's default for "
        "the parameters' data type (default), or 0, eigsh's machine precision",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch.set_num_threads and every worker's BLAS threads (default: "
        "usable CPU cores)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds per case (process)"
    )
    worker = parser.add_argument_group("worker (internal)")
    worker.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker.add_argument("--problem", help=argparse.SUPPRESS)
    worker.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    worker.add_argument("--method", help=argparse.SUPPRESS)
    worker.add_argument("--tol", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    return args


def main() -> None:
    """Entry point."""
    args = parse_args()
    if args.worker:
        record = run_worker(args)
        print(RESULT_MARKER + json.dumps(record), flush=True)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
