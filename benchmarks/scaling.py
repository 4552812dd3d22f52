"""Strong and weak scaling of the GGN over several processes (gloo, CPU).

```
python benchmarks/scaling.py                       # 1 and 2 processes
python benchmarks/scaling.py --world-sizes 1 2 4 --strong 128 256 --weak 64
```

For each world size ``W`` the script starts ``W`` processes (one thread each,
``OMP_NUM_THREADS=1``) in a gloo group; every process runs every case on its
shard and rank 0 records the time of each phase:

- ``backward``: the construction of ``LowRankGGN`` on the rank's shard minus
  the exchange and the Gram matrix (the agreement round and the engine's
  backward pass);
- ``exchange``: the shard round and the all-gather of the factors
  (``ggn.communication.seconds``; includes waiting for the slowest rank);
- ``gram``: forming the union's Gram matrix: with several processes at
  construction, each rank its share of the blocks plus their all-gather
  (``ggn.communication.gram_seconds``); in one process ``ggn.gram()``;
- ``solver``: the top-10 eigenpairs of the formed Gram matrix
  (``solver="gram_krylov"``).

Strong scaling: the union batch ``N`` is fixed, each rank holds ``N / W``
samples. Weak scaling: each rank holds ``n`` samples, the union ``W·n``. The
Gram matrix has side ``N·C`` (``C = 10``). Bytes: the tensors each rank sends
(``payload_bytes``) against the cost model of ``docs/math.rst`` ("Several
processes"), which for the MLP here is ``β [N_r Σ_ℓ (2 I_ℓ + 2 (C+1) O_ℓ) +
1]``. Writes ``benchmarks/results/scaling-<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from vivit.distributed import gram_block_owners

HERE = Path(__file__).resolve().parent
CLASSES = 10
TOP_K = 10
#: ``V`` replaces the factors where it is this many times smaller (BackPACK).
COMPACT_RATIO = 4

#: Per problem: input shape, and per weight ``(T, I, O)`` (positions, input
#: features per position, output features), each with a bias of ``O``.
PROBLEMS = {
    "mlp": ((784,), [(1, 784, 128), (1, 128, 64), (1, 64, 10)]),
    "cnn": ((3, 32, 32), [(1024, 27, 16), (256, 144, 32), (1, 2048, 10)]),
}


DESCRIPTIONS = {
    "mlp": "MLP 784-128-64-10 (ReLU)",
    "cnn": "CNN on 3×32×32 (conv 3→16, pool, conv 16→32, pool, linear 2048→10)",
}


def build_model(problem: str) -> nn.Module:
    """MLP 784-128-64-10 or CNN (two 3×3 convolutions, max-pool) with ReLU."""
    torch.manual_seed(0)
    if problem == "mlp":
        layers: list[nn.Module] = []
        for _, i, o in PROBLEMS["mlp"][1]:
            layers += [nn.Linear(i, o), nn.ReLU()]
        return nn.Sequential(*layers[:-1]).eval()
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),  # 16×32×32
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16×16×16
        nn.Conv2d(16, 32, 3, padding=1),  # 32×16×16
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32×8×8
        nn.Flatten(),
        nn.Linear(2048, CLASSES),
    ).eval()


def shard(
    problem: str, size: int, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of a union batch of ``size`` random samples."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(size, *PROBLEMS[problem][0], generator=generator)
    targets = torch.randint(0, CLASSES, (size,), generator=generator)
    return inputs.tensor_split(world_size)[rank], targets.tensor_split(world_size)[rank]


def cost_model_bytes(problem: str, samples: int, columns: int, element: int = 4) -> int:
    """Bytes a rank with ``samples`` samples sends (``docs/math.rst``).

    A weight's factors (GGN: ``C`` columns, gradient: one) are held as layer
    inputs and backpropagated vectors, ``N (T I + c T O)``, or densely,
    ``N c I O``, where that is ``COMPACT_RATIO`` times smaller (the BackPACK
    engine's rule); a bias densely, ``N c O``. Plus the loss.
    """
    numbers = 1
    for T, I, O in PROBLEMS[problem][1]:
        for c in (columns, 1):
            factors, dense = T * I + c * T * O, c * I * O
            compact = COMPACT_RATIO * dense <= factors
            numbers += samples * (dense if compact else factors)
            numbers += samples * c * O
    return element * numbers


def gram_cost_model_bytes(sizes: list[int], element: int = 4) -> int:
    """Length of each rank's buffer of Gram blocks (the largest share, bytes).

    Blocks ``(a, b)``, ``a ≤ b``, round robin over the ranks; a diagonal block
    sends its upper triangle (``docs/math.rst``, "Several processes").
    """
    if len(sizes) == 1:
        return 0
    rows = sizes
    owners = gram_block_owners(len(rows), len(rows))

    def entries(a: int, b: int) -> int:
        return rows[a] * (rows[a] + 1) // 2 if a == b else rows[a] * rows[b]

    return element * max(sum(entries(a, b) for a, b in o) for o in owners)


def cases(args: argparse.Namespace, world_size: int) -> list[tuple[str, int]]:
    """``(mode, union batch size)`` of every case of a world size."""
    return [("strong", n) for n in args.strong] + [
        ("weak", n * world_size) for n in args.weak
    ]


def worker(args: argparse.Namespace) -> None:
    """One rank: every case, ``--repeats`` times after a warm-up."""
    from vivit import LowRankGGN

    rank, world_size = args.rank, args.world
    if world_size > 1:
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"file://{args.rendezvous}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=300),
        )
    model, loss_func = build_model(args.problem), nn.CrossEntropyLoss()
    columns = args.mc_samples or CLASSES
    records = []
    for mode, size in cases(args, world_size):
        data = shard(args.problem, size, rank, world_size)
        sizes = [len(part) for part in torch.arange(size).tensor_split(world_size)]
        for repeat in range(-1, args.repeats):  # -1: warm-up
            if world_size > 1:
                torch.distributed.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            ggn = LowRankGGN(
                model,
                loss_func,
                data,
                mc_samples=args.mc_samples,
                generator=torch.Generator().manual_seed(repeat + 1),
            )
            built, built_cpu = time.perf_counter(), time.process_time()
            ggn.gram()
            formed = time.perf_counter()
            ggn.eigh(TOP_K, solver="gram_krylov")
            solved = time.perf_counter()
            report = ggn.communication
            exchange = report.seconds + report.gram_seconds
            if repeat < 0:
                continue
            records.append(
                {
                    "mode": mode,
                    "world_size": world_size,
                    "union_samples": size,
                    "rank_samples": len(data[1]),
                    "gram_side": size * columns,
                    "repeat": repeat,
                    "backward_s": built - start - exchange,
                    "construction_cpu_s": built_cpu - cpu,
                    "exchange_s": report.seconds,
                    "gram_s": formed - built + report.gram_seconds,
                    "solver_s": solved - formed,
                    "total_s": solved - start,
                    "payload_bytes": report.payload_bytes,
                    "buffer_bytes": report.buffer_bytes,
                    "gram_buffer_bytes": report.gram_buffer_bytes,
                    "gram_cost_model_bytes": gram_cost_model_bytes(
                        [n * columns for n in sizes]
                    ),
                    "sent_bytes": report.sent_bytes,
                    "metadata_bytes": report.metadata_bytes,
                    "cost_model_bytes": [
                        cost_model_bytes(args.problem, n, columns) for n in sizes
                    ],
                }
            )
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def _spin(seconds: list[float]) -> None:
    a = torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(100):
        a @ a
    seconds.append(time.perf_counter() - start)


def parallel_capacity() -> float:
    """How much slower two single-thread processes run side by side than one.

    ``1``: the machine gives the second process a core of its own; ``2``: the
    two share one core's worth (other load, or the same physical core).
    """
    code = (
        "import sys, time, torch; sys.path.insert(0, sys.argv[1]); "
        "torch.set_num_threads(1); import scaling; s = []; scaling._spin(s); "
        "print(s[0])"
    )
    run = [sys.executable, "-c", code, str(HERE)]
    alone = float(subprocess.run(run, capture_output=True, text=True).stdout)
    pair = [subprocess.Popen(run, stdout=subprocess.PIPE, text=True) for _ in "ab"]
    together = [float(p.communicate()[0]) for p in pair]
    return statistics.mean(together) / alone


def launch(args: argparse.Namespace, world_size: int) -> list[dict]:
    """Run every case on ``world_size`` processes; rank 0's records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        command = [
            sys.executable,
            __file__,
            "--worker",
            "--world",
            str(world_size),
            "--rendezvous",
            str(Path(tmp) / "rendezvous"),
            "--out",
            str(out),
            "--repeats",
            str(args.repeats),
            "--problem",
            args.problem,
            "--mc-samples",
            str(args.mc_samples),
            "--strong",
            *map(str, args.strong),
            "--weak",
            *map(str, args.weak),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        processes = [
            subprocess.Popen([*command, "--rank", str(rank)], env=env)
            for rank in range(world_size)
        ]
        codes = [process.wait() for process in processes]
        if any(codes):
            raise SystemExit(f"a rank failed (exit codes {codes})")
        return json.loads(out.read_text())


def summarize(records: list[dict]) -> list[dict]:
    """Median of every phase per (mode, world size, union size)."""
    keys = sorted(
        {(r["mode"], r["union_samples"], r["world_size"]) for r in records},
        key=lambda k: (k[0] != "strong", k[1], k[2]),
    )
    rows = []
    for mode, size, world_size in keys:
        group = [
            r
            for r in records
            if (r["mode"], r["union_samples"], r["world_size"])
            == (mode, size, world_size)
        ]
        row = {k: group[0][k] for k in ("mode", "world_size", "union_samples")}
        row.update(
            {k: group[0][k] for k in ("rank_samples", "gram_side", "payload_bytes")}
        )
        row.update(
            {k: group[0][k] for k in ("buffer_bytes", "sent_bytes", "metadata_bytes")}
        )
        for k in ("cost_model_bytes", "gram_buffer_bytes", "gram_cost_model_bytes"):
            row[k] = group[0][k]
        for phase in (
            "backward_s",
            "exchange_s",
            "gram_s",
            "solver_s",
            "total_s",
            "construction_cpu_s",
        ):
            row[phase] = statistics.median(r[phase] for r in group)
        rows.append(row)
    for row in rows:  # strong: speedup over 1 process; weak: efficiency
        same = "union_samples" if row["mode"] == "strong" else "rank_samples"
        base = next(
            (
                r
                for r in rows
                if r["world_size"] == 1
                and r["mode"] == row["mode"]
                and r[same] == row[same]
            ),
            None,
        )
        row["vs_one_process"] = base["total_s"] / row["total_s"] if base else None
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    """The table of the summaries."""
    lines = [
        "# Scaling over processes (gloo, CPU)",
        "",
        f"`{meta['command']}` on {meta['machine']}, torch {meta['torch']}, "
        f"{meta['date']}. {meta['problem']}, cross-entropy, float32, "
        f"{meta['ggn']}, top-{TOP_K} eigenpairs (iterative solver on the formed "
        "Gram matrix); "
        "one thread per process; median of "
        f"{meta['repeats']} repeats; times of rank 0 in seconds.",
        "",
        "Two independent single-thread processes ran "
        f"{meta['parallel_slowdown'][0]:.2f}× (before) and "
        f"{meta['parallel_slowdown'][1]:.2f}× (after) slower than one alone: "
        "1.00 means a free core for the second rank.",
        "",
        "Strong: the union batch N is fixed (speedup = 1-process total / total). "
        "Weak: n samples per rank (efficiency = 1-process total at n / total).",
        "",
        "| mode | W | N (union) | n (rank 0) | Gram side | backward | exchange "
        "| Gram | solver | total | speedup / efficiency | construction CPU "
        "| rank 0's factors [B] "
        "| cost model [B] | Gram buffer [B] | cost model [B] "
        "| sent by rank 0 [B] | metadata [B] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "" if r["vs_one_process"] is None else f"{r['vs_one_process']:.2f}"
        lines.append(
            f"| {r['mode']} | {r['world_size']} | {r['union_samples']} | "
            f"{r['rank_samples']} | {r['gram_side']} | {r['backward_s']:.3f} | "
            f"{r['exchange_s']:.3f} | {r['gram_s']:.3f} | {r['solver_s']:.3f} | "
            f"{r['total_s']:.3f} | {ratio} | {r['construction_cpu_s']:.3f} | "
            f"{r['payload_bytes'][0] if r['world_size'] > 1 else 0:,} | "
            f"{r['cost_model_bytes'][0] if r['world_size'] > 1 else 0:,} | "
            f"{r['gram_buffer_bytes']:,} | {r['gram_cost_model_bytes']:,} | "
            f"{r['sent_bytes']:,} | {r['metadata_bytes']:,} |"
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--strong", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--weak", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--problem", choices=sorted(PROBLEMS), default="mlp")
    parser.add_argument("--mc-samples", type=int, default=0, help="0: exact")
    parser.add_argument("--name", default="vm", help="results/scaling-NAME.*")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run every world size, write JSON and markdown, print the table."""
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    capacity_before = parallel_capacity()
    records = [r for w in args.world_sizes for r in launch(args, w)]
    capacity = [capacity_before, parallel_capacity()]
    rows = summarize(records)
    meta = {
        "parallel_slowdown": capacity,
        "command": "python benchmarks/scaling.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()} ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "repeats": args.repeats,
        "problem": DESCRIPTIONS[args.problem],
        "ggn": f"MC GGN, {args.mc_samples} samples" if args.mc_samples else "exact GGN",
    }
    results = HERE / "results"
    (results / f"scaling-{args.name}.json").write_text(
        json.dumps({"meta": meta, "summaries": rows, "records": records}, indent=1)
    )
    table = markdown(rows, meta)
    (results / f"scaling-{args.name}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
