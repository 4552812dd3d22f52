"""Data-parallel Newton training and the held-out spectrum, on several processes.

Run from the repository root (gloo on CPU; NCCL where every rank has a GPU)::

    torchrun --nproc_per_node 2 exp/distributed_spectrum.py
    torchrun --nproc_per_node 2 exp/distributed_spectrum.py --check

Every rank builds the same MLP on the bundled digits (``exp/studies``), wraps it
in ``DistributedDataParallel`` and trains it with :class:`vivit.optim.DampedNewton`
(``--steps`` steps, each on a batch of ``--batch-size`` training samples split
into one shard per rank). Then every rank passes its shard of the held-out set
(contiguous, sizes differing by at most one) to :class:`vivit.LowRankGGN`; all
ranks get the top ``--top-k`` eigenvalues of the GGN of the mean loss over the
whole held-out set. Rank 0 prints them with the bytes each rank sent;
``--check`` has rank 0 recompute them in one process on the concatenated set
(``process_group=False``) and report the largest deviation.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from studies.data import load_dataset  # noqa: E402
from studies.models import mlp  # noqa: E402

from vivit import LowRankGGN  # noqa: E402
from vivit.optim import DampedNewton  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="Newton steps (5)")
    parser.add_argument("--batch-size", type=int, default=128, help="union (128)")
    parser.add_argument("--top-k", type=int, default=10, help="eigenvalues (10)")
    parser.add_argument("--check", action="store_true", help="compare on rank 0")
    parser.add_argument("--seed", type=int, default=0, help="model and data (0)")
    return parser.parse_args(argv)


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous part of a tensor (sizes differ by at most one)."""
    return tensor.tensor_split(world_size)[rank]


def main(argv: list[str] | None = None) -> None:
    """Train, compute the held-out spectrum, print it on rank 0."""
    args = parse(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60)
    )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        data = load_dataset(None, test_fraction=0.2, seed=args.seed).to(
            device, torch.float32
        )
        torch.manual_seed(args.seed)
        model = mlp(data.input_shape, data.num_classes).to(device)
        loss_func = nn.CrossEntropyLoss()
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = DampedNewton(
            ddp.parameters(), damping=1e-2, model=ddp, loss_func=loss_func
        )
        order = torch.randperm(
            data.train_inputs.shape[0], generator=torch.Generator().manual_seed(1)
        )
        for step in range(args.steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            loss = optimizer.step(
                data=(
                    shard(data.train_inputs[batch], rank, world_size),
                    shard(data.train_targets[batch], rank, world_size),
                )
            )
            if rank == 0:
                print(f"Newton step {step}: loss on the union batch {loss:.4f}")

        held_out = (data.test_inputs, data.test_targets)
        mine = tuple(shard(t, rank, world_size) for t in held_out)
        ggn = LowRankGGN(model, loss_func, mine, gram_dtype=torch.float64)
        evals, _ = ggn.eigh(top_k=args.top_k)
        report = ggn.communication
        if rank == 0:
            print(
                f"{world_size} ranks, held-out set of {len(data.test_targets)} "
                f"samples (rank 0: {len(mine[1])}); loss {ggn.loss:.4f}"
            )
            print(f"top-{args.top_k} eigenvalues:", [f"{v:.4e}" for v in evals.flip(0)])
            print(
                f"bytes per rank (tensors): {report.payload_bytes}; buffer "
                f"{report.buffer_bytes}, sent {report.sent_bytes}, metadata "
                f"{report.metadata_bytes}; exchange {report.seconds:.3f} s"
            )
            if args.check:
                single = LowRankGGN(
                    model,
                    loss_func,
                    held_out,
                    gram_dtype=torch.float64,
                    process_group=False,
                )
                reference, _ = single.eigh(top_k=args.top_k)
                deviation = ((evals - reference).abs() / reference).max().item()
                print(f"largest relative deviation from one process: {deviation:.1e}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
