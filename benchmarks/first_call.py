"""The first call of a process under ``route="auto"``: the plan's measurement included.

For each problem, in a fresh process (one thread): ``LowRankGGN(model, loss_func,
(X, y))`` then ``eigh(top_k=10)``, wall-clock seconds of the construction (which
measures the request on a copy of the model, ``docs/math.rst``, "Memory of a
request") and of both, against one forward+backward pass, with the route taken and
why. Printed as a table; ``--json FILE`` also writes the rows.

Run: ``python benchmarks/first_call.py --problems gpt2-2l-64-v128:4 mlp-relu:16
3c3d:32 char-lstm:32``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path


def one(name: str, samples: int) -> dict[str, object]:
    """The first call's times in this process (call it in a fresh one)."""
    import torch
    from problems import make_problem

    from vivit import LowRankGGN

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, loss_func, X, y = make_problem(name, samples, 0, torch.device("cpu"))
    start = time.perf_counter()
    ggn = LowRankGGN(model, loss_func, (X, y))
    constructed = time.perf_counter() - start
    ggn.eigh(top_k=10)
    total = time.perf_counter() - start
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        model.zero_grad()
        loss_func(model(X), y).backward()
        passes.append(time.perf_counter() - start)
    return {
        "problem": name, "samples": samples, "construct_s": constructed,
        "total_s": total, "forward_backward_s": min(passes),
        "route": ggn.plan.route, "reason": ggn.plan.reason,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["gpt2-2l-64-v128:4"],
                        help="NAME:SAMPLES, each run in a fresh process")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's NAME:SAMPLES
    args = parser.parse_args()
    if args.one:
        name, samples = args.one.split(":")
        print(json.dumps(one(name, int(samples))))
        return
    rows = []
    for problem in args.problems:
        child = subprocess.run(
            [sys.executable, __file__, "--one", problem],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows.append(json.loads(child.stdout.splitlines()[-1]))
    print(f"{'problem':18s} {'N':>4s} {'construct s':>12s} {'+ eigh s':>9s} "
          f"{'× fwd+bwd':>10s}  route")  # fmt: skip
    for r in rows:
        ratio = r["total_s"] / r["forward_backward_s"]
        print(
            f"{r['problem']:18s} {r['samples']:4d} {r['construct_s']:12.2f} "
            f"{r['total_s']:9.2f} {ratio:10.0f}  {r['route']}: {r['reason']}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
