"""Measuring a block of code: peak memory and other processes' CPU load."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import time

import torch

#: Blocks shorter than this (s) get no load figure: CPU counters tick every 10 ms.
MIN_MONITOR_S = 0.2


def status_kib(field: str) -> int | None:
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
        rss, hwm = status_kib("VmRSS"), status_kib("VmHWM")
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
        hwm = status_kib("VmHWM")
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
