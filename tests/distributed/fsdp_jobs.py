"""What every rank of a gloo group runs for ``test_fsdp.py``: FSDP2-sharded models.

Run from the repository root as ``python -m tests.distributed.fsdp_jobs JOB RANK
WORLD_SIZE RENDEZVOUS_FILE OUT_DIR`` (``tests/distributed/spawn.py``). Every
scenario runs twice on each rank's shard of the data: on the model sharded with
``fully_shard`` and on the same model unsharded (the data-parallel replica the
existing tests compare with one process on the union). Both are saved, the sharded
results gathered (``full_tensor``) and with their local shards.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor

from tests.distributed.jobs import failure_results
from tests.distributed.spawn import run_rank
from vivit import LowRankGGN, StreamingGGN
from vivit.analysis import CurvatureMonitor
from vivit.huggingface import causal_lm_targets, token_logits
from vivit.memory import estimate_memory
from vivit.optim import DampedNewton

#: Leading eigenpairs of every scenario.
TOP_K = 3
#: The implicit route's tolerance (tight: the comparisons are bitwise anyway).
TOL = 1e-12
#: Samples of each rank's shard (uneven).
SHARDS = {2: (3, 5), 3: (2, 4, 3)}
#: Whether ``transformers`` (the test extra) is installed: GPT-2's scenarios.
HF = importlib.util.find_spec("transformers") is not None
#: Tokens per sequence of the attention block, and its vocabulary.
TOKENS, VOCAB = 5, 11


class CausalBlock(nn.Module):
    """Embedding, causal self-attention, LayerNorm and a head: logits ``[N, V, T]``."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.attend = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:  # noqa: D102
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        mixed, _ = self.attend(x, x, x, attn_mask=mask.to(x.dtype), need_weights=False)
        return self.head(self.norm(x + mixed)).transpose(1, 2)


def build(name: str) -> tuple[nn.Module, nn.Module, Tensor | dict, Tensor]:
    """Model (float64, seed 0), loss and the union's data."""
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        inputs, targets = torch.randn(12, 5), torch.randint(0, 3, (12,))
        loss = nn.CrossEntropyLoss()
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 3 * 3, 4)
        )
        inputs, targets = torch.randn(12, 1, 5, 5), torch.randn(12, 4)
        loss = nn.MSELoss(reduction="sum")
    elif name == "gpt2":  # Hugging Face's, its head tied to the token embedding
        from tests.fixtures.hf_models import VOCAB as GPT2_VOCAB
        from tests.fixtures.hf_models import gpt2

        model = gpt2().eval()
        tokens = torch.randint(0, GPT2_VOCAB, (12, TOKENS))
        inputs = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
        targets = causal_lm_targets(**inputs)
        loss = nn.CrossEntropyLoss()
    else:
        model = CausalBlock()
        inputs = torch.randint(0, VOCAB, (12, TOKENS))
        targets = torch.randint(0, VOCAB, (12, TOKENS))
        loss = nn.CrossEntropyLoss()
    if isinstance(inputs, Tensor) and inputs.is_floating_point():
        inputs = inputs.double()
    return model.double(), loss, inputs, targets.double() if name == "cnn" else targets


@dataclass(frozen=True)
class Scenario:
    """One request on one FSDP2-sharded problem.

    Attributes:
        model: ``"mlp"``, ``"cnn"``, ``"attention"`` (:class:`CausalBlock`) or
            ``"gpt2"`` (Hugging Face's, ``tests/fixtures/hf_models.py``).
        units: Every layer its own ``fully_shard`` unit and the root (else the
            root alone).
        route: ``"gram"`` (``solver="dense"``) or ``"implicit"``.
        loader: Each rank passes its shard as a list of two batches.
    """

    model: str
    units: bool
    route: str
    loader: bool = False


SCENARIOS = {
    f"{model}-{'units' if units else 'root'}-{route}{'-loader' if loader else ''}": (
        Scenario(model, units, route, loader)
    )
    for model, units, route, loader in [
        ("mlp", True, "gram", False),
        ("mlp", False, "implicit", False),
        ("mlp", True, "implicit", True),
        ("cnn", True, "gram", True),
        ("cnn", False, "implicit", False),
        ("attention", True, "gram", False),
        ("attention", True, "implicit", False),
    ]
    + (
        [("gpt2", True, "gram", False), ("gpt2", False, "implicit", False)]
        if HF
        else []
    )
}


def shard_of(inputs: Tensor, targets: Tensor, rank: int, world_size: int):
    """This rank's samples (``SHARDS``, in rank order)."""
    sizes = SHARDS[world_size]
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    if isinstance(inputs, dict):
        return {key: value[rows] for key, value in inputs.items()}, targets[rows]
    return inputs[rows], targets[rows]


def sharded(model: nn.Module, units: list[nn.Module] | None) -> nn.Module:
    """``model`` with ``fully_shard`` on ``units`` (if any) and on the root."""
    for unit in units or []:
        fully_shard(unit)
    fully_shard(model)
    return model


def results(
    ggn: LowRankGGN, gather: Callable[[Tensor], Tensor]
) -> dict[str, Tensor | list[Tensor]]:
    """Eigenpairs, ``γ``/``λ``, Newton step and gradient; ``gather`` each vector."""
    evals, evecs = ggn.eigh(top_k=TOP_K)
    directional = ggn.directional_derivatives(top_k=TOP_K)
    step = ggn.newton_step(top_k=TOP_K, damping=0.1)
    return {
        "evals": evals,
        "gammas": directional.gammas,
        "lambdas": directional.lambdas,
        "loss": ggn.loss,
        "evecs": [gather(e) for e in evecs],
        "step": [gather(s) for s in step],
        "gradient": [gather(g) for g in ggn.gradient()],
        "G gradient": [gather(g) for g in ggn.operator().matvec(ggn.gradient())],
        "local": [e.to_local() if hasattr(e, "to_local") else e for e in evecs],
    }


def run_scenario(scenario: Scenario, rank: int, world_size: int) -> dict:
    """The scenario on the sharded model and on the plain one, on this rank's shard."""
    model, loss_func, inputs, targets = build(scenario.model)
    plain, _, _, _ = build(scenario.model)
    data = shard_of(inputs, targets, rank, world_size)
    if scenario.loader:
        half = len(data[0]) // 2
        data = [(data[0][:half], data[1][:half]), (data[0][half:], data[1][half:])]
    if scenario.model == "gpt2":
        modules = list(model.transformer.h)
    elif scenario.model == "attention":
        modules = [model.embed, model.attend, model.norm, model.head]
    else:
        modules = [model[i] for i in {"mlp": [0, 2], "cnn": [0, 3]}[scenario.model]]
    model = sharded(model, modules if scenario.units else None)
    options = (
        {"route": "gram", "solver": "dense"}
        if scenario.route == "gram"
        else {"route": "implicit", "solver_tol": TOL}
    )
    if scenario.model == "gpt2":
        options["output"] = token_logits
    fsdp = LowRankGGN(model, loss_func, data, **options)
    reference = LowRankGGN(plain, loss_func, data, **options)
    # the caller's parameters, not the gathered twin's
    callers = zip(fsdp.param_groups[0], model.parameters(), strict=True)
    assert all(p is q for p, q in callers)
    return {
        "fsdp": results(fsdp, lambda t: t.full_tensor()),
        "plain": results(reference, lambda t: t),
        "params": [p.to_local().clone() for p in model.parameters()],
        "full_params": [p.detach().clone() for p in plain.parameters()],
        "route": fsdp.plan.route,
    }


def training(rank: int, world_size: int) -> dict[str, list[Tensor]]:
    """Two ``DampedNewton`` steps on the sharded MLP and on the plain one, then a
    :class:`~vivit.analysis.CurvatureMonitor` record of each (timings left out)."""
    model, loss_func, inputs, targets = build("mlp")
    plain, _, _, _ = build("mlp")
    model = sharded(model, [model[0], model[2]])
    data = shard_of(inputs, targets, rank, world_size)
    for net in (model, plain):
        optimizer = DampedNewton(
            net.parameters(), top_k=TOP_K, damping=0.1, model=net, loss_func=loss_func
        )
        for _ in range(2):
            optimizer.step(data=data)
    monitored = {
        name: CurvatureMonitor(net, loss_func, top_k=TOP_K).record(data)
        for name, net in (("fsdp", model), ("plain", plain))
    }
    return {
        "fsdp": [p.full_tensor() for p in model.parameters()],
        "plain": [p.detach() for p in plain.parameters()],
        "records": [
            {
                k: v
                for k, v in monitored[name].items()
                if k not in ("time", "overhead_s", "run")
            }
            for name in ("fsdp", "plain")
        ],
    }


def streaming(rank: int, world_size: int) -> dict[str, Tensor]:
    """``StreamingGGN`` on this rank's batches alone: sharded and plain alike."""
    model, loss_func, inputs, targets = build("mlp")
    plain, _, _, _ = build("mlp")
    model = sharded(model, [model[0]])
    x, y = shard_of(inputs, targets, rank, world_size)
    batches = [(x[:1], y[:1]), (x[1:], y[1:])]
    return {
        name: StreamingGGN(net, loss_func, batches).eigh(top_k=TOP_K)[0]
        for name, net in (("fsdp", model), ("plain", plain))
    }


def failures(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    """Every rank raises, none hangs: the last rank's targets out of range, or its
    memory short of the gathered model; DTensor parameters without FSDP2."""
    model, loss_func, inputs, targets = build("mlp")
    model = sharded(model, [model[0], model[2]])
    x, y = shard_of(inputs, targets, rank, world_size)
    last = rank == world_size - 1
    small = mock.patch(  # the last rank has 16 bytes free
        "vivit.distributed.sharded.available_bytes",
        return_value=16 if last else 2**40,
    )

    def too_large() -> None:
        with small:
            LowRankGGN(model, loss_func, (x, y), route="gram")

    def tensor_parallel() -> None:  # DTensor parameters without fully_shard
        plain, _, _, _ = build("mlp")
        mesh = init_device_mesh("cpu", (world_size,))
        weight = plain[2].weight.detach()
        plain[2].weight = nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
        LowRankGGN(plain, loss_func, (x, y), route="gram")

    bad = y + 10 if last else y
    return failure_results(
        {
            "bad targets": lambda: LowRankGGN(model, loss_func, (x, bad), route="gram"),
            "too large": too_large,
            "tensor parallel": tensor_parallel,
        }
    )


def estimate(rank: int, world_size: int) -> dict[str, int]:
    """``estimate_memory`` of the sharded MLP: the gathered bytes, and the total."""
    model, loss_func, inputs, _ = build("mlp")
    model = sharded(model, [model[0], model[2]])
    result = estimate_memory(model, inputs[:2], 8, loss_func=loss_func, top_k=TOP_K)
    local = sum(p.to_local().numel() for p in model.parameters())
    return {
        "gathered": result.gathered,
        "total": result.total,
        "expected": 8 * (sum(p.numel() for p in model.parameters()) - local),
    }


def job_results(job: int, rank: int, world_size: int) -> dict:
    """This rank's results of the job (``job``: the world size)."""
    torch.set_num_threads(1)
    return {
        "scenarios": {
            name: run_scenario(s, rank, world_size) for name, s in SCENARIOS.items()
        },
        "training": training(rank, world_size),
        "streaming": streaming(rank, world_size),
        "failures": failures(rank, world_size),
        "estimate": estimate(rank, world_size),
    }


if __name__ == "__main__":
    run_rank(job_results)
