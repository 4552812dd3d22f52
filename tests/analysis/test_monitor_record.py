"""A monitor's record against the dense float64 reference (``docs/math.rst``).

The record of one batch ("Curvature during training"): top eigenvalues, the
gradient's share ``Σ_k (e_kᵀ∇L)² / ‖∇L‖²`` in their span, the SNRs
``mean²/var`` (``ddof=1``) of ``γ_nk = e_kᵀ∇ℓ_n`` and ``λ_nk = e_kᵀ G_n e_k``
("Directional derivatives and curvature noise"), and the angle between
``Δθ = −Σ_k γ̄_k/(λ_k + δ) e_k`` and ``−∇L`` ("Damped Newton step in the
eigenspace"), each from ``torch.func`` (tests/fixtures/reference.py), never from
the library. Tolerances are the named bounds of tests/fixtures/checks.py
(:ref:`math-test-tolerances`), propagated to each derived number below.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from torch import nn

from tests.fixtures.checks import (
    DIRECTION_REL,
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL,
    REORDERED_REL,
    assert_within,
    rounding_rel,
)
from tests.fixtures.problems import get_problem
from tests.fixtures.reference import (
    dense_ggn,
    dense_gradient,
    eigh_reference,
    per_sample_ggns,
    per_sample_gradients,
)
from vivit import InvalidArgumentError
from vivit.analysis import CurvatureMonitor, read_records, runs
from vivit.analysis.monitor_record import RecordWriter, newton_angle_deg

K = 2
DAMPING = 0.5

#: Several architectures (BackPACK and func engines, BatchNorm switched to eval
#: mode by the monitor), both losses, both reductions.
PROBLEMS = [
    "mlp_tanh-ce-mean",
    "mlp_relu-mse-sum",
    "cnn-ce-sum",
    "conv1d-mse-mean",
    "batchnorm1d-ce-mean",
    "residual-mse-mean",
    "sequence_linear-ce-sum",
]


def _snr(samples):
    return samples.mean(0).pow(2) / samples.var(0, correction=1)


def _snr_bound(samples, rel):
    """First-order error of ``m²/v`` when every sample moves by ``rel·max|sample|``.

    ``δm ≤ ε`` and ``δv ≤ 2·ε·max|x − m|·N/(N−1)`` with ``ε = rel·max|x|``, so
    ``|δ(m²/v)| ≤ (2|m|ε + (m²/v)·δv)/v`` (plus the same again for second order).
    """
    eps = rel * samples.abs().amax(0)
    mean, var = samples.mean(0), samples.var(0, correction=1)
    n = samples.shape[0]
    dvar = 2 * eps * (samples - mean).abs().amax(0) * n / (n - 1)
    return 2 * (2 * mean.abs() * eps + mean.pow(2) / var * dvar) / var


def reference_record(model, loss_func, inputs, targets, subsampling):
    """The record's numbers from dense float64 ``torch.func`` quantities."""
    was_training = model.training
    model.eval()
    G = dense_ggn(model, loss_func, inputs, targets, subsampling=subsampling)
    gradient = dense_gradient(model, loss_func, inputs, targets)
    grads_n = per_sample_gradients(model, loss_func, inputs, targets)
    ggns_n = per_sample_ggns(model, loss_func, inputs, targets)
    model.train(was_training)
    evals, evecs = eigh_reference(G)
    evals, evecs = evals.flip(0)[:K], evecs.flip(1)[:, :K]
    samples = range(len(inputs)) if subsampling is None else subsampling
    lambdas = torch.einsum("dk,nde,ek->nk", evecs, ggns_n[list(samples)], evecs)
    gamma_bar = evecs.T @ gradient
    step = -evecs @ (gamma_bar / (evals + DAMPING))
    cosine = -(step @ gradient) / (step.norm() * gradient.norm())
    return {
        "eigenvalues": evals,
        "gradient_norm": gradient.norm(),
        "gradient_share": gamma_bar.pow(2).sum() / gradient.pow(2).sum(),
        "gammas": grads_n @ evecs,
        "lambdas": lambdas,
        "cosine": cosine,
    }


@pytest.mark.parametrize("subsampling", [None, [0, 2, 3]], ids=["all", "subsampled"])
@pytest.mark.parametrize("name", PROBLEMS)
def test_record_matches_dense_reference(name, subsampling):
    model, loss_func, inputs, targets = get_problem(name).build(torch.float64)
    model.train()  # the monitor switches to eval mode, as BatchNorm requires
    monitor = CurvatureMonitor(
        model, loss_func, top_k=K, damping=DAMPING, subsampling=subsampling
    )
    record = monitor.record((inputs, targets))
    ref = reference_record(model, loss_func, inputs, targets, subsampling)
    dtype = torch.float64

    evals = torch.tensor(record["eigenvalues"], dtype=dtype)
    assert_within(evals, ref["eigenvalues"], EIGVAL_RTOL[dtype] * ref["eigenvalues"][0])
    # a norm of D entries: reordered sums
    assert record["gradient_norm"] == pytest.approx(
        float(ref["gradient_norm"]), rel=REORDERED_REL
    )
    # Σ_k γ̄_k² / ‖∇L‖² ≤ 1: products with eigenvectors of the leading directions
    share = torch.tensor([record["gradient_share"]], dtype=dtype)
    assert_within(share, ref["gradient_share"].reshape(1), EIGVEC_PRODUCT_REL)
    # per-sample γ and λ: DIRECTION_REL of their largest entry, propagated to m²/v
    for key, samples in (("gamma_snr", ref["gammas"]), ("lambda_snr", ref["lambdas"])):
        actual = torch.tensor(record[key], dtype=dtype)
        assert_within(actual, _snr(samples), _snr_bound(samples, DIRECTION_REL))
    # the step from the same directions; cos(angle) undoes acos, degrees: few ops
    cosine = math.cos(math.radians(record["newton_angle_deg"]))
    assert abs(cosine - float(ref["cosine"])) <= EIGVEC_PRODUCT_REL + rounding_rel(8)
    assert record["dampings"] == [DAMPING] * K
    assert record["batch"] == "current" and record["step"] == 0


def test_newton_angle_of_known_vectors():
    gradient = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert newton_angle_deg(-gradient, gradient) == 0.0
    assert newton_angle_deg(torch.tensor([0.0, 2.0]).double(), gradient) == 90.0
    diagonal = newton_angle_deg(torch.tensor([-1.0, 1.0]).double(), gradient)
    assert diagonal == pytest.approx(45.0, rel=rounding_rel(8))
    assert newton_angle_deg(torch.zeros(2).double(), gradient) is None


def _small_monitor(path=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    return CurvatureMonitor(model, nn.CrossEntropyLoss(), every=1, top_k=1, path=path)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 4, generator=g).double(), torch.randint(0, 3, (5,))


def test_two_monitors_writing_one_file_are_told_apart(tmp_path):
    """Two monitors appending to one file (interleaved): each read back alone."""
    path = tmp_path / "records.jsonl"
    first, second = _small_monitor(path), _small_monitor(path)
    for seed, monitor in enumerate([first, second, first, second, second]):
        monitor.step(_batch(seed))
    first.close(), second.close()
    first_id, second_id = first.records[0]["run"], second.records[0]["run"]
    assert first_id != second_id
    assert {r["run"] for r in first.records} == {first_id}
    assert {r["run"] for r in second.records} == {second_id}
    assert runs(path) == [first_id, second_id]
    assert read_records(path) == second.records  # the run started last
    assert read_records(path, run="last") == second.records
    assert read_records(path, run=first_id) == first.records
    everything = read_records(path, run="all")
    assert [r["run"] for r in everything] == [first_id, second_id] + [
        first_id,
        second_id,
        second_id,
    ]
    with pytest.raises(InvalidArgumentError, match="no records of run 'other'"):
        read_records(path, run="other")
    with pytest.raises(InvalidArgumentError, match="run must be"):
        read_records(path, run=1)


def test_a_file_without_run_ids_still_reads(tmp_path):
    """Records written before run ids: one run ``None``, read by default."""
    path = tmp_path / "old.jsonl"
    monitor = _small_monitor()
    old = [monitor.record(_batch(seed)) for seed in range(2)]
    for record in old:
        del record["run"]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    expected = [{**r, "run": None} for r in old]
    assert runs(path) == [None]
    assert read_records(path) == expected
    with _small_monitor(path) as rerun:  # a rerun appends a new run after them
        rerun.step(_batch(5))
    assert runs(path) == [None, rerun.records[0]["run"]]
    assert read_records(path) == rerun.records
    assert read_records(path, run=None) == expected


def test_run_ids_leave_the_global_generators_alone():
    """Ids are fresh per writer, from the OS's source, not torch's or Python's."""
    torch.manual_seed(3)
    random.seed(3)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    ids = [RecordWriter(None, None).run for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{12}", i) for i in ids)
