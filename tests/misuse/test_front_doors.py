"""Misuse of every front door: the exact exception class and the words it must say.

Issue 11 items 2-4: non-finite values are named where they enter (inputs, targets,
parameters, model output, loss, Newton steps); arguments, layers and memory are
checked up front, with a message that says what is wrong and what to do; and the
caller's tensors, RNG and modules are left as they were.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import backpack, extend
from torch import nn

import vivit.gram.memory
from tests.fixtures.checks import (
    EIGVAL_RTOL,
    EIGVEC_PRODUCT_REL32,
    assert_rel,
    assert_top_eigvals,
)
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn
from vivit import (
    BatchNormTrainingError,
    DirectionalDampedNewtonComputation,
    EighComputation,
    EigvalshComputation,
    GradientContextError,
    GramTooLargeError,
    InvalidArgumentError,
    InvalidSubsamplingError,
    InvalidTargetsError,
    LowRankGGN,
    NonFiniteError,
    ParamGroupError,
    RandomForwardWarning,
    ResultNotReadyError,
    UnsupportedDtypeError,
    UnsupportedLayerError,
    UnsupportedLossError,
    VivitError,
)
from vivit.optim import DampedNewton

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing:UserWarning"
)

DTYPES = [torch.float32, torch.float64]
REDUCTIONS = ["mean", "sum"]


def problem(dtype=torch.float64, reduction="mean", N=4, loss="ce"):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = mlp(3, 4, 2).to(dtype)
    X = torch.randn(N, 3, generator=gen).to(dtype)
    if loss == "ce":
        y = torch.randint(0, 2, (N,), generator=gen)
        loss_func = nn.CrossEntropyLoss(reduction=reduction)
    else:
        y = torch.randn(N, 2, generator=gen).to(dtype)
        loss_func = nn.MSELoss(reduction=reduction)
    return model, loss_func, X, y


def raises(error, *words):
    """pytest.raises(error) and every word in the message."""

    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(error)
            self._info = self._ctx.__enter__()
            return self._info

        def __exit__(self, *exc):
            suppressed = self._ctx.__exit__(*exc)
            message = str(self._info.value)
            for word in words:
                assert word in message, f"{word!r} not in {message!r}"
            assert isinstance(self._info.value, VivitError)
            return suppressed

    return _Check()


# ----------------------------------------------------------------------------------
# 2. Non-finite values, named where they enter
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_inputs(dtype, reduction, value):
    model, loss_func, X, y = problem(dtype, reduction)
    X[2, 1] = value
    kind = "NaN" if value != value else "inf"
    with raises(NonFiniteError, "inputs", kind, "sample(s) 2"):
        LowRankGGN(model, loss_func, (X, y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_non_finite_targets(dtype, reduction):
    model, loss_func, X, y = problem(dtype, reduction, loss="mse")
    y[1, 0] = float("nan")
    with raises(NonFiniteError, "targets", "NaN", "sample(s) 1"):
        LowRankGGN(model, loss_func, (X, y))
    # the hook API finds them in the backward pass
    model, loss_func = extend(model), extend(loss_func)
    computation = EigvalshComputation()
    groups = [{"params": list(model.parameters())}]
    with (
        raises(NonFiniteError, "targets", "sample(s) 1"),
        backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ),
    ):
        loss_func(model(X), y).backward()


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_parameter(dtype):
    model, loss_func, X, y = problem(dtype)
    with torch.no_grad():
        model[2].weight[0, 1] = float("nan")
    with raises(NonFiniteError, "parameter '2.weight'", "NaN", "1 of 8 entries"):
        LowRankGGN(model, loss_func, (X, y))
    with raises(NonFiniteError, "parameter of shape (2, 4)"):
        EigvalshComputation().get_extension_hook([{"params": [model[2].weight]}])
    with raises(NonFiniteError, "parameter of shape (2, 4)"):
        DampedNewton(model.parameters())


def test_non_finite_model_output_in_closure():
    """from_loss cannot see the inputs: the model output is named instead."""
    model, loss_func, X, y = problem()
    X[3] = float("inf")
    model, loss_func = extend(model), extend(loss_func)
    with raises(NonFiniteError, "model output", "sample(s) 3"):
        LowRankGGN.from_loss(lambda: loss_func(model(X), y), [list(model.parameters())])


def test_non_finite_loss():
    """Finite inputs, targets and output whose loss overflows (float32 MSE)."""
    model, loss_func, X, y = problem(torch.float32, "sum", loss="mse")
    y = torch.full_like(y, 3e19)
    with raises(NonFiniteError, "loss", "inf"):
        LowRankGGN(model, loss_func, (X, y))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_damped_newton_non_finite_loss_leaves_parameters(reduction):
    model, loss_func, X, y = problem(reduction=reduction)
    model, loss_func = extend(model), extend(loss_func)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DampedNewton(model.parameters(), damping=0.0)
    X[0] = float("nan")
    with raises(NonFiniteError, "model output", "sample(s) 0"):
        optimizer.step(lambda: loss_func(model(X), y))
    assert all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )


def test_damped_newton_non_finite_step_leaves_parameters(monkeypatch):
    model, loss_func, X, y = problem()
    model, loss_func = extend(model), extend(loss_func)
    before = [p.detach().clone() for p in model.parameters()]
    newton = LowRankGGN.newton

    def overflowing(self, *args, **kwargs):
        result = newton(self, *args, **kwargs)
        result.step[-1][0] = float("inf")
        return result

    monkeypatch.setattr(LowRankGGN, "newton", overflowing)
    optimizer = DampedNewton(model.parameters())
    with raises(NonFiniteError, "Newton step", "parameters are unchanged"):
        optimizer.step(lambda: loss_func(model(X), y))
    assert all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_targets_ignored(reduction):
    model, loss_func, X, _ = problem(reduction=reduction)
    y = torch.full((4,), -100)
    if reduction == "mean":
        with raises(InvalidTargetsError, "ignore_index=-100", "NaN"):
            LowRankGGN(model, loss_func, (X, y))
    else:  # the loss is 0 and has no curvature
        evals = LowRankGGN(model, loss_func, (X, y)).eigvalsh()
        assert (evals == 0).all()


# ----------------------------------------------------------------------------------
# 3. Arguments validated up front
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, error, words",
    [
        (
            (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)),
            InvalidArgumentError,
            ["empty", "(0, 3)"],
        ),
        (
            (torch.zeros(4, 3), torch.zeros(3, dtype=torch.long)),
            InvalidTargetsError,
            ["4 samples", "(3,)"],
        ),
        (
            [torch.zeros(4, 3)],
            InvalidArgumentError,
            ["pair (inputs, targets)", "list of 1"],
        ),
        (torch.zeros(4, 3), InvalidArgumentError, ["pair (inputs, targets)", "Tensor"]),
        ((torch.zeros(4, 3), [0, 1, 0, 1]), InvalidArgumentError, ["pair", "list"]),
    ],
)
def test_bad_batches(data, error, words):
    model, loss_func, _, _ = problem(torch.float32)
    with raises(error, *words):
        LowRankGGN(model, loss_func, data)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_grad_context_works(reduction):
    model, loss_func, X, y = problem(reduction=reduction)
    expected = LowRankGGN(model, loss_func, (X, y)).eigvalsh()
    with torch.no_grad():
        evals = LowRankGGN(model, loss_func, (X, y)).eigvalsh()
        model, loss_func = extend(model), extend(loss_func)  # closures need BackPACK
        from_closure = LowRankGGN.from_loss(
            lambda: loss_func(model(X), y), [list(model.parameters())]
        ).eigvalsh()
        optimizer = DampedNewton(model.parameters())
        optimizer.step(lambda: loss_func(model(X), y))
    torch.testing.assert_close(evals, expected, rtol=0, atol=0)
    torch.testing.assert_close(from_closure, expected, rtol=0, atol=0)
    assert torch.is_grad_enabled() is not False  # the context was restored


def test_loss_tensor_without_gradients():
    model, loss_func, X, y = problem()
    model, loss_func = extend(model), extend(loss_func)
    with torch.no_grad():
        loss = loss_func(model(X), y)
    with raises(GradientContextError, "torch.no_grad()", "function"):
        LowRankGGN.from_loss(loss, [list(model.parameters())])


def test_inference_mode_refused():
    model, loss_func, X, y = problem()
    with torch.inference_mode():
        with raises(GradientContextError, "inference_mode"):
            LowRankGGN(model, loss_func, (X, y))
        with raises(GradientContextError, "inference_mode"):
            LowRankGGN.from_loss(lambda: None, [list(model.parameters())])
        with raises(GradientContextError, "inference_mode"):
            DampedNewton(model.parameters())
        X_inference = X.clone()
    with raises(GradientContextError, "inputs", "inference_mode", "clone()"):
        LowRankGGN(model, loss_func, (X_inference, y))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_refused(dtype):
    model, loss_func, X, y = problem(torch.float32)
    model, X = model.to(dtype), X.to(dtype)
    words = [str(dtype), "float32 and float64"]
    with raises(UnsupportedDtypeError, *words):
        LowRankGGN(model, loss_func, (X, y))
    with raises(UnsupportedDtypeError, *words):
        EigvalshComputation().get_extension_hook([{"params": list(model.parameters())}])
    with raises(UnsupportedDtypeError, *words):
        DampedNewton(model.parameters())


def test_inputs_of_another_dtype():
    model, loss_func, X, y = problem(torch.float64)
    with raises(InvalidArgumentError, "torch.float32", "torch.float64", "inputs.to"):
        LowRankGGN(model, loss_func, (X.float(), y))


@pytest.mark.parametrize(
    "loss_func, words",
    [
        (torch.nn.functional.cross_entropy, ["torch.nn loss module", "function"]),
        (lambda f, y: ((f - y) ** 2).sum(), ["torch.nn loss module", "<lambda>"]),
        (nn.NLLLoss(), ["NLLLoss", "not supported"]),
        (nn.MSELoss(reduction="none"), ["reduction='none'"]),
        (nn.CrossEntropyLoss(reduction="none"), ["reduction='none'"]),
    ],
)
def test_loss_functions_that_are_not_supported(loss_func, words):
    model, _, X, y = problem()
    with raises(UnsupportedLossError, *words):
        LowRankGGN(model, loss_func, (X, y))


def _param_group_cases():
    model, *_ = problem()
    params = list(model.parameters())
    other = nn.Linear(3, 4)
    nonleaf = params[0] * 2
    return model, [
        ([], ["empty", "None"]),
        (params, ["flat list", "[params]"]),
        (params[0], ["list of lists", "Parameter"]),
        ([{"params": params}], ["dicts", "group['params']"]),
        ([[1, 2]], ["Group 0", "int", "expected parameters"]),
        ([["weight"]], ["Group 0", "str"]),
        ([params, []], ["Group 1 has no parameters"]),
        ([[nonleaf]], ["computed from other tensors"]),
        ([[other.weight]], ["not a parameter of the model"]),
        ([params, params[:1]], ["more than one group"]),
        ("all", ["list of lists", "str"]),
    ]


@pytest.mark.parametrize("case", range(11))
def test_param_groups_misuse(case):
    model, cases = _param_group_cases()
    param_groups, words = cases[case]
    _, loss_func, X, y = problem()
    with raises(ParamGroupError, *words):
        LowRankGGN(model, loss_func, (X, y), param_groups=param_groups)


def test_param_groups_as_generators_are_fine():
    model, loss_func, X, y = problem()
    expected = LowRankGGN(model, loss_func, (X, y)).eigvalsh()
    evals = LowRankGGN(
        model, loss_func, (X, y), param_groups=(p for p in [model.parameters()])
    ).eigvalsh()
    torch.testing.assert_close(evals, expected, rtol=0, atol=0)


def test_frozen_parameter_in_group():
    model, loss_func, X, y = problem()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ParamGroupError, match="does not require gradients"):
        LowRankGGN(model, loss_func, (X, y), param_groups=[[model[0].weight]])


SHARED = nn.Parameter(torch.zeros(2))  # in two groups of the hook API


@pytest.mark.parametrize(
    "param_groups, words",
    [
        ([], ["param_groups is empty"]),
        ({"params": []}, ["list of dicts", "dict"]),
        ([{"params": iter([])}], ["read only once", "list("]),
        ([{"params": torch.zeros(2, requires_grad=True)}], ["single tensor"]),
        ([[torch.zeros(2)]], ["Group 0 is a list", "expected a dict"]),
        ([{"params": [SHARED]}, {"params": [SHARED]}], ["more than one group"]),
    ],
)
def test_hook_api_param_groups_misuse(param_groups, words):
    with raises(ParamGroupError, *words):
        EigvalshComputation().get_extension_hook(param_groups)


def test_hook_api_criterion_not_callable():
    model, *_ = problem()
    groups = [{"params": list(model.parameters()), "criterion": 3}]
    with raises(ParamGroupError, "'criterion' of group 0", "int", "function"):
        EighComputation().get_extension_hook(groups)


def test_group_without_criterion():
    model, *_ = problem()
    with pytest.raises(ParamGroupError, match="criterion"):
        EighComputation().get_extension_hook([{"params": list(model.parameters())}])


def test_result_before_backward():
    model, *_ = problem()
    group = {"params": list(model.parameters()), "criterion": lambda evals: [0]}
    computation = EighComputation()
    computation.get_extension_hook([group])
    with pytest.raises(ResultNotReadyError, match=r"backward\(\)"):
        computation.get_result(group)
    with pytest.raises(KeyError):  # ViViT raised KeyError; scripts may catch it
        EigvalshComputation().get_result(group)


@pytest.mark.parametrize("mc_samples", [-1, 1.5, True])
def test_bad_mc_samples(mc_samples):
    with pytest.raises(ValueError, match="mc_samples"):
        EigvalshComputation(mc_samples=mc_samples)


def test_out_of_range_subsampling_in_training_loop():
    model, loss_func, X, y = problem()
    model, loss_func = extend(model), extend(loss_func)
    computation = EigvalshComputation(subsampling=[0, 7])
    groups = [{"params": list(model.parameters())}]
    with (
        pytest.raises(InvalidSubsamplingError, match="outside the mini-batch"),
        backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ),
    ):
        loss_func(model(X), y).backward()


def test_criterion_selecting_zero_eigenvalue():
    """As in ViViT 1.0 no error: the eigenvalue as computed, a zero direction."""
    model, loss_func, X, y = problem(torch.float32)
    model, loss_func = extend(model), extend(loss_func)
    computation = EighComputation(warn_small_eigvals=0)
    # cross-entropy with 2 classes: rank ≤ N·(C−1), the smallest Gram eigenvalue is 0
    groups = [{"params": list(model.parameters()), "criterion": lambda evals: [0]}]
    with backpack(
        computation.get_extension(),
        extension_hook=computation.get_extension_hook(groups),
    ):
        loss_func(model(X), y).backward()
    evals, evecs = computation.get_result(groups[0])
    assert evals.shape == (1,) and evals.abs() < 1e-6
    assert all((e == 0).all() for e in evecs)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"generator": 0}, InvalidArgumentError, ["torch.Generator", "int"]),
        ({"generator": "cpu"}, InvalidArgumentError, ["torch.Generator", "str"]),
        ({"mc_samples": -1}, InvalidArgumentError, ["mc_samples", "-1"]),
        ({"mc_samples": 1.5}, InvalidArgumentError, ["mc_samples", "1.5"]),
        ({"subsampling": [0, 0]}, InvalidSubsamplingError, ["repeats", "[0]"]),
        ({"subsampling": [4]}, InvalidSubsamplingError, ["[4]", "0 to 3"]),
    ],
)
def test_keyword_misuse(kwargs, error, words):
    model, loss_func, X, y = problem()
    with raises(error, *words):
        LowRankGGN(model, loss_func, (X, y), **kwargs)


@pytest.mark.parametrize(
    "subsampling, match",
    [
        ([0, 0, 1], r"repeats the sample indices \[0\]"),
        ([1, 4], "outside the mini-batch"),
    ],
    ids=["repeated", "out-of-range"],
)
def test_bad_subsampling(subsampling, match):
    model, loss_func, X, y = problem(N=4)
    with pytest.raises(InvalidSubsamplingError, match=match):
        LowRankGGN(model, loss_func, (X, y), subsampling=subsampling)
    ggn = LowRankGGN(model, loss_func, (X, y))
    with pytest.raises(InvalidSubsamplingError, match=match):
        ggn.directional_derivatives(subsampling_grad=subsampling)


def test_bad_top_k_and_group_index():
    model, loss_func, X, y = problem()
    ggn = LowRankGGN(model, loss_func, (X, y))
    with pytest.raises(ValueError, match="top_k"):
        ggn.eigh(top_k=0)
    with pytest.raises(IndexError, match="group"):
        ggn.eigvalsh(group=1)


def test_negative_damping():
    model, loss_func, X, y = problem()
    ggn = LowRankGGN(model, loss_func, (X, y))
    with pytest.raises(ValueError, match="damping must be a number >= 0"):
        ggn.newton_step(damping=-1.0)
    with pytest.raises(ValueError, match="Dampings must be >= 0"):
        ggn.newton_step(damping=lambda evals, *_: -evals)


@pytest.mark.parametrize("damping", ["1", None, True])
def test_damping_neither_number_nor_callable(damping):
    model, loss_func, X, y = problem()
    with pytest.raises(ValueError, match="damping must be a number"):
        LowRankGGN(model, loss_func, (X, y)).newton_step(damping=damping)
    with pytest.raises(ValueError, match="damping must be a number"):
        DampedNewton(model.parameters(), damping=damping)
    group = {"params": list(model.parameters()), "criterion": list, "damping": damping}
    with pytest.raises(ValueError, match='group\\["damping"\\] must be a number'):
        DirectionalDampedNewtonComputation().get_extension_hook([group])


def test_constant_damping_in_hook_api():
    model, loss_func, X, y = problem(torch.float32)
    model, loss_func = extend(model), extend(loss_func)
    group = {
        "params": list(model.parameters()),
        "criterion": lambda evals: [len(evals) - 1],
        "damping": 0.5,
    }
    computation = DirectionalDampedNewtonComputation()
    with backpack(
        *computation.get_extensions(),
        extension_hook=computation.get_extension_hook([group]),
    ):
        loss_func(model(X), y).backward()
    step = computation.get_result(group)
    expected = LowRankGGN(model, loss_func, (X, y)).newton_step(top_k=1, damping=0.5)
    # float32 Gram matrices of one problem along the leading direction:
    # EIGVEC_PRODUCT_REL32 ("Tolerances of the tests", "Float32 factors") where
    # N·C·λ_max/gap ≤ 840, asserted on the dense spectrum
    evals = torch.linalg.eigvalsh(dense_ggn(model, loss_func, X, y))
    assert len(X) * 2 * evals[-1] / (evals[-1] - evals[-2]) <= 840
    for s, e in zip(step, expected, strict=True):
        assert_rel(s, e, EIGVEC_PRODUCT_REL32)


def test_generator_reproduces_and_works_on_its_device():
    model, loss_func, X, y = problem()
    runs = [
        LowRankGGN(
            model,
            loss_func,
            (X, y),
            mc_samples=2,
            generator=torch.Generator().manual_seed(3),
        ).eigvalsh()
        for _ in range(2)
    ]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


@pytest.mark.parametrize(
    "loss, words",
    [
        (nn.CrossEntropyLoss(), ["CrossEntropyLoss", "LowRankGGN(model, loss_func"]),
        (3.0, ["float"]),
    ],
)
def test_from_loss_misuse(loss, words):
    model, *_ = problem()
    with raises(InvalidArgumentError, *words):
        LowRankGGN.from_loss(loss, [list(model.parameters())])


def test_from_loss_non_scalar():
    model, _, X, y = problem()
    model = extend(model)
    loss_func = extend(nn.CrossEntropyLoss(reduction="none"))
    with raises(InvalidArgumentError, "shape (4,)", "scalar"):
        LowRankGGN.from_loss(lambda: loss_func(model(X), y), [list(model.parameters())])


@pytest.mark.parametrize(
    "closure",
    [
        lambda m, f, X, y: 2 * f(m(X), y),
        lambda m, f, X, y: f(m(X), y) + sum((p**2).sum() for p in m.parameters()),
        lambda m, f, X, y: 10.0 - f(m(X), y),
        lambda m, f, X, y: 0.5 * (f(m(X[:2]), y[:2]) + f(m(X[2:]), y[2:])),
    ],
    ids=["scaled", "regularized", "negated", "two-calls"],
)
def test_closure_loss_must_be_the_loss_modules_output(closure):
    """Anything but the loss module's output (plus a constant) would pair the loss
    module's GGN with another function's gradient: refused, nothing updated."""
    model, loss_func, X, y = problem()
    model, loss_func = extend(model), extend(loss_func)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidArgumentError, match="loss module"):
        DampedNewton(model.parameters()).step(lambda: closure(model, loss_func, X, y))
    with pytest.raises(InvalidArgumentError, match="loss module"):
        LowRankGGN.from_loss(
            lambda: closure(model, loss_func, X, y), [list(model.parameters())]
        )
    assert all(map(torch.equal, model.parameters(), before))
    shifted = LowRankGGN.from_loss(
        lambda: loss_func(model(X), y) - 10.0, [list(model.parameters())]
    )
    plain = LowRankGGN.from_loss(
        lambda: loss_func(model(X), y), [list(model.parameters())]
    )
    assert torch.equal(shifted.eigvalsh(), plain.eigvalsh())


@pytest.mark.parametrize(
    "params, kwargs, error, words",
    [
        ([], {}, ParamGroupError, ["params is empty"]),
        ("model", {"lr": 0}, InvalidArgumentError, ["lr", "0"]),
        ("model", {"lr": float("nan")}, InvalidArgumentError, ["lr", "nan"]),
        ("model", {"lr": True}, InvalidArgumentError, ["lr", "True"]),
        ("model", {"lr": float("inf")}, InvalidArgumentError, ["lr", "inf"]),
        ("model", {"damping": -1.0}, InvalidArgumentError, ["damping", "-1.0"]),
        ("model", {"damping": float("nan")}, InvalidArgumentError, ["damping", "nan"]),
        ("model", {"top_k": 0}, InvalidArgumentError, ["top_k", "0"]),
        ("tensor", {}, ParamGroupError, ["single tensor"]),
        ("ints", {}, ParamGroupError, ["int", "expected parameters"]),
        ("dict-no-params", {}, ParamGroupError, ["does not specify ['params']"]),
    ],
)
def test_damped_newton_constructor(params, kwargs, error, words):
    model, *_ = problem()
    if isinstance(params, str):
        params = {
            "model": model.parameters(),
            "tensor": model[0].weight,
            "ints": [1, 2],
            "dict-no-params": [{"lr": 1.0}],
        }[params]
    with raises(error, *words):
        DampedNewton(params, **kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"lr": float("inf")}, ["lr", "finite", "inf"]),  # the step would be NaN
        ({"lr": float("nan")}, ["lr", "nan"]),
        ({"lr": 0.0}, ["lr", "0.0"]),
        ({"lr": "1"}, ["lr", "'1'"]),
        ({"max_decrease": float("nan")}, ["max_decrease", "nan"]),
        ({"max_decrease": -1.0}, ["max_decrease", "-1.0"]),
        ({"max_decrease": "0.1"}, ["max_decrease", "'0.1'"]),
        ({"damping": -1.0}, ["damping", "-1.0"]),
    ],
)
def test_lowrank_newton_arguments(kwargs, words):
    """``LowRankGGN.newton`` checks ``lr`` as ``DampedNewton`` does, and names
    ``max_decrease`` (not the dampings derived from it)."""
    model, loss_func, X, y = problem()
    ggn = LowRankGGN(model, loss_func, (X, y))
    with raises(InvalidArgumentError, *words) as info:
        ggn.newton(**kwargs)
    assert "Dampings" not in str(info.value)


def test_damped_newton_dict_groups_with_generators():
    model, loss_func, X, y = problem()
    model, loss_func = extend(model), extend(loss_func)
    optimizer = DampedNewton(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    )
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    optimizer.step(lambda: loss_func(model(X), y))


def test_damped_newton_closure_calling_backward():
    model, loss_func, X, y = problem()
    model, loss_func = extend(model), extend(loss_func)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DampedNewton(model.parameters())

    def closure():
        loss = loss_func(model(X), y)
        loss.backward()
        return loss

    with raises(InvalidArgumentError, "closure called backward()"):
        optimizer.step(closure)
    assert all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("closure", [None, 3.0])
def test_damped_newton_step_without_closure(closure):
    model, *_ = problem()
    with raises(InvalidArgumentError, "closure"):
        DampedNewton(model.parameters()).step(closure)


def test_damped_newton_without_extension():
    model, loss_func, X, y = problem()
    optimizer = DampedNewton(model.parameters())
    with pytest.raises(RuntimeError, match="backpack.extend"):
        optimizer.step(lambda: loss_func(model(X), y))


# Models and Gram matrices the engines refuse, before the first pass ---------------


@pytest.mark.parametrize("engine", ["auto", "backpack", "func"])
def test_batchnorm_in_training_mode(engine):
    """Refused before the forward pass: the running statistics stay as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    data = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BatchNormTrainingError, match=r"model\.eval\(\)"):
        LowRankGGN(model, nn.CrossEntropyLoss(), data, engine=engine)
    with pytest.raises(BatchNormTrainingError):
        DampedNewton(
            model.parameters(), model=model, loss_func=nn.CrossEntropyLoss()
        ).step(data=data)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("engine", ["auto", "backpack", "func"])
def test_batchnorm_without_running_statistics(engine):
    """Eval mode does not help: without running statistics BatchNorm normalizes
    with the batch's (BackPACK used to fail with an AttributeError)."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4, track_running_stats=False)
    model = nn.Sequential(nn.Linear(3, 4), norm, nn.Linear(4, 2)).eval()
    data = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(BatchNormTrainingError, match="track_running_stats=True"):
        LowRankGGN(model, nn.CrossEntropyLoss(), data, engine=engine)


@pytest.mark.parametrize(
    "layer, hint",
    [(nn.LayerNorm(4), "LayerNorm"), (nn.GELU(), "GELU")],
    ids=["LayerNorm", "GELU"],
)
def test_unsupported_layer_is_named(layer, hint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), layer, nn.Linear(4, 2))
    data = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(UnsupportedLayerError, match=hint) as info:
        LowRankGGN(model, nn.CrossEntropyLoss(), data, engine="backpack")
    assert "Supported layers: " in str(info.value) and "Linear" in str(info.value)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(1, 2, 3, padding="same"),
        nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"),
        nn.Conv2d(1, 2, 3, padding=1, padding_mode="circular"),
    ],
    ids=["same", "reflect", "circular"],
)
def test_convolution_padding_backpack_gets_wrong(conv):
    # BackPACK's derivatives silently give wrong columns for these: refuse them.
    model = nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(2))
    X = torch.randn(3, 1, 4, 4)
    model(X)
    with pytest.raises(UnsupportedLayerError, match="padding_mode='zeros'"):
        LowRankGGN(
            model,
            nn.CrossEntropyLoss(),
            (X, torch.randint(0, 2, (3,))),
            engine="backpack",
        )


def test_gram_too_large_is_refused_with_options(monkeypatch):
    # 16 x 16 float32 Gram: 4 squares of 1 KiB do not fit into 1024 bytes.
    monkeypatch.setattr(vivit.gram.memory, "available_bytes", lambda device: 1024)
    model, loss_func, X, y = problem(torch.float32, N=8)
    with pytest.raises(GramTooLargeError) as info:  # before the backward pass
        LowRankGGN(model, loss_func, (X, y), solver="dense")
    message = str(info.value)
    for option in ("GiB", "mc_samples=1", "subsampling", "solver='factor_krylov'"):
        assert option in message
    ggn = LowRankGGN(model, loss_func, (X, y))  # "auto" forms the Gram on demand
    with pytest.raises(GramTooLargeError):
        ggn.eigvalsh()


def test_gram_that_fits_is_accepted(monkeypatch):
    # 8 x 8 float32 Gram: 4 squares of 256 bytes fit into 1024 bytes.
    monkeypatch.setattr(vivit.gram.memory, "available_bytes", lambda device: 1024)
    model, loss_func, X, y = problem(torch.float32, N=4)
    assert LowRankGGN(model, loss_func, (X, y)).gram().shape == (8, 8)


# ----------------------------------------------------------------------------------
# 4. No side effects on the caller's tensors, RNG and modules
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", [True, False])
def test_input_and_parameter_grads_untouched(preset):
    model, loss_func, X, y = problem()
    X.requires_grad_(True)
    first, last = list(model[0].parameters()), list(model[2].parameters())
    if preset:
        X.grad = torch.ones_like(X)
        for p in model.parameters():
            p.grad = torch.full_like(p, 2.0)
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=[last])
    G = dense_ggn(model, loss_func, X, y, params=last)
    assert_top_eigvals(
        ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
    )
    if preset:
        assert (X.grad == 1).all()
        assert all((p.grad == 2).all() for p in model.parameters())
    else:
        assert X.grad is None
        assert all(p.grad is None for p in first + last)


def test_closure_leaves_grads_untouched():
    model, loss_func, X, y = problem()
    model, loss_func = extend(model), extend(loss_func)
    X.requires_grad_(True)
    LowRankGGN.from_loss(lambda: loss_func(model(X), y), [list(model[2].parameters())])
    assert X.grad is None and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("generator", [None, "given"])
def test_rng_state_and_module_state_untouched(generator):
    model, loss_func, X, y = problem()
    model.append(nn.BatchNorm1d(2).double()).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    generator = torch.Generator().manual_seed(0) if generator else None
    LowRankGGN(model, loss_func, (X, y), mc_samples=2, generator=generator)
    after = torch.get_rng_state()
    if generator is None:  # one draw for the MC seed, as by any sampling operation
        torch.set_rng_state(rng)
        torch.randint(0, 2**62, ())
        rng = torch.get_rng_state()
    assert torch.equal(after, rng)
    assert not model.training and not any(m.training for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_dropout_in_training_mode_warns_by_name():
    model, loss_func, X, y = problem()
    model.insert(1, nn.Dropout(0.25))
    rng = torch.get_rng_state()
    with pytest.warns(RandomForwardWarning, match=r"Dropout\(p=0.25.*training mode"):
        LowRankGGN(model, loss_func, (X, y))
    assert torch.equal(torch.get_rng_state(), rng)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RandomForwardWarning)
        ggn = LowRankGGN(model, loss_func, (X, y))
    G = dense_ggn(model, loss_func, X, y)
    assert_top_eigvals(
        ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
    )
