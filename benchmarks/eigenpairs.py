"""Benchmark: top-10 eigenpairs of the exact GGN, against a forward+backward pass.

Run ``python benchmarks/eigenpairs.py`` (``--quick`` for a smoke test, ``--help`` for
every option). Each (problem, batch size, method) runs in a fresh Python process
(``--worker``), which

1. sets the number of torch threads (``--threads``, default: the CPU cores this
   process may use), seeds torch and builds the model and a random mini-batch;
2. calls the method once as a warm-up (its time is recorded, not summarised);
3. calls it ``--repeats`` more times; each call is timed with
   ``time.perf_counter`` (after ``torch.cuda.synchronize`` on CUDA). The table shows
   the median, the JSON file also min, max and every raw time;
4. calls it once more to measure memory (this call is not timed):

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
     ``torch.cuda.reset_peak_memory_stats``): tensors only, not the caching
     allocator's reserve nor the CUDA context.

   The warm-up call is measured the same way (without ``malloc_trim``, HWM reset or
   ``gc``, it is the first call in the process); the JSON keeps it as
   ``warmup_peak_mib``: it adds one-time costs such as library code paged in and
   thread pools started.

Before every call (and before the memory baseline) the parameters' ``.grad`` are set
to ``None``, outside the timed region, so every method allocates the gradients it
produces. Model parameters and data exist before the baseline and are not counted.

Other processes on the machine distort the timings (strongly so with several threads
per process). The column "others' load" is the average number of cores that other
processes kept busy while the case ran (busy time in ``/proc/stat`` minus the CPU
time of this benchmark's processes, over the wall time); the JSON also holds it per
call (``None`` for calls shorter than 0.2 s, the counters tick every 10 ms).

Methods live in the registry :data:`METHODS`: a name mapped to a function
``(model, loss_func, X, y) -> eigenvalues or None`` doing all the work (including
building any curvature object). Returned eigenvalues are stored in the JSON and
compared across methods. Problems live in :data:`PROBLEMS`.

Output: a Markdown table on stdout and a JSON file (default
``benchmarks/results/eigenpairs-<hostname or GPU name>.json``) with the
configuration, library versions, machine information and every raw timing.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vivit import LowRankGGN

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULT_MARKER = "@@BENCHMARK-RESULT@@"
BASELINE = "forward+backward"
TOP_K = 10
#: Memory ratios are left out below this baseline (MiB): too small to divide by.
MIN_MEMORY_MIB = 1.0
#: Blocks shorter than this (s) get no load figure: CPU counters tick every 10 ms.
MIN_MONITOR_S = 0.2
NUM_CLASSES = 10

# Methods ------------------------------------------------------------------------

Method = Callable[[nn.Module, nn.Module, Tensor, Tensor], Tensor | None]


def forward_backward(
    model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor
) -> None:
    """A plain forward and backward pass (the baseline)."""
    loss_func(model(X), y).backward()


def vivit_eigh(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    """Top-k GGN eigenpairs with :class:`vivit.LowRankGGN` (construction included)."""
    evals, _ = LowRankGGN(model, loss_func, (X, y)).eigh(top_k=TOP_K)
    return evals


def vivit_func_eigh(
    model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor
) -> Tensor:
    """Top-k GGN eigenpairs through the func engine (no BackPACK)."""
    ggn = LowRankGGN(model, loss_func, (X, y), engine="func")
    evals, _ = ggn.eigh(top_k=TOP_K)
    return evals


#: Benchmarked methods: name -> function(model, loss_func, X, y) doing the work.
#: It may return the computed eigenvalues (any order) for cross-checks.
METHODS: dict[str, Method] = {
    BASELINE: forward_backward,
    "vivit": vivit_eigh,
    "vivit-func": vivit_func_eigh,
}

# Problems -----------------------------------------------------------------------


def mlp(activation: str = "relu") -> nn.Module:
    """MLP 784-128-64-10 with ReLU or Tanh activations."""
    act = {"relu": nn.ReLU, "tanh": nn.Tanh}[activation]
    return nn.Sequential(
        nn.Linear(784, 128),
        act(),
        nn.Linear(128, 64),
        act(),
        nn.Linear(64, NUM_CLASSES),
    )


def cnn_3c3d() -> nn.Module:
    """DeepOBS' CIFAR-10 ``3c3d`` network (895,210 parameters, DeepOBS init).

    Shapes for a 3x32x32 input: conv5x5 → 64x28x28, pool → 64x14x14, conv3x3 →
    96x12x12, pool → 96x6x6, conv3x3 (same) → 128x6x6, pool → 128x3x3, flatten →
    1152 → 512 → 256 → 10. Padding is given as integers: BackPACK 1.7.1 cannot
    backpropagate through a convolution with ``padding="same"``.
    """
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(64, 96, 3),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(1152, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, NUM_CLASSES),
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.xavier_normal_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    return model


class PreNormBlock(nn.Module):
    """Pre-norm transformer encoder block (d=32, 4 heads, GELU MLP of 64), mean
    pooling, 10 classes: inputs ``[N, 16, 32]``."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return self.head((x + self.mlp(self.norm2(x))).mean(1))


class CharLSTM(nn.Module):
    """Embedding(10, 32) → LSTM(32, 64) → Linear per position: ``[N, 10, 16]``."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(NUM_CLASSES, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(self.embedding(x))[0]).transpose(1, 2)


@dataclass(frozen=True)
class Problem:
    """A network, its input shape and the batch sizes to benchmark.

    Attributes:
        build: Creates the network.
        input_shape: Shape of one input sample.
        batch_sizes: Batch sizes of the full run.
        quick_batch_sizes: Batch sizes of ``--quick``.
        tokens: Inputs are class-index tokens and targets one class per position
            (character model) instead of random floats and one class per sample.
    """

    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    quick_batch_sizes: tuple[int, ...]
    tokens: bool = False


#: Benchmarked problems (cross-entropy loss, random inputs, 10 classes).
PROBLEMS: dict[str, Problem] = {
    "mlp-relu": Problem(lambda: mlp("relu"), (784,), (32, 128, 512), (8,)),
    "mlp-tanh": Problem(lambda: mlp("tanh"), (784,), (32, 128, 512), (8,)),
    "3c3d": Problem(cnn_3c3d, (3, 32, 32), (16, 32, 64, 128), (4,)),
    "transformer": Problem(PreNormBlock, (16, 32), (8, 32, 128), (4,)),
    "char-lstm": Problem(CharLSTM, (16,), (2, 8, 32), (2,), tokens=True),
}
DEFAULT_PROBLEMS = ("mlp-relu", "3c3d")


def make_problem(
    name: str, batch_size: int, seed: int, device: torch.device
) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    """Build model, loss function and a random mini-batch, seeded."""
    problem = PROBLEMS[name]
    torch.manual_seed(seed)
    model = problem.build().to(device)
    if problem.tokens:
        shape = (batch_size, *problem.input_shape)
        X = torch.randint(0, NUM_CLASSES, shape, device=device)
        y = torch.randint(0, NUM_CLASSES, shape, device=device)
    else:
        X = torch.randn(batch_size, *problem.input_shape, device=device)
        y = torch.randint(0, NUM_CLASSES, (batch_size,), device=device)
    return model, nn.CrossEntropyLoss().to(device), X, y


# Measurement ---------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``None`` where unavailable)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset ``VmHWM`` to the current ``VmRSS``; return whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def _malloc_trim() -> None:
    """Give the heap's free memory back to the kernel (glibc only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory increase of a block of code, in MiB (see the module docstring).

    Args:
        device: Device the computation runs on.
        prepare: Collect garbage, trim the heap and reset the high-water mark first.
    """

    def __init__(self, device: torch.device, prepare: bool = True):
        self.device = device
        self.prepare = prepare
        self.hwm_reset = False
        self.peak_mib: float | None = None

    def __enter__(self) -> PeakMemory:
        if self.prepare:
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            return self
        if self.prepare:
            _malloc_trim()
            self.hwm_reset = _reset_hwm()
        rss, hwm = _status_kib("VmRSS"), _status_kib("VmHWM")
        if rss is None or hwm is None:
            self._baseline = None
        else:
            self._baseline = rss if self.hwm_reset else max(rss, hwm)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_mib = (peak - self._baseline) / 2**20
            return
        hwm = _status_kib("VmHWM")
        if self._baseline is not None and hwm is not None:
            self.peak_mib = max(hwm - self._baseline, 0) / 1024


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (``/proc/stat``)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user..steal; guest time is part of user
    return busy / os.sysconf("SC_CLK_TCK")


class OtherCpuLoad:
    """Cores kept busy by other processes while a block (and its children) runs.

    Busy CPU time of the whole machine (``/proc/stat``) minus the CPU time of this
    process and its waited-for children (``os.times``), over the wall time.

    Attributes:
        cores: Average number of cores used by other processes (``None`` where
            ``/proc/stat`` cannot be read or the block ran shorter than
            ``MIN_MONITOR_S``: the counters tick every 10 ms).
    """

    cores: float | None = None

    @staticmethod
    def _own_cpu_seconds() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __enter__(self) -> OtherCpuLoad:
        self._busy = _busy_cpu_seconds()
        self._own = self._own_cpu_seconds()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy = _busy_cpu_seconds()
        wall = time.perf_counter() - self._start
        if busy is None or self._busy is None or wall < MIN_MONITOR_S:
            return
        other = busy - self._busy - (self._own_cpu_seconds() - self._own)
        self.cores = max(other, 0.0) / wall


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

    others: list[float | None] = []

    def call() -> tuple[Tensor | None, float]:
        model.zero_grad(set_to_none=True)
        _sync(device)
        with OtherCpuLoad() as monitor:
            start = time.perf_counter()
            result = method(model, loss_func, X, y)
            _sync(device)
            elapsed = time.perf_counter() - start
        others.append(monitor.cores)
        return result, elapsed

    with PeakMemory(device, prepare=False) as warmup_memory:
        evals, warmup_time = call()
    evals = None if evals is None else sorted(evals.detach().cpu().tolist())
    times = [call()[1] for _ in range(args.repeats)]
    model.zero_grad(set_to_none=True)
    with PeakMemory(device) as memory:
        call()
    return {
        "problem": args.problem,
        "batch_size": args.batch_size,
        "method": args.method,
        "status": "ok",
        "num_params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "warmup_time_s": warmup_time,
        "times_s": times,
        "median_time_s": statistics.median(times),
        "min_time_s": min(times),
        "max_time_s": max(times),
        "peak_mib": memory.peak_mib,
        "warmup_peak_mib": warmup_memory.peak_mib,
        "hwm_reset": memory.hwm_reset,
        "top_eigenvalues": evals,
        "other_cpu_cores_per_call": others,
    }


# Driver -------------------------------------------------------------------------


def run_case(
    args: argparse.Namespace, problem: str, batch_size: int, method: str
) -> dict[str, Any]:
    """Run one case in a fresh subprocess and return its record."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        f"--problem={problem}",
        f"--batch-size={batch_size}",
        f"--method={method}",
        f"--repeats={args.repeats}",
        f"--device={args.device}",
        f"--threads={args.threads}",
        f"--seed={args.seed}",
    ]
    record: dict[str, Any] = {
        "problem": problem,
        "batch_size": batch_size,
        "method": method,
    }
    start = time.perf_counter()
    monitor = OtherCpuLoad()
    try:
        with monitor:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=args.timeout
            )
    except subprocess.TimeoutExpired:
        record.update(status=f"timeout after {args.timeout} s")
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
    record.update(status=f"failed: {reason}: {tail[0][:200]}")
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


def _ratio(value: float | None, reference: float | None, floor: float = 0.0) -> str:
    if value is None or reference is None or reference <= floor:
        return "–"
    return f"{value / reference:.1f}"


def _cores(record: dict[str, Any]) -> str:
    cores = record.get("other_cpu_cores")
    return "–" if cores is None else f"{cores:.2f}"


def format_table(records: list[dict[str, Any]]) -> str:
    """Markdown table: one row per (problem, batch size, method)."""
    baselines = {
        (r["problem"], r["batch_size"]): r
        for r in records
        if r["method"] == BASELINE and r.get("status") == "ok"
    }
    lines = [
        "| problem | N | method | median time [s] | min–max [s] | × f+b "
        "| peak memory [MiB] | × f+b | others' load [cores] |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        base = baselines.get((r["problem"], r["batch_size"]), {})
        if r.get("status") != "ok":
            lines.append(
                f"| {r['problem']} | {r['batch_size']} | {r['method']} "
                f"| {r['status']} | | | | | {_cores(r)} |"
            )
            continue
        peak = r["peak_mib"]
        lines.append(
            f"| {r['problem']} | {r['batch_size']} | {r['method']} "
            f"| {r['median_time_s']:.4f} "
            f"| {r['min_time_s']:.4f}–{r['max_time_s']:.4f} "
            f"| {_ratio(r['median_time_s'], base.get('median_time_s'))} "
            f"| {'–' if peak is None else f'{peak:.1f}'} "
            f"| {_ratio(peak, base.get('peak_mib'), MIN_MEMORY_MIB)} | {_cores(r)} |"
        )
    return "\n".join(lines)


def eigenvalue_agreement(records: list[dict[str, Any]]) -> list[str]:
    """Largest relative deviation of each method's eigenvalues from the first's."""
    lines = []
    by_case: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("status") == "ok" and r.get("top_eigenvalues"):
            by_case.setdefault((r["problem"], r["batch_size"]), []).append(r)
    for (problem, batch_size), rs in by_case.items():
        reference = rs[0]["top_eigenvalues"][-TOP_K:]
        for r in rs[1:]:
            other = r["top_eigenvalues"][-TOP_K:]
            deviation = max(
                abs(a - b) / abs(a) for a, b in zip(reference, other, strict=False)
            )
            lines.append(
                f"{problem} N={batch_size}: {r['method']} vs {rs[0]['method']}: "
                f"max relative deviation of the top eigenvalues {deviation:.1e}"
            )
    return lines


def default_output(device: torch.device, quick: bool) -> Path:
    """``results/eigenpairs-<hostname or GPU name>[-quick].json``."""
    if device.type == "cuda":
        label = torch.cuda.get_device_name(device)
    else:
        label = socket.gethostname()
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-").lower() or "cpu"
    return RESULTS_DIR / f"eigenpairs-{label}{'-quick' if quick else ''}.json"


def run_driver(args: argparse.Namespace) -> None:
    """Run every case in its own process, print the table and write the JSON."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested, but CUDA is not available.")
    problems = args.problems or list(DEFAULT_PROBLEMS)
    methods = args.methods or list(METHODS)
    if BASELINE not in methods:
        methods.insert(0, BASELINE)
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
    for problem, batch_size, method in cases:
        record = run_case(args, problem, batch_size, method)
        records.append(record)
        summary = (
            f"median {record['median_time_s']:.4f} s, "
            f"peak {record['peak_mib'] or 0:.1f} MiB"
            if record.get("status") == "ok"
            else record["status"]
        )
        summary += f", others' load {_cores(record)} cores"
        print(
            f"[{time.perf_counter() - start:7.1f} s] {problem} N={batch_size} "
            f"{method}: {summary}",
            file=sys.stderr,
            flush=True,
        )
    total = time.perf_counter() - start

    table = format_table(records)
    print(table)
    agreement = eigenvalue_agreement(records)
    for line in agreement:
        print(line)
    print(f"\nTotal wall time: {total:.0f} s")
    busy = [r["other_cpu_cores"] for r in records if r.get("other_cpu_cores")]
    if busy and max(busy) > 0.1:
        print(
            f"Other processes kept up to {max(busy):.2f} cores busy during a case: "
            'those timings are inflated (column "others\' load").'
        )

    output = Path(args.output) if args.output else default_output(device, args.quick)
    output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "top-10 eigenpairs of the exact GGN (cross-entropy)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "problems": problems,
            "methods": methods,
            "repeats": args.repeats,
            "warmup": 1,
            "top_k": TOP_K,
            "device": args.device,
            "threads": args.threads,
            "seed": args.seed,
            "quick": args.quick,
            "timeout_s": args.timeout,
            "memory": (
                "peak RSS (VmHWM) increase during one extra call over VmRSS just "
                "before it, after gc, malloc_trim and an HWM reset"
                if device.type == "cpu"
                else "torch.cuda.max_memory_allocated - memory_allocated before"
            ),
        },
        "versions": {
            "torch": torch.__version__,
            "backpack-for-pytorch": _version("backpack-for-pytorch"),
            "vivit": _version("vivit"),
            "vivit_git_commit": _git_commit(),
            "numpy": _version("numpy"),
            "scipy": _version("scipy"),
        },
        "machine": machine_info(device),
        "loadavg_1min": {"start": load, "end": os.getloadavg()[0]},
        "total_wall_s": total,
        "results": records,
        "eigenvalue_agreement": agreement,
        "table_markdown": table,
    }
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"Results written to {output}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the driver and the worker."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs (default 5, quick 2)"
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
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch.set_num_threads (default: usable CPU cores)",
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
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
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
