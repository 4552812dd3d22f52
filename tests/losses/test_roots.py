"""Loss-Hessian roots of vivit.losses against the dense Hessian of the loss module.

For every supported loss option the Hessian of ``loss_func(f[S], y[S])`` with respect
to the output ``f[S]`` (torch.func.hessian, float64, the module exactly as PyTorch
computes it) must equal ``Σ_k r_k r_kᵀ`` of the root ``r = sqrt_hessian(S)``: block
diagonal over samples. Tolerance ``REORDERED_REL`` of the largest entry: both sides
are a handful of float64 operations on O(1) numbers, summed in another order.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import hessian

from tests.fixtures.checks import REORDERED_REL, assert_rel
from vivit.errors import (
    InvalidArgumentError,
    InvalidTargetsError,
    NonFiniteError,
    UnsupportedLossError,
)
from vivit.losses import LossCurvature, check_loss_function

N = 5
SUBSETS = [None, [3, 0], [4]]


def _targets_ce_index(shape, num_classes, gen, ignore=None):
    y = torch.randint(0, num_classes, shape, generator=gen)
    if ignore is not None:
        y[1] = ignore  # sample 1 fully ignored
        y.view(len(y), -1)[2, 0] = ignore  # sample 2 partly ignored
    return y


def _cases():
    """(id, loss module, output shape, target builder)."""
    gen = torch.Generator().manual_seed(0)

    def probs(shape, scale=1.0):
        return lambda: scale * torch.rand(shape, generator=gen, dtype=torch.float64)

    def normal(shape):
        return lambda: torch.randn(shape, generator=gen, dtype=torch.float64)

    def labels(shape, C, ignore=None):
        return lambda: _targets_ce_index(shape, C, gen, ignore)

    w4 = torch.tensor([0.5, 2.0, 1.0, 0.0], dtype=torch.float64)
    cases = []
    for red in ("mean", "sum"):
        cases += [
            (f"mse-{red}", nn.MSELoss(reduction=red), (N, 3), normal((N, 3))),
            (f"mse-seq-{red}", nn.MSELoss(reduction=red), (N, 2, 3), normal((N, 2, 3))),
            (f"ce-{red}", nn.CrossEntropyLoss(reduction=red), (N, 4), labels((N,), 4)),
            (
                f"ce-ignore-default-{red}",
                nn.CrossEntropyLoss(reduction=red),
                (N, 4),
                labels((N,), 4, ignore=-100),
            ),
            (
                f"ce-ignore-custom-{red}",
                nn.CrossEntropyLoss(reduction=red, ignore_index=2),
                (N, 4),
                labels((N,), 4, ignore=2),
            ),
            (
                f"ce-seq-ignore-{red}",
                nn.CrossEntropyLoss(reduction=red),
                (N, 4, 3),
                labels((N, 3), 4, ignore=-100),
            ),
            (
                f"ce-image-{red}",
                nn.CrossEntropyLoss(reduction=red),
                (N, 3, 2, 2),
                labels((N, 2, 2), 3),
            ),
            (
                f"ce-weight-{red}",
                nn.CrossEntropyLoss(weight=w4, reduction=red),
                (N, 4),
                labels((N,), 4),
            ),
            (
                f"ce-weight-ignore-smooth-seq-{red}",
                nn.CrossEntropyLoss(weight=w4, reduction=red, label_smoothing=0.2),
                (N, 4, 3),
                labels((N, 3), 4, ignore=-100),
            ),
            (
                f"ce-smooth-{red}",
                nn.CrossEntropyLoss(reduction=red, label_smoothing=0.3),
                (N, 4),
                labels((N,), 4),
            ),
            (
                f"ce-soft-{red}",
                nn.CrossEntropyLoss(reduction=red),
                (N, 4),
                probs((N, 4)),  # do not sum to one
            ),
            (
                f"ce-soft-scaled-{red}",
                nn.CrossEntropyLoss(reduction=red),
                (N, 4),
                probs((N, 4), scale=2.0),
            ),
            (
                f"ce-soft-weight-smooth-seq-{red}",
                nn.CrossEntropyLoss(weight=w4, reduction=red, label_smoothing=0.1),
                (N, 4, 2),
                probs((N, 4, 2)),
            ),
            (f"bce-{red}", nn.BCEWithLogitsLoss(reduction=red), (N, 3), probs((N, 3))),
            (
                f"bce-weights-{red}",
                nn.BCEWithLogitsLoss(
                    reduction=red,
                    weight=torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64),
                    pos_weight=torch.tensor([3.0, 0.2, 1.0], dtype=torch.float64),
                ),
                (N, 3),
                probs((N, 3)),
            ),
            (
                f"bce-outside-01-{red}",
                nn.BCEWithLogitsLoss(reduction=red),
                (N, 2, 2),
                normal((N, 2, 2)),
            ),
            # one output per sample, [N]: no axis past the samples
            (f"mse-per-sample-{red}", nn.MSELoss(reduction=red), (N,), normal((N,))),
            (
                f"bce-per-sample-{red}",
                nn.BCEWithLogitsLoss(
                    reduction=red, pos_weight=torch.tensor([3.0], dtype=torch.float64)
                ),
                (N,),
                probs((N,)),
            ),
        ]
    return cases


CASES = _cases()


def _dense_hessian(loss_func, output, targets):
    H = hessian(lambda f: loss_func(f, targets))(output)
    return H.reshape(output.numel(), output.numel())


def _from_root(root):
    """Block-diagonal Σ_k r_k r_kᵀ, [|S|·D, |S|·D]."""
    K, S = root.shape[:2]
    flat = root.reshape(K, S, -1)
    D = flat.shape[2]
    H = torch.zeros(S * D, S * D, dtype=root.dtype)
    for n in range(S):
        H[n * D : (n + 1) * D, n * D : (n + 1) * D] = flat[:, n].T @ flat[:, n]
    return H


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("subset", SUBSETS, ids=["all", "sub2", "sub1"])
def test_exact_root_is_the_module_hessian(case, subset):
    _, loss_func, shape, make_targets = case
    gen = torch.Generator().manual_seed(1)
    output = torch.randn(shape, generator=gen, dtype=torch.float64)
    targets = make_targets()
    curvature = LossCurvature(loss_func, output, targets)
    root = curvature.sqrt_hessian(subset)
    K = output[0].numel()
    assert root.shape == (K, N if subset is None else len(subset), *shape[1:])

    index = slice(None) if subset is None else torch.tensor(subset)
    f_s, y_s = output[index], targets[index]
    loss = loss_func(f_s, y_s)
    if torch.isnan(loss):  # the subset holds only ignored targets: no curvature
        assert (root == 0).all()
        return
    expected = _dense_hessian(loss_func, f_s, y_s)
    assert_rel(_from_root(root), expected, REORDERED_REL)

    # L = R Σ ℓ_n: R of the subset reproduces the loss module's normalization
    R = curvature.normalization.reduction_factor(subset)
    R_all = curvature.normalization.reduction_factor()
    assert R > 0 and R_all > 0


MEAN_CASES = [c for c in CASES if c[0].endswith("-mean")]


@pytest.mark.parametrize("case", MEAN_CASES, ids=[c[0] for c in MEAN_CASES])
def test_mc_root_is_unbiased(case):
    """The MC root's mean outer product converges to the exact Hessian (CLT bound)."""
    _, loss_func, shape, make_targets = case
    gen = torch.Generator().manual_seed(2)
    output = torch.randn(shape, generator=gen, dtype=torch.float64)
    curvature = LossCurvature(loss_func, output, make_targets())
    M = 4_000
    root = curvature.sqrt_hessian(mc_samples=M, generator=gen)
    assert root.shape == (M, *shape)
    exact = _from_root(curvature.sqrt_hessian())
    # 4 000 draws: standard error ≈ (few)/√M ≈ 3e-2 of the largest entry; 12 % is 4σ
    torch.testing.assert_close(
        _from_root(root), exact, atol=0.12 * exact.abs().max(), rtol=0
    )


def test_soft_targets_scale_the_hessian():
    """Targets 2p give twice the Hessian of p (issue 11: the scale was ignored)."""
    gen = torch.Generator().manual_seed(3)
    output = torch.randn(N, 4, generator=gen, dtype=torch.float64)
    p = torch.rand(N, 4, generator=gen, dtype=torch.float64).softmax(1)
    loss_func = nn.CrossEntropyLoss()
    one = LossCurvature(loss_func, output, p).sqrt_hessian()
    two = LossCurvature(loss_func, output, 2 * p).sqrt_hessian()
    # the same sums of products of roots that differ by a few roundings (√2·√2 ≠ 2)
    assert_rel(_from_root(two), 2 * _from_root(one), REORDERED_REL)


def test_ignored_samples_set_the_normalization():
    """Mean over counted targets: R = 1 / (number of counted samples)."""
    output = torch.randn(4, 3, dtype=torch.float64)
    targets = torch.tensor([0, -100, 2, -100])
    norm = LossCurvature(nn.CrossEntropyLoss(), output, targets).normalization
    assert norm.reduction_factor() == 0.5
    assert norm.reduction_factor([1, 3]) == 0.0
    assert norm.reduction_factor([0, 1]) == 1.0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored(reduction):
    output = torch.randn(3, 4, dtype=torch.float64)
    targets = torch.full((3,), -100)
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    if reduction == "mean":
        with pytest.raises(InvalidTargetsError, match="ignore_index=-100"):
            LossCurvature(loss_func, output, targets)
    else:  # the loss is 0 and so is its Hessian
        assert (LossCurvature(loss_func, output, targets).sqrt_hessian() == 0).all()


@pytest.mark.parametrize(
    "loss_func, words",
    [
        (torch.nn.functional.cross_entropy, ["torch.nn loss module", "cross_entropy"]),
        (
            nn.NLLLoss(),
            ["NLLLoss", "not supported", "drop the log_softmax", "CrossEntropyLoss"],
        ),
        (nn.BCELoss(), ["BCELoss", "not supported", "drop the sigmoid", "WithLogits"]),
        (
            nn.CrossEntropyLoss(reduction="none"),
            ["reduction='none'", "'mean' or 'sum'"],
        ),
        (nn.CrossEntropyLoss(weight=torch.tensor([1.0, -1.0])), ["weight", "negative"]),
        (
            nn.BCEWithLogitsLoss(pos_weight=torch.tensor([float("nan")])),
            ["pos_weight", "NaN"],
        ),
    ],
)
def test_refused_loss_functions(loss_func, words):
    with pytest.raises((UnsupportedLossError, NonFiniteError)) as info:
        check_loss_function(loss_func)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "loss_func, output, targets, error, words",
    [
        (
            nn.CrossEntropyLoss(),
            torch.randn(3, 4),
            torch.tensor([0, 4, 1]),
            InvalidTargetsError,
            ["class index 4", "sample 1"],
        ),
        (
            nn.CrossEntropyLoss(),
            torch.randn(3, 4),
            torch.tensor([0, -1, 1]),
            InvalidTargetsError,
            ["class index -1", "sample 1"],
        ),
        (
            nn.CrossEntropyLoss(),
            torch.randn(3, 4),
            torch.zeros(3, 2, dtype=torch.long),
            InvalidTargetsError,
            ["shape (3, 2)", "expected (3,)"],
        ),
        (
            nn.CrossEntropyLoss(),
            torch.randn(3, 4),
            torch.tensor([[0.5, -0.1, 0.3, 0.3]] * 3),
            InvalidTargetsError,
            ["negative", "sample 0"],
        ),
        (
            nn.CrossEntropyLoss(),
            torch.randn(3, 4),
            torch.tensor([True, False, True]),
            InvalidTargetsError,
            ["torch.bool"],
        ),
        (
            nn.BCEWithLogitsLoss(weight=torch.ones(3)),
            torch.randn(2, 3, 2),
            torch.rand(2, 3, 2),
            UnsupportedLossError,
            ["weight has shape (3,)", "(2, 3, 2)"],
        ),
        (
            nn.CrossEntropyLoss(),
            torch.randn(3, 4),
            torch.tensor([0, 1, 2], dtype=torch.int32),
            InvalidTargetsError,
            ["torch.int32", "targets.long()"],
        ),
        (
            nn.CrossEntropyLoss(),
            torch.randn(4),
            torch.tensor(1),
            InvalidTargetsError,
            ["shape (4,)", "batch axis", "unsqueeze(0)", "BCEWithLogitsLoss"],
        ),
        (
            nn.CrossEntropyLoss(),
            torch.randn(3, 5, 4),
            torch.randint(0, 5, (3, 4, 1)),
            InvalidTargetsError,
            ["shape (3, 4, 1)", "targets.reshape(3, 4)"],
        ),
        (
            nn.MSELoss(),
            torch.randn(3),
            torch.randn(3, 1),
            InvalidTargetsError,
            ["shape (3, 1)", "same shape", "targets.view_as(output)", "broadcast"],
        ),
        (
            nn.BCEWithLogitsLoss(),
            torch.randn(3, 0),
            torch.rand(3, 0),
            InvalidArgumentError,
            ["shape (3, 0)", "no entries per sample"],
        ),
        (
            nn.CrossEntropyLoss(),
            torch.randn(3, 5, 4),
            torch.randint(0, 5, (3, 4)).float(),
            InvalidTargetsError,
            ["class indices must be integers", "targets.long()", "(3, 5, 4)"],
        ),
        (
            nn.MSELoss(),
            torch.randn(3, 2),
            torch.randn(3, 1),
            InvalidTargetsError,
            ["shape (3, 1)", "same shape"],
        ),
        (
            nn.MSELoss(),
            torch.randn(3, 2),
            torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [0.0, 0.0]]),
            NonFiniteError,
            ["targets", "NaN", "sample(s) 1"],
        ),
        (
            nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0])),
            torch.randn(3, 1),
            torch.tensor([[0.0], [-3.0], [0.0]]),
            InvalidTargetsError,
            ["pos_weight", "sample 1", "[0, 1]"],
        ),
        (
            nn.CrossEntropyLoss(weight=torch.tensor([0.0, 1.0])),
            torch.randn(2, 2),
            torch.tensor([0, 0]),
            InvalidTargetsError,
            ["class weight 0"],
        ),
    ],
)
def test_refused_targets(loss_func, output, targets, error, words):
    with pytest.raises(error) as info:
        LossCurvature(loss_func, output, targets)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("positions", [(4,), (2, 3)], ids=["T", "HxW"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_logits_flattened_over_positions_are_named(positions, reduction):
    """Logits ``[N·T, C]`` with targets ``[N, T]``: the message gives ``[N, C, T]``."""
    N, C = 3, 5
    output = torch.randn(N * math.prod(positions), C, dtype=torch.float64)
    targets = torch.randint(0, C, (N, *positions))
    layout = f"reshape({N}, {', '.join(map(str, positions))}, {C}).movedim(-1, 1)"
    with pytest.raises(InvalidTargetsError, match=r"\[N, C, \*T\]") as error:
        LossCurvature(nn.CrossEntropyLoss(reduction=reduction), output, targets)
    assert layout in str(error.value)
    # the advice is right: in that layout the targets fit
    logits = output.reshape(N, *positions, C).movedim(-1, 1)
    LossCurvature(nn.CrossEntropyLoss(reduction=reduction), logits, targets)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_class_indices_with_an_axis_of_one_are_named(reduction):
    """Targets ``[N, 1]`` for logits ``[N, C]``: squeeze the targets, not the logits."""
    output = torch.randn(4, 3, dtype=torch.float64)
    targets = torch.randint(0, 3, (4, 1))
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    with pytest.raises(InvalidTargetsError) as error:
        LossCurvature(loss_func, output, targets)
    message = str(error.value)
    assert "targets.squeeze(1)" in message and "targets.view(-1)" in message
    assert "movedim" not in message and "logits.reshape" not in message
    # the advice is right: the squeezed targets fit
    LossCurvature(loss_func, output, targets.squeeze(1))
