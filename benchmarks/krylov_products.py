"""Products the block Krylov solver needs, on spectra that force restarts.

For each test spectrum (a random orthogonal basis, seeded, with the eigenvalues
below), dtype and ``k``: the products with the matrix and the cycles
``block_krylov_eigh`` needs to reach its default tolerance, the largest error of
the ``k`` eigenvalues, the same with restarts from only ``b`` Ritz vectors
(``restart_size`` forced to ``b``: the thin restart the thick one replaced; it
may not converge within the solver's 31 cycles), and with the implicit route's
narrow block (``solver_block_size("ggn_krylov", …)``; ``w`` marks a solve that
``narrow_block_doubt`` widened, its count both solves'). The ``copies``
spectrum has a leading eigenvalue of multiplicity 3, which a narrow block alone
would miss. The products count the work of a solve independently of the
machine.

Run: ``python benchmarks/krylov_products.py [--size 1500]
[--output benchmarks/results/krylov-products.json]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from unittest import mock

import torch
from torch import Tensor

from vivit import SolverNotConvergedError
from vivit.linalg import iterative
from vivit.linalg.top_k import solver_block_size

TOP_K = (1, 3, 10)
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def spectra(size: int) -> dict[str, Tensor]:
    """The eigenvalues of the test matrices, descending."""
    line = torch.linspace(1, 0, size, dtype=torch.float64)
    cluster = torch.cat(
        [
            torch.linspace(1, 0.95, 20, dtype=torch.float64),
            torch.linspace(0.9, 0, size - 20, dtype=torch.float64),
        ]
    )
    copies = torch.cat(
        [
            torch.full((3,), 2.0, dtype=torch.float64),
            torch.linspace(1, 0, size - 3, dtype=torch.float64),
        ]
    )
    return {
        "linspace(1, 0)^2": line**2,
        "linspace(1, 0)": line,
        "cluster": cluster,
        "copies": copies,
    }


def psd_matrix(evals: Tensor, seed: int = 0) -> Tensor:
    """``Q diag(evals) Qᵀ`` for a random orthogonal ``Q``."""
    generator = torch.Generator().manual_seed(seed)
    size = evals.numel()
    basis = torch.randn(size, size, generator=generator, dtype=torch.float64)
    q, _ = torch.linalg.qr(basis)
    return (q * evals) @ q.T


def solve(
    matmul: Callable[[Tensor], Tensor],
    size: int,
    k: int,
    dtype,
    block_size: int | None = None,
) -> dict:
    """Products, cycles and eigenvalues of one solve (``None`` if not converged)."""
    try:
        evals, _, report = iterative.block_krylov_eigh(
            matmul, size, k, dtype=dtype, block_size=block_size
        )
    except SolverNotConvergedError:
        return {"products": None, "cycles": None, "evals": None, "widened": None}
    return {
        "products": report.products,
        "cycles": report.cycles,
        "evals": evals,
        "widened": report.widened,
    }


def cell(result: dict) -> str:
    """``products (cycles)``, ``w`` if widened, or that the solve did not converge."""
    if result["products"] is None:
        return "not converged"
    widened = " w" if result["widened"] else ""
    return f"{result['products']} ({result['cycles']}){widened}"


def largest_error(result: dict, evals: Tensor, k: int) -> float:
    """Largest error of the ``k`` leading eigenvalues (``inf`` if not converged)."""
    if result["evals"] is None:
        return float("inf")
    return (result["evals"].double() - evals[:k].flip(0)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1500)
    parser.add_argument("--output", default=None, help="JSON file for the records")
    args = parser.parse_args()
    records = []
    print(
        "| spectrum | dtype | k | products (cycles), thick | thin | largest error "
        "| narrow b | products (cycles) | largest error |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, evals in spectra(args.size).items():
        matrix = psd_matrix(evals)
        for dtype_name, dtype in DTYPES.items():
            operator = matrix.to(dtype)
            for k in TOP_K:
                thick = solve(operator.__matmul__, args.size, k, dtype)
                with mock.patch.object(
                    iterative, "restart_size", lambda top_k, width, capacity: width
                ):
                    thin = solve(operator.__matmul__, args.size, k, dtype)
                width = solver_block_size("ggn_krylov", k, args.size)
                narrow = solve(operator.__matmul__, args.size, k, dtype, width)
                error = largest_error(thick, evals, k)
                narrow_error = largest_error(narrow, evals, k)
                print(
                    f"| {name} | {dtype_name} | {k} | {cell(thick)} | {cell(thin)} | "
                    f"{error:.1e} | {width} | {cell(narrow)} | {narrow_error:.1e} |"
                )
                records.append(
                    {
                        "spectrum": name,
                        "dtype": dtype_name,
                        "top_k": k,
                        "size": args.size,
                        "thick": {key: thick[key] for key in ("products", "cycles")},
                        "thin": {key: thin[key] for key in ("products", "cycles")},
                        "largest_error": error,
                        "narrow": {
                            "block_size": width,
                            "products": narrow["products"],
                            "cycles": narrow["cycles"],
                            "widened": narrow["widened"],
                            "largest_error": narrow_error,
                        },
                    }
                )
    if args.output:
        with open(args.output, "w") as file:
            json.dump(records, file, indent=1)
        print(f"Results written to {args.output}")


if __name__ == "__main__":
    main()
