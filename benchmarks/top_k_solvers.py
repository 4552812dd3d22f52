"""Benchmark: the top-k eigensolvers of LowRankGGN against each other.

Exact top-``k`` eigenpairs of the mini-batch GGN of the MLP 784-128-64-10 (the model
of ``benchmarks/eigenpairs.py``), cross-entropy, float32, random data. For every
solver (``dense``, ``iterative``, ``matrix_free``, ``auto``), in this process:

- ``total``: ``LowRankGGN(...)`` plus ``eigh(top_k)``, a fresh object each time;
- ``eigh``: ``eigh(top_k)`` alone on an object whose Gram matrix is already formed
  (not for ``matrix_free``, which never forms it), i.e. the solver's own cost.

One warm-up call, then ``--repeats`` timed calls (``time.perf_counter``); medians
are printed with the largest relative deviation of the eigenvalues from the dense
solver's and the solver report (residual, Krylov cycles, products).

Run: ``python benchmarks/top_k_solvers.py [--batch-size 512] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from vivit import LowRankGGN

SOLVERS = ("dense", "gram_krylov", "factor_krylov", "auto")


def mlp() -> nn.Module:
    """MLP 784-128-64-10 with ReLU (as in ``benchmarks/eigenpairs.py``)."""
    return nn.Sequential(
        nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def timed(function, repeats: int) -> tuple[float, object]:
    """Median wall time of ``function()`` over ``repeats`` calls after a warm-up."""
    result = function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, loss_func = mlp(), nn.CrossEntropyLoss()
    X = torch.randn(args.batch_size, 784)
    y = torch.randint(0, 10, (args.batch_size,))
    data = (X, y)
    k = args.top_k
    print(
        f"MLP 784-128-64-10, N={args.batch_size}, Gram {args.batch_size * 10}², "
        f"top-{k}, float32, {args.threads} thread(s), median of {args.repeats}"
    )
    reference = None
    print("| solver | total (s) | eigh alone (s) | max rel. eval dev. | report |")
    print("|---|---|---|---|---|")
    for solver in SOLVERS:

        def total(solver=solver):
            ggn = LowRankGGN(model, loss_func, data, solver=solver)
            return ggn.eigh(top_k=k)[0], ggn.solver_report()

        total_time, (evals, report) = timed(total, args.repeats)
        eigh_time = float("nan")
        if solver != "factor_krylov":
            ggn = LowRankGGN(model, loss_func, data, solver=solver)
            ggn.gram()

            def eigh_only(ggn=ggn, solver=solver):
                ggn._leading.clear()  # benchmark only: drop the cached pairs
                return ggn.eigh(top_k=k, solver=solver)[0]

            eigh_time, _ = timed(eigh_only, args.repeats)
        if reference is None:
            reference = evals.double()
        deviation = ((evals.double() - reference).abs() / reference.abs()).max()
        print(
            f"| {solver} | {total_time:.3f} | {eigh_time:.3f} | {deviation:.1e} | "
            f"{report.solver}, residual {report.residual:.1e}, cycles "
            f"{report.cycles}, products {report.products} |"
        )


if __name__ == "__main__":
    main()
