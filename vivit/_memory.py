"""Refuse Gram matrices that would not fit into memory, before they are allocated."""

from __future__ import annotations

import os

import torch

from vivit.errors import GramTooLargeError

#: Square matrices of the Gram's size alive at once while one is decomposed: the
#: Gram, its eigenvectors, and LAPACK's syevd workspace (about two more; measured
#: peak 420 MiB for a 5120 x 5120 float32 Gram, i.e. four squares).
_SQUARES_PER_DECOMPOSITION = 4


def available_bytes(device: torch.device) -> int:
    """Memory that can still be allocated on a device.

    Args:
        device: Device the Gram matrix will live on.

    Returns:
        Free bytes (CUDA: free device memory; CPU: the kernel's ``MemAvailable``,
        or the physical memory where that is not known).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_gram_fits(
    num_rows: int, num_groups: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Raise if the Gram matrices of a backward pass would not fit into memory.

    Args:
        num_rows: Side length ``N·C`` (``N·M`` with MC) of each Gram matrix.
        num_groups: Number of parameter groups, one Gram matrix each.
        dtype: Data type of the Gram matrix.
        device: Device of the Gram matrix.

    Raises:
        GramTooLargeError: If the estimate exceeds the available memory.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    squares = num_groups + _SQUARES_PER_DECOMPOSITION - 1
    needed = squares * num_rows**2 * itemsize
    available = available_bytes(device)
    if needed > available:
        raise GramTooLargeError(
            f"The Gram matrices need about {needed / 2**30:.2f} GiB "
            f"({num_groups} group(s) of {num_rows} x {num_rows} entries in {dtype}, "
            "plus "
            "the eigendecomposition's workspace), but only "
            f"{available / 2**30:.2f} GiB "
            f"are available on {device}. Reduce the side length N·C: Monte-Carlo "
            "sample the loss Hessian (mc_samples=1 gives N columns instead of N·C), "
            "subsample the curvature (subsampling=[...]), or use a smaller mini-batch; "
            "an iterative top-k solver for large N·C is planned."
        )
