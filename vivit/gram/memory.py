"""Memory of Gram matrices and their dense eigensolver; refuse those that cannot fit.

Free memory, bytes per entry, solver workspace: the facts :mod:`vivit.memory` uses.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vivit.errors import GramTooLargeError

#: Squares beyond the Gram while it is fully decomposed: its eigenvectors and
#: LAPACK's syevd workspace (measured).
_EXTRA_SQUARES_PER_DECOMPOSITION = 3
#: Squares beyond the Gram for LAPACK's MRRR subset solver (a copy, its reduction).
_EXTRA_SQUARES_PER_SUBSET = 2
#: Squares beyond the Gram while it is formed: a layer's Gram of backpropagated
#: vectors, its inputs' Gram expanded to it, and their product (measured).
_EXTRA_SQUARES_PER_FORMATION = 3
#: Requests for at most this fraction of the eigenpairs compute only those (CPU).
PARTIAL_FRACTION = 0.25
#: cgroup v2 and v1: limit, usage, and the reclaimable page cache in memory.stat.
_CGROUP_FILES = (
    ("memory.max", "memory.current", "inactive_file"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
)
#: cgroup v1 reports "no limit" as a huge number (2⁶³ rounded to pages).
_UNLIMITED = 2**62


def available_bytes(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device`` (all it holds excluded).

    CUDA: free memory. CPU: the least of ``MemAvailable`` (else the physical memory),
    :func:`cgroup_headroom` and what ``RLIMIT_AS`` still allows.
    """
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = _read_fields(Path("/proc/meminfo"))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [meminfo.get("MemAvailable", physical), *cgroup_headroom()]
    try:
        import resource
    except ImportError:  # not a Unix
        return max(0, min(limits))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft - _read_fields(Path("/proc/self/status")).get("VmSize", 0))
    return max(0, min(limits))


def resident_bytes(device: torch.device) -> int:
    """Bytes this process holds on ``device``: CPU ``VmRSS`` (or 0), CUDA reserved."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    return _read_fields(Path("/proc/self/status")).get("VmRSS", 0)


def format_bytes(count: float) -> str:
    """A byte count in the largest binary unit that keeps it ≥ 1, e.g. ``"3.2 GiB"``."""
    for unit, power in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(count) >= 2**power:
            return f"{count / 2**power:.1f} {unit}"
    return f"{count:.0f} B"


def cgroup_headroom(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> list[int]:
    """``limit − (usage − page cache)`` of each limit of this process's cgroups."""
    paths = set()
    try:
        for line in membership.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers in ("", "memory") or "memory" in controllers.split(","):
                base = root if controllers == "" else root / "memory"
                parts = Path(path).relative_to("/").parts
                paths.update(base.joinpath(*parts[:i]) for i in range(len(parts) + 1))
    except (OSError, ValueError):
        return []
    headroom = []
    for directory in paths:
        for limit_file, usage_file, inactive in _CGROUP_FILES:
            limit = _read_int(directory / limit_file)
            usage = _read_int(directory / usage_file)
            if limit is None or usage is None or limit >= _UNLIMITED:
                continue
            stat = _read_fields(directory / "memory.stat", scale=1)
            headroom.append(limit - usage + stat.get(inactive, 0))
    return headroom


def _read_int(path: Path) -> int | None:
    """An integer file (``None``: missing, unreadable, or ``max``)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_fields(path: Path, scale: int = 1024) -> dict[str, int]:
    """``name value`` lines (``/proc`` in kB: ``scale`` 1024) as bytes."""
    fields = {}
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.replace(":", " ", 1).partition(" ")
            words = rest.split()
            if words and words[0].isdigit():
                fields[name] = int(words[0]) * scale
    except OSError:
        pass
    return fields


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per entry of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def uses_subset_solver(size: int, top_k: int | None, device: torch.device) -> bool:
    """Whether the dense solver computes only the leading ``top_k`` (``None``: all).

    On the CPU for at most :data:`PARTIAL_FRACTION` of the pairs (LAPACK's MRRR).
    """
    return (
        top_k is not None and device.type == "cpu" and top_k <= PARTIAL_FRACTION * size
    )


def dense_workspace_bytes(
    size: int, top_k: int | None, dtype: torch.dtype, device: torch.device
) -> int:
    """Bytes the dense eigensolver needs on top of a ``size × size`` Gram matrix."""
    subset = uses_subset_solver(size, top_k, device)
    squares = _EXTRA_SQUARES_PER_SUBSET if subset else _EXTRA_SQUARES_PER_DECOMPOSITION
    return squares * size**2 * itemsize(dtype)


def gram_bytes(
    size: int, num_grams: int, workspace_bytes: int, dtype: torch.dtype
) -> int:
    """Peak bytes of forming ``num_grams`` Gram matrices and an eigensolver on one."""
    square = size**2 * itemsize(dtype)
    formation = _EXTRA_SQUARES_PER_FORMATION * square  # the larger temporaries count
    return num_grams * square + max(workspace_bytes, formation)


def check_gram_fits(
    num_rows: int,
    num_groups: int,
    dtype: torch.dtype,
    device: torch.device,
    workspace_bytes: int | None = None,
) -> None:
    """Raise if ``num_groups`` Gram matrices and their eigensolver would not fit.

    Args:
        num_rows: Side length ``N·C`` (``N·M`` with MC) of each Gram matrix.
        num_groups: Gram matrices held at once (``0``: none formed, nothing to check).
        dtype: Their data type.
        device: Their device.
        workspace_bytes: The eigensolver's memory on top of the Gram matrices
            (default: a full dense decomposition).

    Raises:
        GramTooLargeError: If the estimate exceeds the available memory.
    """
    if num_groups == 0:
        return
    if workspace_bytes is None:
        workspace_bytes = dense_workspace_bytes(num_rows, None, dtype, device)
    needed = gram_bytes(num_rows, num_groups, workspace_bytes, dtype)
    available = available_bytes(device)
    if needed > available:
        raise GramTooLargeError(
            f"The Gram matrices need about {needed / 2**30:.2f} GiB "
            f"({num_groups} group(s) of {num_rows} x {num_rows} entries in {dtype}, "
            "plus the eigensolver's workspace), but only "
            f"{available / 2**30:.2f} GiB "
            f"are available on {device}. Reduce the side length N·C: Monte-Carlo "
            "sample the loss Hessian (mc_samples=1 gives N columns instead of N·C), "
            "subsample the curvature (subsampling=[...]), or use a smaller "
            "mini-batch; for a few leading eigenpairs, LowRankGGN(..., "
            "solver='factor_krylov') never forms the Gram matrix."
        )
