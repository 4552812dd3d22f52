"""Misuse of every front door: the exact exception class and the words it must say.

Issue 11 items 2-4: non-finite values are named where they enter (inputs, targets,
parameters, model output, loss, Newton steps), arguments are validated up front,
and the caller's tensors, RNG and modules are left as they were.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import backpack, extend
from torch import nn

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    assert_top_eigvals,
)
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn
from vivit import (
    EighComputation,
    EigvalshComputation,
    GradientContextError,
    InvalidArgumentError,
    InvalidSubsamplingError,
    InvalidTargetsError,
    LowRankGGN,
    NonFiniteError,
    ParamGroupError,
    RandomForwardWarning,
    UnsupportedDtypeError,
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


@pytest.mark.parametrize(
    "param_groups, words",
    [
        ([], ["param_groups is empty"]),
        ({"params": []}, ["list of dicts", "dict"]),
        ([{"params": iter([])}], ["read only once", "list("]),
        ([{"params": torch.zeros(2, requires_grad=True)}], ["single tensor"]),
        ([[torch.zeros(2)]], ["Group 0 is a list", "expected a dict"]),
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


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"generator": 0}, InvalidArgumentError, ["torch.Generator", "int"]),
        ({"generator": "cpu"}, InvalidArgumentError, ["torch.Generator", "str"]),
        ({"mc_samples": -1}, InvalidArgumentError, ["mc_samples", "-1"]),
        ({"mc_samples": 1.5}, InvalidArgumentError, ["mc_samples", "1.5"]),
        ({"subsampling": [0, 0]}, InvalidSubsamplingError, ["repeats", "[0]"]),
        ({"subsampling": [4]}, InvalidSubsamplingError, ["[4]", "0 to 3"]),
        ({"subsampling": []}, InvalidSubsamplingError, ["empty"]),
    ],
)
def test_keyword_misuse(kwargs, error, words):
    model, loss_func, X, y = problem()
    with raises(error, *words):
        LowRankGGN(model, loss_func, (X, y), **kwargs)


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
        ("model", {"generator": 1}, InvalidArgumentError, ["torch.Generator"]),
        ("model", {"mc_samples": -2}, InvalidArgumentError, ["mc_samples"]),
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
