"""FSDP2 against data parallelism: memory per rank and the time of a product.

Each mode runs in fresh processes, one per rank of a gloo group on this machine:
``ddp`` (every rank holds the model whole, the data-parallel route) and ``fsdp``
(``fully_shard`` on every block of the model and on the root; the curvature runs on
the gathered twin, ``docs/math.rst``, "Models sharded with FSDP2"). Every rank
passes its share of one batch; the request is ``LowRankGGN(...)`` and
``eigh(top_k)`` at the library's default tolerance. Per rank: the peak memory
increase of the request (``VmHWM``, see ``measure.py``), the parameters it holds
before the request, the construction's and the solve's seconds, products and
seconds per product. Prints a table and writes ``results/fsdp-<problem>.json``::

    python benchmarks/fsdp.py --problem gpt2-4l-128-v500 --batch 8 --world 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from measure import PeakMemory  # noqa: E402
from problems import make_problem  # noqa: E402

MODES = ("ddp", "fsdp")


def rank_run(rank: int, args: argparse.Namespace, mode: str, port: int, out: str):
    """One rank of one mode: the request, measured; saved to ``out/rank.json``."""
    from torch.distributed.fsdp import fully_shard

    from vivit import LowRankGGN

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    model, loss_func, inputs, targets = make_problem(
        args.problem, args.batch, 0, torch.device("cpu")
    )
    if mode == "fsdp":
        for block in getattr(model, "blocks", []):
            fully_shard(block)
        fully_shard(model)
    held = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in model.parameters()
    )
    share = slice(
        rank * args.batch // args.world, (rank + 1) * args.batch // args.world
    )
    dist.barrier()
    with PeakMemory(torch.device("cpu")) as peak:
        start = time.perf_counter()
        ggn = LowRankGGN(model, loss_func, (inputs[share], targets[share]))
        built = time.perf_counter()
        evals, _ = ggn.eigh(top_k=args.top_k)
        solved = time.perf_counter()
    report = ggn.solver_report()
    record = {
        "mode": mode,
        "rank": rank,
        "route": ggn.plan.route,
        "params_held_mib": held / 2**20,
        "peak_mib": peak.peak_mib,
        "construct_s": built - start,
        "solve_s": solved - built,
        "products": None if report is None else report.products,
        "top_eigenvalue": float(evals[-1]),
    }
    if record["products"]:
        record["s_per_product"] = record["solve_s"] / record["products"]
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Run both modes, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="gpt2-2l-64-v128")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    records = []
    with tempfile.TemporaryDirectory() as out:
        for index, mode in enumerate(MODES):
            port = 29400 + index + 10 * (os.getpid() % 50)
            mp.spawn(rank_run, args=(args, mode, port, out), nprocs=args.world)
            records += [
                json.loads(Path(out, f"{mode}-{r}.json").read_text())
                for r in range(args.world)
            ]
    columns = [
        "mode", "rank", "route", "params_held_mib", "peak_mib", "construct_s",
        "solve_s", "products", "s_per_product", "top_eigenvalue",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for record in records:
        cells = [record.get(c) for c in columns]
        print(
            "| "
            + " | ".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells)
            + " |"
        )
    path = HERE / "results" / f"fsdp-{args.problem}.json"
    path.write_text(json.dumps({"args": vars(args), "records": records}, indent=1))
    print(f"written {path}")


if __name__ == "__main__":
    main()
