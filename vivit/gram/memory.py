"""Memory of Gram matrices and their dense eigensolver; refuse those that cannot fit.

The facts the run and the estimate share: free memory on a device, bytes per
entry, the dense solver's workspace and the peak of forming Gram matrices.
:func:`check_gram_fits` refuses Gram matrices before they are allocated. The
memory of a whole request (activations, factors, eigensolver) is estimated by
:mod:`vivit.memory`, which builds on these.
"""

from __future__ import annotations

import os

import torch

from vivit.errors import GramTooLargeError

#: Square matrices of the Gram's size alive at once while one is fully decomposed:
#: the Gram, its eigenvectors, and LAPACK's syevd workspace (about two more;
#: measured peak 420 MiB for a 5120 x 5120 float32 Gram, i.e. four squares).
_SQUARES_PER_DECOMPOSITION = 4
#: Squares beyond the Gram for LAPACK's MRRR subset solver (scipy's copy of the
#: matrix and its reduction to tridiagonal form).
_EXTRA_SQUARES_PER_SUBSET = 2
#: Squares beyond the Gram while it is formed: one parameter's block and the
#: contraction's intermediate (measured peak 3 squares for an MLP's Gram).
_EXTRA_SQUARES_PER_FORMATION = 2
#: Requests for at most this fraction of all eigenpairs compute only those (on the
#: CPU, with LAPACK's MRRR subset solver).
PARTIAL_FRACTION = 0.25


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


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per entry of a data type.

    Args:
        dtype: The data type.

    Returns:
        Its size in bytes.
    """
    return torch.empty((), dtype=dtype).element_size()


def uses_subset_solver(size: int, top_k: int | None, device: torch.device) -> bool:
    """Whether the dense solver computes only the leading eigenpairs (CPU, few).

    Args:
        size: Side length ``N·C`` of the Gram matrix.
        top_k: Number of leading eigenpairs (``None``: all).
        device: Device of the Gram matrix.

    Returns:
        ``True`` for LAPACK's MRRR subset solver, ``False`` for the full
        decomposition.
    """
    return (
        top_k is not None and device.type == "cpu" and top_k <= PARTIAL_FRACTION * size
    )


def dense_workspace_bytes(
    size: int, top_k: int | None, dtype: torch.dtype, device: torch.device
) -> int:
    """Memory the dense eigensolver needs on top of the Gram matrix.

    Args:
        size: Side length ``N·C`` of the Gram matrix.
        top_k: Number of leading eigenpairs (``None``: all).
        dtype: Data type of the Gram matrix.
        device: Its device.

    Returns:
        Bytes: 3 more squares for the full decomposition, 2 for the subset solver.
    """
    squares = (
        _EXTRA_SQUARES_PER_SUBSET
        if uses_subset_solver(size, top_k, device)
        else _SQUARES_PER_DECOMPOSITION - 1
    )
    return squares * size**2 * itemsize(dtype)


def gram_bytes(
    size: int, num_grams: int, workspace_bytes: int, dtype: torch.dtype
) -> int:
    """Peak memory of forming Gram matrices and running an eigensolver on one.

    Args:
        size: Side length ``N·C`` of each Gram matrix.
        num_grams: Gram matrices held at once.
        workspace_bytes: The eigensolver's memory on top of the Gram matrices.
        dtype: Data type of the Gram matrices.

    Returns:
        ``num_grams`` squares plus the larger of the workspace and the formation's
        temporaries (:data:`_EXTRA_SQUARES_PER_FORMATION` squares).
    """
    square = size**2 * itemsize(dtype)
    formation = _EXTRA_SQUARES_PER_FORMATION * square
    return num_grams * square + max(workspace_bytes, formation)


def check_gram_fits(
    num_rows: int,
    num_groups: int,
    dtype: torch.dtype,
    device: torch.device,
    workspace_bytes: int | None = None,
) -> None:
    """Raise if the Gram matrices and their eigensolver would not fit into memory.

    Args:
        num_rows: Side length ``N·C`` (``N·M`` with MC) of each Gram matrix.
        num_groups: Number of Gram matrices held at once; ``0`` means that none
            is formed (nothing to check).
        dtype: Data type of the Gram matrix.
        device: Device of the Gram matrix.
        workspace_bytes: The eigensolver's memory on top of the Gram matrices
            (default: a full dense decomposition, :func:`dense_workspace_bytes`).

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
            "solver='matrix_free') never forms the Gram matrix."
        )
