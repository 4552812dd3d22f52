"""Peak memory of each phase of an exact top-10 request, with and without chunks.

``LowRankGGN(...)`` (forward and backward pass), ``gram()`` (forming the Gram
matrix) and ``eigh(top_k=10)``, each measured as in ``tests/memory/measure_memory.py``:
glibc serves allocations of at least 128 KiB with their own ``mmap``, so the
resident set follows the live tensors; before the request the garbage collector
runs, ``malloc_trim(0)`` returns free heap memory, and ``VmHWM`` is reset after
every phase. Printed: the resident memory after each phase and its peak, above
the resident memory before the request (model, data and libraries left out), the
solver ``"auto"`` picked, the CPU time, and the estimate of
:func:`vivit.memory.estimate_memory` for the same request.

Run: ``python benchmarks/phase_memory.py --problem 3c3d --batch-size 256
--chunk-size 32`` (omit ``--chunk-size`` for the whole batch at once).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time

import torch
from problems import PROBLEMS, make_problem

from vivit import LowRankGGN
from vivit.memory import estimate_memory

M_MMAP_THRESHOLD = -3


def status(field: str) -> int:
    """A field of ``/proc/self/status`` in bytes."""
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Set ``VmHWM`` to the current ``VmRSS``."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="3c3d", choices=sorted(PROBLEMS))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    torch.set_num_threads(args.threads)
    model, loss_func, X, y = make_problem(
        args.problem, args.batch_size, 0, torch.device("cpu")
    )
    # warm-up on a few samples: libraries paged in, thread pools started
    small = None if args.chunk_size is None else 4
    LowRankGGN(model, loss_func, (X[:8], y[:8]), chunk_size=small).eigh(top_k=3)
    gc.collect()
    libc.malloc_trim(0)
    reset_peak()
    before = status("VmRSS")

    def phase(name: str) -> None:
        resident = (status("VmRSS") - before) / 2**20
        peak = (status("VmHWM") - before) / 2**20
        print(f"{name}: resident {resident:.0f} MiB, peak {peak:.0f} MiB")
        reset_peak()

    start = time.process_time()
    ggn = LowRankGGN(model, loss_func, (X, y), chunk_size=args.chunk_size)
    phase("LowRankGGN(...)")
    ggn.gram()
    phase("gram()")
    ggn.eigh(top_k=10)
    phase("eigh(top_k=10)")
    solver = ggn.solver_report().solver
    estimate = estimate_memory(
        model,
        X[:2],
        args.batch_size,
        top_k=10,
        solver=solver,
        chunk_size=args.chunk_size,
    )
    print(
        f"solver {solver}, CPU time {time.process_time() - start:.1f} s, estimate "
        f"{estimate.total / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
