"""What every rank of a gloo group runs for ``test_distributed.py``.

Run from the repository root as
``python -m tests.distributed.jobs JOB RANK WORLD_SIZE RENDEZVOUS_FILE OUT_DIR``:
each rank computes every scenario of the job on its shard and saves the results
(``OUT_DIR/rank{RANK}.pt``); the test compares them with the single-process
results on the union and with each other. The scenarios are defined here once,
for the ranks and the single-process references alike.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from unittest import mock

import torch
from torch import Tensor, nn

from tests.distributed.spawn import run_rank
from tests.fixtures.problems import ARCHITECTURES
from vivit import LowRankGGN
from vivit.optim import DampedNewton
from vivit.sources.union import part_generator

#: Shard sizes per world size (uneven on purpose).
SHARDS = {2: (3, 5), 3: (2, 4, 3)}

#: Batch sizes of each rank's loader over its shard (``Scenario.loader``): uneven
#: numbers of uneven batches, none whose every target ``ce_weighted`` ignores. A
#: rank with one batch passes it as a batch, not a loader (ranks may mix both).
LOADERS = {2: ((2, 1), (2, 1, 2)), 3: ((2,), (1, 3), (2, 1))}


@dataclass(frozen=True)
class Scenario:
    """One request on one problem.

    Attributes:
        architecture: Name in ``problems.ARCHITECTURES``.
        loss: ``"ce"``, ``"ce_weighted"`` (class weights and ignored targets) or
            ``"mse"``.
        reduction: ``"mean"`` or ``"sum"``.
        engine: ``"backpack"`` or ``"func"``.
        mc_samples: ``0`` exact, else MC samples per datum.
        layer_groups: One parameter group per layer (else one group).
        subsample: Each rank's GGN samples are every other sample of its shard,
            backwards (local indices).
        solver: The constructor's solver (``"factor_krylov"``: no Gram matrix is
            formed at construction).
        loader: Each rank passes a loader over its shard (batches ``LOADERS``).
        ignored_shard: Every target of rank 0's shard is ignored (cross-entropy):
            its shard carries no weight, the union's mean is still defined.
    """

    architecture: str
    loss: str
    reduction: str
    engine: str
    mc_samples: int = 0
    layer_groups: bool = False
    subsample: bool = False
    solver: str = "auto"
    loader: bool = False
    ignored_shard: bool = False


SCENARIOS = {
    "mlp-ce-backpack-layers-subsampled": Scenario(
        "mlp_tanh", "ce", "mean", "backpack", layer_groups=True, subsample=True
    ),
    "mlp-ce_weighted-func": Scenario("mlp_tanh", "ce_weighted", "mean", "func"),
    "mlp-ce-ignored-shard-backpack": Scenario(
        "mlp_tanh", "ce", "mean", "backpack", ignored_shard=True
    ),
    "conv1d-mse-sum-backpack-mc": Scenario(
        "conv1d", "mse", "sum", "backpack", mc_samples=2
    ),
    "sequence-ce-func-mc-layers": Scenario(
        "sequence_linear", "ce", "mean", "func", mc_samples=3, layer_groups=True
    ),
    "mlp-mse-func-subsampled-matrix-free": Scenario(
        "mlp_relu", "mse", "mean", "func", subsample=True, solver="factor_krylov"
    ),
    "loader-mlp-ce_weighted-backpack": Scenario(
        "mlp_tanh", "ce_weighted", "mean", "backpack", loader=True
    ),
    "loader-sequence-ce-func-layers": Scenario(
        "sequence_linear", "ce", "mean", "func", layer_groups=True, loader=True
    ),
    "loader-conv1d-mse-sum-backpack-mc": Scenario(
        "conv1d", "mse", "sum", "backpack", mc_samples=2, loader=True
    ),
    "loader-mlp-mse-func-mc": Scenario(
        "mlp_relu", "mse", "mean", "func", mc_samples=1, loader=True
    ),
}

#: Scenarios of each job (the three-rank job is shorter: 3 processes on 2 cores).
JOBS = {
    2: list(SCENARIOS),
    3: [
        "mlp-ce-backpack-layers-subsampled",
        "sequence-ce-func-mc-layers",
        "loader-mlp-ce_weighted-backpack",
        "loader-mlp-mse-func-mc",
    ],
}

#: The byte count is checked on this scenario (MLP with Linear layers only).
BYTES_SCENARIO = "mlp-ce_weighted-func"


def setup(scenario: Scenario, world_size: int, seed: int = 0):
    """Model, loss function and every rank's shard, deterministic in ``seed``."""
    arch = next(a for a in ARCHITECTURES if a.name == scenario.architecture)
    total = sum(SHARDS[world_size])
    C = arch.num_outputs
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = arch.build().to(torch.float64).eval()
        inputs = torch.randn(total, *arch.input_shape, dtype=torch.float64)
        targets, loss_func = targets_and_loss(scenario, C, (total,), world_size)
    return model, loss_func, shards_of(inputs, targets, world_size)


def targets_and_loss(
    scenario: Scenario, classes: int, shape: tuple[int, ...], world_size: int
) -> tuple[Tensor, nn.Module]:
    """The scenario's targets (class indices of ``shape``, or regression targets
    ``[N, classes]``) and loss function, drawn from torch's generator."""
    total = shape[0]
    if scenario.loss == "mse":
        targets = torch.randn(total, classes, dtype=torch.float64)
        loss_func = nn.MSELoss(reduction=scenario.reduction)
    else:
        targets = torch.randint(0, classes, shape)
        loss_func = nn.CrossEntropyLoss(reduction=scenario.reduction)
    if scenario.loss == "ce_weighted":
        targets[::3] = -100  # ignored: sample weights differ across ranks
        weight = torch.rand(classes, dtype=torch.float64) + 0.5
        loss_func = nn.CrossEntropyLoss(weight=weight, reduction=scenario.reduction)
    if scenario.ignored_shard:
        targets[: SHARDS[world_size][0]] = -100
    return targets, loss_func


def shards_of(inputs: Tensor, targets: Tensor, world_size: int) -> list:
    """Every rank's ``(inputs, targets)``, consecutive samples of ``SHARDS``."""
    sizes = SHARDS[world_size]
    return list(zip(inputs.split(sizes), targets.split(sizes), strict=True))


def loader(shard: tuple[Tensor, Tensor], sizes: tuple[int, ...]) -> list:
    """A rank's loader: its shard in consecutive batches of ``sizes``."""
    return list(zip(*(t.split(sizes) for t in shard), strict=True))


def loader_streams(world_size: int) -> list[int]:
    """The MC stream of every batch of the loaders in rank order: ``r + W·b``.

    Rank ``r``'s batch ``b`` draws from ``seed + r + W·b`` (``docs/math.rst``,
    "Several processes").
    """
    return [
        rank + world_size * batch
        for rank, sizes in enumerate(LOADERS[world_size])
        for batch in range(len(sizes))
    ]


def options(scenario: Scenario, model: nn.Module, rank: int = 0) -> dict:
    """Keyword arguments of ``LowRankGGN`` of a rank (the reference: rank 0's).

    The generators differ across ranks: every rank must use rank 0's MC seed.
    """
    groups = (
        [list(m.parameters(recurse=False)) for m in model.modules()]
        if scenario.layer_groups
        else [list(model.parameters())]
    )
    return {
        "param_groups": [g for g in groups if g],
        "mc_samples": scenario.mc_samples,
        "generator": torch.Generator().manual_seed(7 + 1000 * rank),
        "engine": scenario.engine,
        "solver": scenario.solver,
    }


def local_subsampling(size: int) -> list[int]:
    """A rank's GGN samples: every other sample of its shard, backwards."""
    return list(range(size - 1, -1, -2))


def quantities(ggn: LowRankGGN) -> dict[str, Tensor]:
    """Every result of every group (eigenvectors, ``γ`` up to sign)."""
    out = {"loss": ggn.loss}
    for g in range(len(ggn.param_groups)):
        out[f"gradient{g}"] = torch.cat([t.flatten() for t in ggn.gradient(g)])
        out[f"gram{g}"] = ggn.gram(g)
        out[f"eigvalsh{g}"] = ggn.eigvalsh(g)
        evals, evecs = ggn.eigh(None, g)
        out[f"evals{g}"], out[f"evecs{g}"] = evals, flat(evecs)
        directional = ggn.directional_derivatives(None, g)
        out[f"gammas{g}"] = directional.gammas
        out[f"lambdas{g}"] = directional.lambdas
        out[f"newton{g}"] = flat(
            [s.unsqueeze(0) for s in ggn.newton_step(None, g, 0.1)]
        )
        out[f"top2-matrix-free{g}"] = ggn.eigh(2, g, solver="factor_krylov")[0]
    return out


def flat(tensors: list[Tensor]) -> Tensor:
    """Eigenvectors in parameter format as ``[K, D]``."""
    return torch.cat([t.flatten(start_dim=1) for t in tensors], dim=1)


def reference(scenario: Scenario, world_size: int) -> dict[str, Tensor]:
    """The single-process results on the union of the shards.

    Exact: the concatenated batch (with the concatenated local subsamplings).
    MC: a loader over the shards in rank order (block ``b`` draws from ``seed +
    b``, as rank ``b`` does). Loaders per rank: one loader over every rank's
    batches in rank order, whose batches draw from the streams the ranks'
    batches use (:func:`loader_streams`, patched in).
    """
    model, loss_func, shards = setup(scenario, world_size)
    kwargs = options(scenario, model)
    if scenario.loader:
        batches = [
            batch
            for shard, sizes in zip(shards, LOADERS[world_size], strict=True)
            for batch in loader(shard, sizes)
        ]
        streams = loader_streams(world_size)

        def stream(seed: int, block: int, device: torch.device) -> torch.Generator:
            return part_generator(seed, streams[block], device)

        with mock.patch("vivit.sources.union.part_generator", stream):
            return quantities(LowRankGGN(model, loss_func, batches, **kwargs))
    if scenario.mc_samples:
        return quantities(LowRankGGN(model, loss_func, shards, **kwargs))
    inputs = torch.cat([x for x, _ in shards])
    targets = torch.cat([y for _, y in shards])
    if scenario.subsample:
        offsets = torch.tensor([0, *SHARDS[world_size]]).cumsum(0).tolist()
        kwargs["subsampling"] = [
            offset + n
            for offset, (x, _) in zip(offsets, shards, strict=False)
            for n in local_subsampling(len(x))
        ]
    return quantities(LowRankGGN(model, loss_func, (inputs, targets), **kwargs))


def run_scenario(name: str, rank: int, world_size: int) -> dict:
    scenario = SCENARIOS[name]
    model, loss_func, shards = setup(scenario, world_size)
    kwargs = options(scenario, model, rank)
    if scenario.subsample:
        kwargs["subsampling"] = local_subsampling(len(shards[rank][0]))
    data = shards[rank]
    if scenario.loader and len(LOADERS[world_size][rank]) > 1:
        data = loader(data, LOADERS[world_size][rank])
    ggn = LowRankGGN(model, loss_func, data, **kwargs)
    layout = ggn.shards
    return {
        "quantities": quantities(ggn),
        "samples": [(r.start, r.stop) for r in layout.samples],
        "ggn_samples": [(r.start, r.stop) for r in layout.ggn_samples],
        "payload_bytes": ggn.communication.payload_bytes,
        "buffer_bytes": ggn.communication.buffer_bytes,
        "gram_buffer_bytes": ggn.communication.gram_buffer_bytes,
    }


# Training -------------------------------------------------------------------------

TRAINING_STEPS = 3


def training_setup(world_size: int, step: int):
    """Model (step 0 only matters), loss and the shards of step ``step``."""
    return setup(Scenario("mlp_tanh", "ce", "mean", "func"), world_size, seed=step)


def optimizer(
    model: nn.Module, loss_func: nn.Module, rank: int = 0, **kwargs
) -> DampedNewton:
    return DampedNewton(
        model.parameters(),
        lr=0.5,
        damping=0.1,
        mc_samples=1,
        generator=torch.Generator().manual_seed(3 + 1000 * rank),
        model=model,
        loss_func=loss_func,
        engine="backpack",
        **kwargs,
    )


def train_reference(world_size: int) -> dict[str, Tensor]:
    """Single-process training on the union batches (a loader over the shards)."""
    model, loss_func, _ = training_setup(world_size, 0)
    opt = optimizer(model, loss_func, process_group=False)
    losses = [opt.step(data=training_setup(world_size, t)[2]) for t in range(3)]
    return training_results(model, losses)


def train(rank: int, world_size: int) -> dict[str, Tensor]:
    """The same training on the shards, the model wrapped in DDP."""
    model, loss_func, _ = training_setup(world_size, 0)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = optimizer(ddp, loss_func, rank)
    losses = [
        opt.step(data=training_setup(world_size, t)[2][rank])
        for t in range(TRAINING_STEPS)
    ]
    return training_results(model, losses)


def training_results(model: nn.Module, losses: list[Tensor]) -> dict[str, Tensor]:
    """The losses of the steps and the final parameters, flattened."""
    return {
        "losses": torch.stack(losses),
        "parameters": torch.cat([p.detach().flatten() for p in model.parameters()]),
    }


# Failures -------------------------------------------------------------------------


def failures(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    """Each failure case: this rank's exception type and message."""
    scenario = SCENARIOS["mlp-ce-backpack-layers-subsampled"]
    model, loss_func, shards = setup(scenario, world_size)
    inputs, targets = shards[rank]
    last = rank == world_size - 1
    cases = {
        # before the backward pass: a malformed batch on the last rank
        "targets": lambda: LowRankGGN(
            model, loss_func, (inputs, targets[:-1] if last else targets)
        ),
        "empty": lambda: LowRankGGN(
            model, loss_func, (inputs[:0], targets[:0]) if last else (inputs, targets)
        ),
        # during the backward pass: a class index out of range on the last rank
        "labels": lambda: LowRankGGN(
            model, loss_func, (inputs, targets + 10 if last else targets)
        ),
        # loaders: one without batches, one with a malformed batch on the last rank
        "empty loader": lambda: LowRankGGN(
            model, loss_func, [] if last else [(inputs, targets)]
        ),
        "loader batch": lambda: LowRankGGN(
            model,
            loss_func,
            [(inputs, targets), (inputs, targets[:-1] if last else targets)],
        ),
        # loaders of sequences of another length on the last rank (its pass runs)
        "loader sample shape": lambda: sequences_of_length(2 if last else 3),
        # a batch in chunks: each rank exchanges one block, refused
        "chunks": lambda: LowRankGGN(
            model, loss_func, (inputs, targets), chunk_size=2 if last else None
        ),
        # different requests
        "mismatch": lambda: LowRankGGN(
            model, loss_func, (inputs, targets), mc_samples=1 if last else 0
        ),
        # targets of another shape per sample (sequences of another length)
        "sample shape": lambda: LowRankGGN(
            model, loss_func, (inputs, targets[:, None] if last else targets)
        ),
        # the same shapes, other values: a replica initialised with another seed
        "model": lambda: LowRankGGN(
            diverged(model) if last else model, loss_func, (inputs, targets)
        ),
    }
    # refused on every rank alike, before any collective
    optimizer = DampedNewton(model.parameters(), model=model, loss_func=loss_func)
    cases["closure"] = lambda: optimizer.step(lambda: loss_func(model(inputs), targets))
    # the same curvature, different steps: the replicas would drift apart
    other_lr = DampedNewton(
        model.parameters(), lr=0.5 if last else 1.0, model=model, loss_func=loss_func
    )
    cases["optimizer"] = lambda: other_lr.step(data=(inputs, targets))
    return failure_results(cases)


def failure_results(cases: dict) -> dict[str, tuple[str, str]]:
    """Each case run: its exception's type and message (empty if none)."""
    results = {}
    for name, case in cases.items():
        try:
            case()
            results[name] = ("", "")
        except Exception as error:  # noqa: BLE001 - recorded for the test
            results[name] = (type(error).__name__, str(error))
    return results


def sequences_of_length(length: int) -> LowRankGGN:
    """A loader of sequences of ``length`` steps through one Linear layer (MSE)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).double()
        batch = torch.randn(3, length, 4).double(), torch.randn(3, length, 2).double()
    return LowRankGGN(model, nn.MSELoss(), [batch, batch], engine="func")


def diverged(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose last parameter is perturbed (same shapes)."""
    copy = deepcopy(model)
    with torch.no_grad():
        list(copy.parameters())[-1].add_(1e-3)
    return copy


def job_results(job: int, rank: int, world_size: int) -> dict:
    """This rank's results of the job."""
    results = {"failures": failures(rank, world_size)}
    scenario = SCENARIOS[BYTES_SCENARIO]
    model, loss_func, shards = setup(scenario, world_size)
    alone = LowRankGGN(model, loss_func, shards[rank], process_group=False)
    results["alone"] = {"loss": alone.loss, "eigvalsh": alone.eigvalsh()}
    results["scenarios"] = {
        name: run_scenario(name, rank, world_size) for name in JOBS[job]
    }
    if job == 2:
        results["training"] = train(rank, world_size)
    return results


if __name__ == "__main__":
    run_rank(job_results)
