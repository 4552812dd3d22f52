"""The implicit route across the ranks of gloo groups of 2 and 3 (products all-reduced).

Each job (``tests/distributed/implicit_jobs.py``, spawned by
``tests/distributed/spawn.py``, killed if it hangs) runs every scenario on the
ranks' shards (uneven; one batch or a loader per rank) with float64 models. The
results must be identical on every rank, equal the single-process implicit
route on the union and the dense float64 reference of the union
(``docs/math.rst``, "Implicit products on several processes").

Tolerances (:ref:`math-test-tolerances`): eigenvalues within ``EIGVAL_RTOL·λ_max``
of the dense reference ("Eigenvalues", "Iterative solvers": each within
``tol·λ_max``, ``tol = 10⁻¹³``), and within ``2·tol·λ_max`` of the
single-process run ("Iterative solvers": two runs); loss and gradient within
``REORDERED_REL`` ("Reordered sums": the ranks' sums in another order); ``γ``,
``λ``, Newton steps and eigenvectors within ``EIGVEC_PRODUCT_REL``, whose premise
on the implicit route, ``tol·λ_max/gap_k ≤ 10⁻¹⁰`` ("Iterative solvers"), is
asserted on the dense spectrum.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.implicit_jobs import (
    DAMPING,
    JOBS,
    SCENARIOS,
    TOL,
    TOP_K,
    param_groups,
    reference,
    setup,
    train_reference,
    union_subsampling,
)
from tests.distributed.spawn import (
    assert_raised_on_every_rank,
    assert_training_is_that_of_the_union,
    launch,
)
from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    align_signs,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
)
from tests.fixtures.reference import (
    dense_ggn,
    dense_gradient,
    per_sample_ggns,
    per_sample_gradients,
)
from vivit.errors import DistributedError
from vivit.linalg.top_k import IMPLICIT_BLOCK
from vivit.memory.plan import Plan, Sizes
from vivit.memory.request import agreed_plan, fixed_route
from vivit.options import CurvatureOptions

MODULE = "tests.distributed.implicit_jobs"
CASES = [(w, name) for w, names in JOBS.items() for name in names]
IDS = [f"{w}-{n}" for w, n in CASES]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[int, list[dict]]:
    return {w: launch(w, tmp_path_factory.mktemp(f"implicit{w}"), MODULE) for w in JOBS}


@pytest.fixture(scope="module")
def references() -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    return {(w, name): reference(SCENARIOS[name], w) for w, name in CASES}


def union_batch(name: str, world_size: int):
    """The model, loss and every rank's samples concatenated in rank order."""
    model, loss_func, shards = setup(SCENARIOS[name], world_size)
    inputs = torch.cat([x for x, _ in shards])
    targets = torch.cat([y for _, y in shards])
    return model, loss_func, inputs, targets


@pytest.mark.parametrize("world_size, name", CASES, ids=IDS)
def test_every_rank_returns_the_same(jobs, world_size, name):
    """Bit for bit: tensors, reports, numerical zeros, layout, bytes, the route."""
    ranks = [results["scenarios"][name] for results in jobs[world_size]]
    for other in ranks[1:]:
        for key, value in ranks[0]["tensors"].items():
            assert torch.equal(other["tensors"][key], value), key
        assert other["other"] == ranks[0]["other"]


@pytest.mark.parametrize("world_size, name", CASES, ids=IDS)
def test_equals_one_process_on_the_union(jobs, references, world_size, name):
    actual = jobs[world_size][0]["scenarios"][name]["tensors"]
    expected = references[(world_size, name)]
    assert actual.keys() == expected.keys()
    assert_rel(actual["loss"], expected["loss"], REORDERED_REL)
    for g in range(sum(key.startswith("evals") for key in expected)):
        assert_rel(actual[f"gradient{g}"], expected[f"gradient{g}"], REORDERED_REL)
        evals = expected[f"evals{g}"]
        tol = jobs[world_size][0]["scenarios"][name]["other"][f"report{g}"]["tolerance"]
        assert_rel(actual[f"evals{g}"], evals, 2 * tol)  # relative to λ_max
        evecs = expected[f"evecs{g}"].T
        aligned = align_signs(actual[f"evecs{g}"].T, evecs)
        assert_rel(aligned, evecs)
        signs = torch.sign((aligned * actual[f"evecs{g}"].T).sum(0))
        assert_rel(actual[f"gammas{g}"] * signs, expected[f"gammas{g}"])
        for key in ("lambdas", "newton"):
            assert_rel(actual[f"{key}{g}"], expected[f"{key}{g}"])


def _decomposable(name: str) -> bool:
    """Whether the loss is ``R Σ_n ℓ_n`` with ``R`` of the batch size (no class
    weights, no ignored targets): the per-sample references apply."""
    scenario = SCENARIOS[name]
    return scenario.loss != "ce_weighted" and not scenario.ignored_shard


@pytest.mark.parametrize("world_size, name", CASES, ids=IDS)
def test_matches_the_dense_reference_of_the_union(jobs, world_size, name):
    """Eigenpairs, loss and gradient; ``γ``, ``λ`` and Newton steps where the loss
    decomposes per sample (else through the single-process run, above)."""
    scenario = SCENARIOS[name]
    result = jobs[world_size][0]["scenarios"][name]
    actual, other = result["tensors"], result["other"]
    model, loss_func, inputs, targets = union_batch(name, world_size)
    subsampling = union_subsampling(world_size) if scenario.subsample else None
    with torch.no_grad():
        assert_rel(actual["loss"], loss_func(model(inputs), targets), REORDERED_REL)
    for g, params in enumerate(param_groups(scenario, model)):
        G = dense_ggn(model, loss_func, inputs, targets, params, subsampling)
        gradient = dense_gradient(model, loss_func, inputs, targets, params)
        assert_rel(actual[f"gradient{g}"], gradient, REORDERED_REL)
        evals, evecs = actual[f"evals{g}"], actual[f"evecs{g}"]
        reference, vectors = torch.linalg.eigh(G)
        report = other[f"report{g}"]
        assert report["converged"] and report["tolerance"] == TOL
        assert_top_eigvals(evals, reference, EIGVAL_RTOL[torch.float64])
        split = [p.numel() for p in params]
        as_params = [
            e.reshape(-1, *p.shape)
            for e, p in zip(evecs.split(split, 1), params, strict=True)
        ]
        assert_eigenpairs(
            evals, as_params, G, other[f"num_rows{g}"], tol=report["tolerance"]
        )
        # the solve's residual bound holds for e_k itself (parameter space);
        # every scenario's eigenvectors are compared at this bound (here or
        # against one process on the union)
        gaps = (reference[-TOP_K:, None] - reference[None, :]).abs()
        gaps[gaps == 0] = float("inf")  # each eigenvalue's distance to the others
        premise = report["tolerance"] * reference[-1] / gaps.min(1).values
        assert (premise <= EIGVEC_PRODUCT_REL).all(), premise
        if not _decomposable(name):
            continue
        top = vectors[:, -TOP_K:]
        aligned = align_signs(evecs.T, top)
        assert_rel(aligned, top)
        signs = torch.sign((aligned * evecs.T).sum(0))
        gradients = per_sample_gradients(model, loss_func, inputs, targets, params)
        assert_rel(actual[f"gammas{g}"] * signs, gradients @ top)
        ggns = per_sample_ggns(model, loss_func, inputs, targets, params)
        if subsampling is not None:
            ggns = ggns[subsampling]
        lambdas = torch.einsum("dk,nde,ek->nk", top, ggns, top)
        assert_rel(actual[f"lambdas{g}"], lambdas)
        sizes = -(top.T @ gradient) / (reference[-TOP_K:] + DAMPING)
        assert_rel(actual[f"newton{g}"], top @ sizes)


@pytest.mark.parametrize("world_size, name", CASES, ids=IDS)
def test_each_product_all_reduces_k_times_d_numbers(jobs, world_size, name):
    """``docs/math.rst``, "Implicit products on several processes": the gradient
    once (``D`` numbers), then ``K·D`` per product of ``K`` vectors: in all ``D``
    plus the solver's multiplied columns times each group's ``D_g``, 8 bytes
    each (float64); ``γ`` and ``λ`` travel in the rounds, not in all-reduces."""
    other = jobs[world_size][0]["scenarios"][name]["other"]
    groups = [key for key in other if key.startswith("report")]
    params = [other[f"num_params{g}"] for g in range(len(groups))]
    columns = [other[f"report{g}"]["products"] for g in range(len(groups))]
    expected = sum(params) + sum(c * d for c, d in zip(columns, params, strict=True))
    assert other["reduced_bytes"] == 8 * expected
    assert other["reductions"] > 1 + len(groups)


@pytest.mark.parametrize(
    "world_size", [w for w, names in JOBS.items() if "cnn-ce-mean-memory-cut" in names]
)
def test_the_basis_is_the_smallest_any_rank_allows(jobs, world_size):
    """Only the last rank has memory for no more than the smallest basis: every
    rank's solve runs with it (and says so), and the results stay exact (above)."""
    for results in jobs[world_size]:
        report = results["scenarios"]["cnn-ce-mean-memory-cut"]["other"]["report0"]
        uncut = results["scenarios"]["cnn-mse-sum"]["other"]["report0"]
        assert report["basis_columns"] < uncut["basis_columns"]
        assert report["basis_cut"] == (
            f"basis cut to {report['basis_columns']} of "
            f"{uncut['basis_columns']} columns by memory"
        )


@pytest.mark.parametrize("world_size", list(JOBS))
def test_auto_agrees_across_ranks(jobs, world_size):
    """Each rank chooses from its shard; every rank runs the same route. Where
    only the last rank chooses the implicit route, all run it; a small MLP's
    Gram route is cheaper on every rank."""
    last = world_size - 1
    for results in jobs[world_size]:
        name, reason = results["scenarios"]["mlp-mse-mean-auto"]["other"]["route"]
        assert name == "implicit"
        assert "the ranks chose differently" in reason
        assert "rank 0: gram route" in reason
        assert f"rank {last}: implicit route: forced on this rank" in reason
        assert results["auto"][0] == "gram"
        assert results["auto"] == jobs[world_size][0]["auto"]


@pytest.mark.parametrize("world_size", list(JOBS))
def test_an_error_on_one_rank_raises_on_every_rank(jobs, world_size):
    """At construction, in a product, in the memory check: the failing rank raises
    its own error, every other rank a DistributedError naming it; calls or
    requests that differ raise on every rank. No rank hangs (the job ends)."""
    last = world_size - 1
    own = {
        "targets": "InvalidTargetsError",
        "non-finite": "NonFiniteError",
        "empty loader": "InvalidArgumentError",
        "unsupported layer": "UnsupportedLayerError",
        "model changed": "ModelChangedError",
        "loader changed": "NondeterministicDataError",
        "memory": "ProductsTooLargeError",
    }
    different = {
        "top_k": "make different calls: rank {last} computes the memory check "
        "for top_k=4, rank 0 the memory check for top_k=3",
        "seed": "make different calls: rank {last} computes G·v of group 0 along "
        f"{min(TOP_K, IMPLICIT_BLOCK)} vectors (digest",  # the first block
        "directions": "make different calls: rank {last} computes γ, λ of group 0 "
        "along 2 vectors",
        "solver": "rank {last} asks for route='implicit', rank 0 for solver='auto'",
        "tolerance": "rank {last} asks for solver = ('auto', 1e-10, 0)",
    }
    assert_raised_on_every_rank(jobs[world_size], own, last)
    for results in jobs[world_size]:
        failures = results["failures"]
        for case, text in different.items():
            kind, message = failures[case]
            assert kind == "DistributedError", (case, kind, message)
            assert text.format(last=last) in message, (case, message)


@pytest.mark.parametrize("world_size", list(JOBS))
def test_gloo_all_reduce_is_bitwise_identical_on_every_rank(jobs, world_size):
    """What the replicated solver relies on (``torch.distributed.all_reduce``'s
    documented guarantee), measured: float64 and float32, 1 to 100,003 entries
    spanning 16 orders of magnitude."""
    digests = [results["all_reduce"] for results in jobs[world_size]]
    assert all(d == digests[0] for d in digests)


def test_data_parallel_training_is_that_of_the_union(jobs):
    """DDP-wrapped model, implicit Newton steps on each rank's shard: the replicas
    stay equal and equal one process on the union batches."""
    ranks = [results["training"] for results in jobs[2]]
    assert_training_is_that_of_the_union(ranks, train_reference(2))


def test_the_agreed_route():
    """One process keeps its choice; equal choices stay; different ones run the
    implicit route, naming every rank's reason, unless a rank cannot run it;
    different solvers are refused."""

    def plan(route, reason, forced=False):
        sizes, groups = Sizes(1, 1, 1, 1), [[torch.zeros(1)]]
        return Plan(None, sizes, None, groups, (route, reason, forced))

    gram, implicit = plan("gram", "cheaper"), plan("implicit", "fits")
    auto, dense = "solver='auto'", "solver='dense'"
    assert agreed_plan([(auto, gram)]) is gram
    assert agreed_plan([(auto, gram), (auto, gram)]) is gram
    both = agreed_plan([(auto, gram), (auto, implicit)])
    assert both.route == "implicit"
    assert "rank 0: gram route: cheaper; rank 1: implicit route: fits" in both.reason
    same = agreed_plan([(auto, gram), (auto, plan("gram", "other"))])
    assert same.route == "gram" and "every rank chose it" in same.reason
    with pytest.raises(DistributedError, match="rank 1 asks for solver='dense'"):
        agreed_plan([(auto, gram), (dense, gram)])
    # a rank whose shard the implicit route cannot run (a one-pass iterator)
    forced = plan(*fixed_route(CurvatureOptions(), "an iterator is passed over once"))
    assert forced.route == "gram" and forced.forced
    mixed = agreed_plan([(auto, implicit), (auto, forced)])
    assert mixed.route == "gram" and "the only one some rank can run" in mixed.reason
