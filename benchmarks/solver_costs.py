"""Calibration of ``solver="auto"``: where the time of each top-k solver goes.

For each (problem, N), in this process, CPU time (``time.process_time``; the
machine may be shared, CPU time does not count waiting for a core) of

- ``backward``: ``LowRankGGN(...)`` (forward and backward pass, factors kept);
- ``gram``: forming the Gram matrix from the factors;
- ``dense`` / ``gram_krylov``: ``eigh(top_k)`` on the formed Gram matrix;
- ``factor_krylov``: ``eigh(top_k)`` through the factors (no Gram matrix);

the minimum over ``--repeats`` calls after one warm-up, printed with the cost
model's predictions (:func:`vivit.memory.costs.solver_works`) and the rate
(multiply-adds per CPU second) each part reached.

Run: ``python benchmarks/solver_costs.py --problems mlp-relu 3c3d --threads 1``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from problems import make_problem

from vivit import LowRankGGN
from vivit.memory.costs import choose_solver, solver_works

#: (problem, N) pairs measured by default.
CASES = {
    "mlp-relu": (128, 256, 512, 1024),
    "3c3d": (16, 32, 64),
}


def cpu_time(function, repeats: int) -> tuple[float, object]:
    """Smallest CPU time of ``function()`` over ``repeats`` calls after a warm-up."""
    result = function()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        result = function()
        best = min(best, time.process_time() - start)
    return best, result


def measure(
    problem: str, batch_size: int, top_k: int, repeats: int, mc_samples: int
) -> dict:
    """CPU times and model predictions of one case."""
    model, loss_func, X, y = make_problem(problem, batch_size, 0, torch.device("cpu"))
    data = (X, y)
    # solver="dense" keeps the Gram route (whose solvers this measures); every
    # eigh below names its solver
    backward, ggn = cpu_time(
        lambda: LowRankGGN(
            model, loss_func, data, mc_samples=mc_samples, solver="dense"
        ),
        repeats,
    )
    factors = ggn._group(0).ggn_factors
    size = factors[0].num_rows

    def gram():
        ggn._group(0).gram = None
        return ggn.gram()

    times = {"backward": backward}
    times["gram"], _ = cpu_time(gram, repeats)
    for solver in ("gram_krylov", "factor_krylov", "dense"):

        def solve(solver=solver):
            ggn._leading.clear()  # benchmark only: drop the cached pairs
            return ggn.eigh(top_k=top_k, solver=solver)

        times[solver], _ = cpu_time(solve, repeats)
    predicted = solver_works(factors, top_k, factors[0].dtype)
    predicted["gram"] = predicted.pop("formation")
    auto = choose_solver(factors, top_k, factors[0].dtype, X.device)
    return {
        "problem": problem,
        "N": batch_size,
        "mc_samples": mc_samples,
        "size": size,
        "cpu_seconds": times,
        "predicted_madds": predicted,
        "rate": {k: predicted[k] / times[k] for k in predicted if times[k] > 0},
        "auto": auto,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(CASES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--mc-samples", type=int, default=0, help="Monte-Carlo GGN (0: exact)"
    )
    parser.add_argument("--output", default=None, help="JSON lines file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    records = []
    for problem in args.problems:
        for batch_size in args.batch_sizes or CASES[problem]:
            record = measure(
                problem, batch_size, args.top_k, args.repeats, args.mc_samples
            )
            records.append(record)
            t, r = record["cpu_seconds"], record["rate"]
            totals = {
                "dense": t["gram"] + t["dense"],
                "gram_krylov": t["gram"] + t["gram_krylov"],
                "factor_krylov": t["factor_krylov"],
            }
            best = min(totals, key=totals.get)
            print(
                f"{problem} N={batch_size} R={record['size']}: backward "
                f"{t['backward']:.3f} s; gram {t['gram']:.3f} s; dense "
                f"{t['dense']:.3f} s; iterative {t['gram_krylov']:.3f} s; matrix-free "
                f"{t['factor_krylov']:.3f} s | after the backward pass: "
                + ", ".join(f"{k} {v:.3f}" for k, v in totals.items())
                + f" → fastest {best}, auto {record['auto']} | rates [GMAdd/s]: "
                + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in r.items()),
                flush=True,
            )
    if args.output:
        with open(args.output, "w") as file:
            for record in records:
                file.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
