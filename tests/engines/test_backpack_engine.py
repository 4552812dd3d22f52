"""The BackPACK engine: what it refuses (and says so), and what it leaves behind.

Refusals (issue 8, item 5): a weight used twice in one forward pass is refused
instead of silently counted once; errors name the innermost layer or function that
cannot be handled, and the engine that can (func). Side effects (item 6): after a
``LowRankGGN`` call the caller's model and loss carry no hooks, no stored inputs and
no factors, so ``torch.func`` and plain ``backward`` work on them as before.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from backpack import backpack, extend
from torch import nn
from torch.func import functional_call, grad, vmap

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    REORDERED_REL,
    REORDERED_REL32,
    assert_eigenpairs,
    assert_rel,
    assert_top_eigvals,
)
from tests.fixtures.problems import mlp, prepare, select
from tests.fixtures.reference import dense_ggn
from vivit import (
    BatchNormTrainingError,
    EigvalshComputation,
    LowRankGGN,
    SharedWeightError,
    UnsupportedLayerError,
    UnsupportedLossError,
)
from vivit.engines.backpack import support, unsupported_reason

N, D_IN, C = 4, 3, 3


def data(seed: int = 0, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(N, D_IN, generator=generator, dtype=dtype)
    return inputs, torch.randint(0, C, (N,), generator=generator)


class LinearTwice(nn.Module):
    """One Linear applied twice in a custom forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, D_IN)
        self.act = nn.Tanh()
        self.head = nn.Linear(D_IN, C)

    def forward(self, x):
        return self.head(self.lin(self.act(self.lin(x))))


class Tied(nn.Module):
    """Two Linear layers that share their weight."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(D_IN, D_IN)
        self.decode = nn.Linear(D_IN, C)
        self.decode.weight = self.encode.weight
        self.act = nn.Sigmoid()

    def forward(self, x):
        return self.decode(self.act(self.encode(x)))


class NormBlock(nn.Module):
    """A residual block whose inner LayerNorm is what BackPACK cannot handle."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, D_IN)
        self.norm = nn.LayerNorm(D_IN)

    def forward(self, x):
        return self.norm(x + self.lin(x))


class ReluBlock(nn.Module):
    """Residual block calling F.relu twice (BackPACK's converter crashes on it)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(D_IN, D_IN)
        self.lin2 = nn.Linear(D_IN, D_IN)

    def forward(self, x):
        return F.relu(x + self.lin2(F.relu(self.lin1(x))))


class SumBlock(nn.Module):
    """Residual block BackPACK handles after conversion."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.lin = nn.Linear(D_IN, D_IN)
        self.act = nn.ReLU(inplace=inplace)

    def forward(self, x):
        return self.act(x + 0.5 * self.lin(x))


def linear_twice_sequential():
    lin = nn.Linear(D_IN, D_IN)
    return nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(D_IN, C))


def tied_sequential():
    first, second = nn.Linear(D_IN, D_IN), nn.Linear(D_IN, D_IN)
    second.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), second, nn.Tanh(), nn.Linear(D_IN, C))


# Refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, names",
    [
        (linear_twice_sequential, ["`0.weight`, `0.bias`", "called 2 times"]),
        (LinearTwice, ["`lin.weight`, `lin.bias`", "called 2 times"]),
        (tied_sequential, ["`0.weight`", "tied", "`0` (Linear) and `2` (Linear)"]),
        (Tied, ["`encode.weight`", "tied", "`encode`", "`decode`"]),
    ],
    ids=["linear-twice-sequential", "linear-twice-forward", "tied-sequential", "tied"],
)
def test_shared_weight_is_refused(build, names):
    torch.manual_seed(0)
    model = build()
    with pytest.raises(SharedWeightError) as info:
        LowRankGGN(model, nn.CrossEntropyLoss(), data(), engine="backpack")
    message = str(info.value)
    for name in [*names, "engine='func'", "would drop"]:
        assert name in message
    assert unsupported_reason(model) == message


def test_inner_layer_of_custom_forward_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(NormBlock(), nn.Linear(D_IN, C))
    with pytest.raises(UnsupportedLayerError) as info:
        LowRankGGN(model, nn.CrossEntropyLoss(), data(), engine="backpack")
    message = str(info.value)
    # the layer, its place in the model and in the source, not the wrapper alone
    for part in ["`0.norm`", "LayerNorm", "`0` (NormBlock)", __name__.split(".")[-1]]:
        assert part in message
    assert "Supported layers: " in message and "engine='func'" in message


def test_function_in_residual_block_is_named():
    # BackPACK's converter fails on this model with "'function' object has no
    # attribute 'split'"; the engine names the function and the layer to use.
    torch.manual_seed(0)
    model = nn.Sequential(ReluBlock(), nn.Linear(D_IN, C))
    with pytest.raises(UnsupportedLayerError) as info:
        LowRankGGN(model, nn.CrossEntropyLoss(), data(), engine="backpack")
    message = str(info.value)
    for part in ["torch.nn.functional.relu", "`0` (ReluBlock)", "torch.nn.ReLU"]:
        assert part in message
    assert "engine='func'" in message


class Concat(nn.Module):
    """``[x, lin(x)]``: torch.cat is no layer, with or without conversion."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, D_IN)

    def forward(self, x):
        return torch.cat([x, self.lin(x)], dim=1)


@pytest.mark.parametrize(
    "build, name",
    [
        (lambda: nn.Sequential(SumBlock(), nn.GELU(), nn.Linear(D_IN, C)), "GELU"),
        (lambda: nn.Sequential(Concat(), nn.Linear(2 * D_IN, C)), "torch.cat"),
    ],
    ids=["GELU", "cat"],
)
def test_converted_model_is_not_told_to_convert(build, name):
    torch.manual_seed(0)
    with warnings.catch_warnings():  # BackPACK's converter warns about torch.cat
        warnings.simplefilter("ignore")
        model = extend(build(), use_converter=True)
    with pytest.raises(UnsupportedLayerError) as info:
        LowRankGGN(model, extend(nn.CrossEntropyLoss()), data(), engine="backpack")
    message = str(info.value)
    assert name in message and "engine='func'" in message
    assert "convert" not in message


def test_converter_failure_is_refused_clearly():
    # a frozen layer called twice: no shared trainable weight, but BackPACK's
    # converter refuses to copy a layer with parameters
    torch.manual_seed(0)
    frozen = nn.Linear(D_IN, D_IN).requires_grad_(False)
    model = nn.Sequential(frozen, nn.Tanh(), frozen, nn.Linear(D_IN, C))
    with pytest.raises(UnsupportedLayerError, match="converter failed") as info:
        LowRankGGN(model, nn.CrossEntropyLoss(), data(), engine="backpack")
    assert "engine='func'" in str(info.value)
    assert_untouched(model)


def test_operation_left_by_converter_is_refused(monkeypatch):
    # should the analysis ever pass an operation the converter cannot convert,
    # the converter's warning becomes a refusal instead of a wrong result
    monkeypatch.setattr(support, "_convertible", lambda node: True)
    torch.manual_seed(0)
    model = nn.Sequential(Concat(), nn.Linear(2 * D_IN, C))
    with pytest.raises(UnsupportedLayerError, match="converter failed.*cat"):
        LowRankGGN(model, nn.CrossEntropyLoss(), data(), engine="backpack")


def test_untraceable_forward_is_refused():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D_IN, C)

        def forward(self, x):
            return self.lin(x) if x.sum() > 0 else self.lin(-x)

    reason = unsupported_reason(DataDependent())
    assert "cannot be traced" in reason and "engine='func'" in reason


def test_unsupported_loss_is_named_without_func_hint():
    model = nn.Sequential(nn.Linear(D_IN, C), nn.LogSoftmax(dim=1))
    reason = unsupported_reason(model[:1], nn.NLLLoss())
    assert "NLLLoss" in reason and "engine='func'" not in reason


def test_hook_api_names_unsupported_loss():
    model, loss_func = extend(nn.Linear(D_IN, C)), extend(nn.NLLLoss())
    computation = EigvalshComputation()
    groups = [{"params": list(model.parameters())}]
    inputs, targets = data()
    with (
        pytest.raises(UnsupportedLossError, match="NLLLoss is not supported") as info,
        backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ),
    ):
        loss_func(model(inputs).log_softmax(1), targets).backward()
    assert "engine='func'" not in str(info.value)


def test_supported_models_have_no_reason():
    for problem in select(loss="ce", reduction="mean"):
        model, loss_func, _, _ = problem.build()
        assert unsupported_reason(model, loss_func) is None, problem.name
        model, loss_func, _, _ = prepare(problem)  # extended (and converted)
        assert unsupported_reason(model, loss_func) is None, problem.name


# Shared weights reached at run time (extended by the user: hook API, closures) ------
@pytest.mark.parametrize(
    "build", [linear_twice_sequential, tied_sequential], ids=["twice", "tied"]
)
def test_hook_api_refuses_shared_weight(build):
    torch.manual_seed(0)
    model, loss_func = extend(build()), extend(nn.CrossEntropyLoss())
    computation = EigvalshComputation()
    groups = [{"params": list(model.parameters())}]
    inputs, targets = data()
    with (
        pytest.raises(SharedWeightError, match="engine='func'"),
        backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ),
    ):
        loss_func(model(inputs), targets).backward()


def test_hook_api_names_function_inside_custom_forward():
    torch.manual_seed(0)
    model = extend(nn.Sequential(ReluBlock(), nn.Linear(D_IN, C)))
    loss_func = extend(nn.CrossEntropyLoss())
    computation = EigvalshComputation()
    groups = [{"params": list(model.parameters())}]
    inputs, targets = data()
    with (
        pytest.raises(UnsupportedLayerError, match="Inside layer ReluBlock") as info,
        backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ),
    ):
        loss_func(model(inputs), targets).backward()
    assert "torch.nn.functional.relu" in str(info.value)


def test_hook_api_custom_forward_suggests_converter():
    torch.manual_seed(0)
    model = extend(nn.Sequential(SumBlock(), nn.Linear(D_IN, C)))
    loss_func = extend(nn.CrossEntropyLoss())
    computation = EigvalshComputation()
    groups = [{"params": list(model.parameters())}]
    inputs, targets = data()
    with (
        pytest.raises(UnsupportedLayerError, match="use_converter=True"),
        backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ),
    ):
        loss_func(model(inputs), targets).backward()


# Models the engine converts itself, against the dense reference --------------------
class ResidualRoot(nn.Module):
    """A custom forward at the top level of the model."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(D_IN, D_IN)
        self.head = nn.Linear(D_IN, C)

    def forward(self, x):
        return self.head(x + self.inner(x))


def reused_activation():
    act = nn.Tanh()
    return nn.Sequential(nn.Linear(D_IN, 4), act, nn.Linear(4, 4), act, nn.Linear(4, C))


@pytest.mark.parametrize(
    "build",
    [
        lambda: nn.Sequential(SumBlock(), nn.Linear(D_IN, C)),
        ResidualRoot,
        reused_activation,
    ],
    ids=["residual", "residual-root", "reused-activation"],
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_converted_internally_is_exact(build, reduction):
    torch.manual_seed(0)
    model = build().double()
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    inputs, targets = data(dtype=torch.float64)
    G = dense_ggn(model, loss_func, inputs, targets)
    ggn = LowRankGGN(model, loss_func, (inputs, targets), engine="backpack")
    evals, evecs = ggn.eigh()
    assert_top_eigvals(evals, torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64])
    assert_eigenpairs(evals, evecs, G, ggn.eigvalsh().numel())
    assert [e.shape[1:] for e in evecs] == [p.shape for p in model.parameters()]


def test_registry_residual_without_extend_matches_converted():
    (problem,) = select(architecture="residual", loss="ce", reduction="mean")
    model, loss_func, inputs, targets = problem.build()
    G = dense_ggn(model, loss_func, inputs, targets)
    ggn = LowRankGGN(model, loss_func, (inputs, targets), engine="backpack")
    assert_top_eigvals(
        ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
    )


# The caller's modules afterwards --------------------------------------------------
def assert_untouched(*modules: nn.Module) -> None:
    """No hooks, stored inputs/outputs, extension flags or factors are left."""
    for module in modules:
        for layer in module.modules():
            assert not layer._forward_hooks and not layer._backward_hooks, layer
            assert layer._is_full_backward_hook is None, layer
            assert not hasattr(layer, "_backpack_extend"), layer
            assert not hasattr(layer, "input0") and not hasattr(layer, "output"), layer
        for param in module.parameters():
            assert not hasattr(param, "vivit_contribution")


def assert_usable(model: nn.Module, loss_func: nn.Module) -> None:
    """torch.func transforms and a plain backward work, without any warning."""
    inputs, targets = data(seed=1, dtype=next(model.parameters()).dtype)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(params, x, y):
        output = functional_call(model, params, (x.unsqueeze(0),))
        return loss_func(output, y.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, inputs, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.zero_grad()
        loss_func(model(inputs), targets).backward()
    # the same gradient summed in another order, in the model's type
    rel = REORDERED_REL if inputs.dtype == torch.float64 else REORDERED_REL32
    for name, param in model.named_parameters():
        assert_rel(param.grad, per_sample[name].mean(0), rel)
    # torch forgets the full backward hooks, so old-style hooks are accepted again
    model.register_backward_hook(lambda *args: None).remove()


@pytest.mark.parametrize(
    "build",
    [
        lambda: mlp(D_IN, 4, C, activation=nn.ReLU),
        # the converter switches ReLU to inplace=False; it must be switched back
        lambda: nn.Sequential(SumBlock(inplace=True), nn.Linear(D_IN, C)),
    ],
    ids=["sequential", "residual"],
)
def test_model_and_loss_untouched(build):
    torch.manual_seed(0)
    model, loss_func = build(), nn.CrossEntropyLoss()
    inplace = [m.inplace for m in model.modules() if hasattr(m, "inplace")]
    ggn = LowRankGGN(model, loss_func, data(), engine="backpack")
    ggn.newton_step(top_k=2)
    assert_untouched(model, loss_func)
    assert [m.inplace for m in model.modules() if hasattr(m, "inplace")] == inplace
    assert_usable(model, loss_func)


def test_untouched_after_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 4), nn.BatchNorm1d(4), nn.Linear(4, C))
    loss_func = nn.CrossEntropyLoss()
    with pytest.raises(BatchNormTrainingError):
        LowRankGGN(model, loss_func, data(), engine="backpack")
    assert_untouched(model, loss_func)
    model.eval()
    assert_usable(model, loss_func)


def test_user_extended_model_stays_extended():
    torch.manual_seed(0)
    model = extend(mlp(D_IN, 4, C, activation=nn.ReLU))
    loss_func = extend(nn.CrossEntropyLoss())
    modules = [*model.modules(), loss_func]
    hooks = [(len(m._forward_hooks), len(m._backward_hooks)) for m in modules]
    LowRankGGN(model, loss_func, data(), engine="backpack")
    assert [(len(m._forward_hooks), len(m._backward_hooks)) for m in modules] == hooks
    assert all(getattr(m, "_backpack_extend", False) for m in (model[0], loss_func))
    assert not any(hasattr(m, "input0") for m in modules)  # no input kept alive
    # the hook API keeps working on it
    computation = EigvalshComputation()
    groups = [{"params": list(model.parameters())}]
    inputs, targets = data()
    with backpack(
        computation.get_extension(),
        extension_hook=computation.get_extension_hook(groups),
    ):
        loss_func(model(inputs), targets).backward()
    assert computation.get_result(groups[0]).numel() == N * C
