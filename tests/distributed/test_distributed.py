"""Several processes: gloo groups of 2 and 3 ranks on CPU, spawned from the tests.

Each job starts one process per rank (``tests/distributed/jobs.py``), which runs
every scenario of the job on its shard; here the results are compared with the
single-process results on the union of the shards (concatenated batch; for MC a
loader over the shards in rank order, whose block ``b`` draws from the same
stream as rank ``b``) and with each other (bit for bit). A job that hangs is
killed after ``JOB_TIMEOUT`` seconds and fails the test
(``tests/distributed/spawn.py``); inside it every collective has a 45 s timeout.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.jobs import (
    BYTES_SCENARIO,
    JOBS,
    SCENARIOS,
    SHARDS,
    local_subsampling,
    reference,
    setup,
    train_reference,
)
from tests.distributed.spawn import (
    assert_raised_on_every_rank,
    assert_training_is_that_of_the_union,
    launch,
)
from tests.fixtures.checks import align_signs, assert_rel
from tests.fixtures.reference import dense_ggn, dense_gradient
from vivit import DistributedError, InvalidArgumentError, LowRankGGN
from vivit.distributed import ALIGNMENT, request_fingerprint, resolve_group
from vivit.distributed.packing import Packer, pack_factors, unpack_factors
from vivit.gram import StackedFactors


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[int, list[dict]]:
    return {w: launch(w, tmp_path_factory.mktemp(f"world{w}")) for w in JOBS}


CASES = [(w, name) for w, names in JOBS.items() for name in names]


@pytest.mark.parametrize("world_size, name", CASES, ids=[f"{w}-{n}" for w, n in CASES])
def test_every_quantity_is_that_of_the_union(jobs, world_size, name):
    """Identical on every rank; equal to one process on the union (float64: 1e-10)."""
    ranks = [results["scenarios"][name]["quantities"] for results in jobs[world_size]]
    for other in ranks[1:]:
        for key, value in ranks[0].items():
            assert torch.equal(other[key], value), f"{key} differs across ranks"
    expected = reference(SCENARIOS[name], world_size)
    actual = ranks[0]
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if key.startswith(("evecs", "gammas")):
            continue
        assert_rel(actual[key], value)  # 1e-10 of the largest entry, float64
    for g in range(sum(k.startswith("evecs") for k in expected)):
        evecs = align_signs(actual[f"evecs{g}"].T, expected[f"evecs{g}"].T)
        assert_rel(evecs, expected[f"evecs{g}"].T)
        signs = torch.sign((evecs * actual[f"evecs{g}"].T).sum(0))
        assert_rel(actual[f"gammas{g}"] * signs, expected[f"gammas{g}"])


@pytest.mark.parametrize("world_size", list(JOBS))
def test_loaders_per_rank_give_the_dense_ggn_of_the_union(jobs, world_size):
    """Exact, class weights and ignored targets: the dense GGN of all samples."""
    name = "loader-mlp-ce_weighted-backpack"
    model, loss_func, shards = setup(SCENARIOS[name], world_size)
    inputs = torch.cat([x for x, _ in shards])
    targets = torch.cat([y for _, y in shards])
    actual = jobs[world_size][0]["scenarios"][name]["quantities"]
    evals = actual["evals0"]
    dense = torch.linalg.eigvalsh(dense_ggn(model, loss_func, inputs, targets))
    assert 0 < evals.numel() <= inputs.shape[0] * 3
    # float64: 1e-10 of the largest entry
    assert_rel(evals, dense[-evals.numel() :])
    assert_rel(actual["gradient0"], dense_gradient(model, loss_func, inputs, targets))
    with torch.no_grad():
        assert_rel(actual["loss"], loss_func(model(inputs), targets))


def test_matrix_free_forms_no_gram_together(jobs):
    for results in jobs[2]:
        scenarios = results["scenarios"]
        matrix_free = scenarios["mlp-mse-func-subsampled-matrix-free"]
        assert matrix_free["gram_buffer_bytes"] == 0
        assert scenarios[BYTES_SCENARIO]["gram_buffer_bytes"] > 0


@pytest.mark.parametrize("world_size", list(JOBS))
def test_layout_names_each_ranks_rows(jobs, world_size):
    sizes = SHARDS[world_size]
    starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    for name in JOBS[world_size]:
        ggn_sizes = [
            len(local_subsampling(n)) if SCENARIOS[name].subsample else n for n in sizes
        ]
        ggn_starts = torch.tensor([0, *ggn_sizes]).cumsum(0).tolist()
        for results in jobs[world_size]:
            scenario = results["scenarios"][name]
            assert scenario["samples"] == list(zip(starts, starts[1:], strict=False))
            assert scenario["ggn_samples"] == list(
                zip(ggn_starts, ggn_starts[1:], strict=False)
            )


def mlp_payload_bytes(samples: int, columns: int, element: int) -> int:
    """The cost model of ``docs/math.rst`` ("Several processes") for the test MLP.

    Per Linear layer ``I → O`` and ``N`` samples (no subsampling): the weight's
    factors of ``V`` ``N·I + C·N·O`` and its gradient factors ``N·I + N·O``; the
    bias's ``N·C·O`` and ``N·O``; then the loss.
    """
    widths = [(4, 6), (6, 5), (5, 3)]
    N, C = samples, columns
    factors = sum(2 * N * i + 2 * (C + 1) * N * o for i, o in widths)
    return element * (factors + 1)


@pytest.mark.parametrize("world_size", [2])
def test_bytes_exchanged_follow_the_cost_model(jobs, world_size):
    payloads = [mlp_payload_bytes(n, columns=3, element=8) for n in SHARDS[world_size]]
    num_tensors = 3 * (2 * 2 + 2) + 1  # per layer: weight 2×2, bias 2; the loss
    for results in jobs[world_size]:
        scenario = results["scenarios"][BYTES_SCENARIO]
        assert scenario["payload_bytes"] == payloads
        # the buffer aligns each tensor to ALIGNMENT bytes, padded to the longest
        assert max(payloads) <= scenario["buffer_bytes"]
        assert scenario["buffer_bytes"] < max(payloads) + ALIGNMENT * num_tensors
        # Gram blocks (a, b), a ≤ b, round robin: rank 0 (0, 0) and (1, 1) (upper
        # triangles), rank 1 (0, 1), of 3·3 and 3·5 rows; float64
        rows = [3 * n for n in SHARDS[world_size]]
        triangles = sum(n * (n + 1) // 2 for n in rows)
        largest = max(triangles, rows[0] * rows[1])
        assert scenario["gram_buffer_bytes"] == 8 * largest


@pytest.mark.parametrize("world_size", list(JOBS))
def test_a_failing_rank_raises_on_every_rank(jobs, world_size):
    last = world_size - 1
    own_errors = {
        "targets": "InvalidTargetsError",
        "empty": "InvalidArgumentError",
        "labels": "InvalidTargetsError",
        "chunks": "InvalidArgumentError",
        "empty loader": "InvalidArgumentError",
        "loader batch": "InvalidTargetsError",
    }
    assert_raised_on_every_rank(jobs[world_size], own_errors, last)
    for results in jobs[world_size]:
        failures = results["failures"]
        kind, message = failures["mismatch"]
        assert kind == "DistributedError"
        assert f"rank {last} asks for mc_samples = 1, rank 0 for 0" in message
        for case in ("sample shape", "loader sample shape"):
            kind, message = failures[case]
            assert kind == "DistributedError", (kind, message)
            assert f"rank {last}'s targets have the shape" in message
        kind, message = failures["sample shape"]
        assert kind == "DistributedError", (kind, message)
        assert f"rank {last}'s targets have the shape (1,) per sample" in message
        kind, message = failures["optimizer"]
        assert kind == "DistributedError", (kind, message)
        assert f"rank {last} uses the optimizer settings [{{'lr': 0.5" in message
        kind, message = failures["model"]
        assert kind == "DistributedError", (kind, message)
        assert f"rank {last}'s model differs from rank 0's in" in message
        kind, message = failures["closure"]
        assert kind == "InvalidArgumentError"
        assert "call step(data=(inputs, targets))" in message


@pytest.mark.parametrize("world_size", list(JOBS))
def test_process_group_false_computes_each_rank_alone(jobs, world_size):
    """The opt-out under an initialised group: the rank's own shard, no exchange."""
    model, loss_func, shards = setup(SCENARIOS[BYTES_SCENARIO], world_size)
    for rank, results in enumerate(jobs[world_size]):
        alone = LowRankGGN(model, loss_func, shards[rank])
        assert torch.equal(results["alone"]["loss"], alone.loss)
        assert_rel(results["alone"]["eigvalsh"], alone.eigvalsh())


def test_data_parallel_training_is_that_of_the_union(jobs):
    """DDP-wrapped model, MC Newton steps: equal to one process on union batches."""
    ranks = [results["training"] for results in jobs[2]]
    assert_training_is_that_of_the_union(ranks, train_reference(2))


def test_process_group_must_be_a_group():
    with pytest.raises(InvalidArgumentError, match="process_group must be"):
        resolve_group("world")


def test_without_a_group_nothing_is_exchanged():
    model, loss_func, shards = setup(SCENARIOS[BYTES_SCENARIO], 2)
    ggn = LowRankGGN(model, loss_func, shards[0], process_group=False)
    assert ggn.shards.world_size == 1
    assert ggn.shards.local_samples == range(SHARDS[2][0])
    assert ggn.communication.sent_bytes == 0
    assert issubclass(DistributedError, RuntimeError)


def test_a_group_this_process_is_not_in_is_named():
    # torch.distributed.new_group returns this marker (an int) on non-members
    marker = torch.distributed.GroupMember.NON_GROUP_MEMBER
    with pytest.raises(InvalidArgumentError, match="not a member of process_group"):
        resolve_group(marker)


def test_model_checksums_cover_the_state_dict_only():
    """Parameters and persistent buffers must agree across ranks; caches need not."""
    model = torch.nn.Linear(2, 3)
    model.register_buffer("statistic", torch.ones(2))
    model.register_buffer("cache", torch.zeros(4), persistent=False)
    state = request_fingerprint(None, [], model)["model state"]
    assert sorted(state) == ["bias", "statistic", "weight"]
    other = request_fingerprint(None, [], model)["model state"]
    assert state == other
    with torch.no_grad():
        model.weight[0, 0] += 1e-6
    assert request_fingerprint(None, [], model)["model state"] != state


def test_factors_in_sample_blocks_travel_block_by_block():
    """A rank's merged batches may keep factors per block (forms that differ)."""
    model, loss_func, shards = setup(SCENARIOS[BYTES_SCENARIO], 2)
    ggn = LowRankGGN(model, loss_func, shards[1], process_group=False)
    weight = ggn._group(0).ggn_factors[0]
    blocks = StackedFactors([weight, weight.select([0, 2])], [1.0, 0.5])
    packer = Packer()
    description = pack_factors(blocks, torch.float64, packer)
    # every tensor in the buffer (counted), none pickled with the description
    assert packer.payload == sum(
        t.numel() * t.element_size()
        for block in (weight, weight.select([0, 2]))
        for t in vars(block).values()
        if isinstance(t, torch.Tensor)
    )
    buffer = torch.zeros(packer.size, dtype=torch.uint8)
    packer.fill(buffer)
    rebuilt = unpack_factors(description, buffer)
    assert isinstance(rebuilt, StackedFactors)
    assert rebuilt.scales == blocks.scales
    assert torch.equal(rebuilt.gram(rebuilt), blocks.gram(blocks))
