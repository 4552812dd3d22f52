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

import math

import pytest
import torch

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
from vivit.analysis import CurvatureMonitor
from vivit.analysis.monitor_record import newton_angle_deg

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
