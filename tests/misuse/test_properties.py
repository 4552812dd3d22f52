"""Property-based misuse: malformed calls give the dense result or a library error.

Hypothesis draws a call to ``LowRankGGN`` (constructor or ``from_loss`` with a
closure) from combinations of: dtype (float16, bfloat16, float32, float64), batch
size (including 0), loss (supported options, soft and negative targets, ignored
targets, a loss function, an unsupported module or reduction), non-finite values
in inputs, targets or parameters, every shape of ``param_groups`` misuse,
subsampling, ``mc_samples``, generators and grad contexts (none, ``no_grad``,
``inference_mode``), and models whose forward is not the chain of its layers or
whose data change after the construction (a forward hook that doubles a layer's
output, a pruned layer, a ``no_grad`` block inside ``forward``, a tuple output
selected with ``output=0``, inputs and parameters changed in place after the
construction: :data:`VARIANTS`). The property: the call either raises a
:class:`vivit.VivitError` (never another exception), or it returns eigenvalues
that are finite and, for the exact GGN, equal the dense float64 reference of the
same numbers (tolerances of ``tests/fixtures/checks.py``); a call that carries a
fault never returns. A second property calls the methods of a valid ``LowRankGGN`` with
malformed ``top_k``, ``group``, ``damping`` and ``subsampling_grad``: a finite
result for valid arguments, a library error otherwise.

Derandomized, no example database: the run is reproducible.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from backpack import extend
from hypothesis import event, given
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune

from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.hypothesis_settings import reproducible
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn
from vivit import LowRankGGN, VivitError

SETTINGS = reproducible(150)

C = 3
#: Faults a call may carry (0 to 2 of them); each overrides one valid choice.
FAULTS = [
    "float16",
    "bfloat16",
    "empty-batch",
    "ce-soft-negative",
    "function",
    "nll",
    "reduction-none",
    "nan-input",
    "inf-input",
    "nan-target",
    "nan-param",
    "inf-param",
    "groups-empty",
    "groups-flat",
    "groups-dicts",
    "groups-ints",
    "groups-duplicate",
    "groups-foreign",
    "sub-outside",
    "sub-repeated",
    "sub-empty",
    "mc-negative",
    "mc-float",
    "mc-bool",
    "generator-int",
    "inference_mode",
]


@dataclass
class Call:
    """A drawn call (printed by hypothesis when the property fails)."""

    dtype: torch.dtype
    batch_size: int
    loss: str
    reduction: str
    corruption: str | None
    groups: str | None
    subsampling: str | None
    mc_samples: object
    generator: str | None
    context: str | None
    via_closure: bool
    seed: int
    variant: str | None = None
    faults: tuple[str, ...] = ()


def _apply(call: Call, faults: list[str]) -> Call:
    """Override the valid choices of ``call`` by the faults."""
    call.faults = tuple(faults)
    for fault in faults:
        if fault in ("float16", "bfloat16"):
            call.dtype = getattr(torch, fault)
        elif fault == "empty-batch":
            call.batch_size = 0
        elif fault in ("ce-soft-negative", "function", "nll", "reduction-none"):
            call.loss = fault
        elif fault.endswith(("-input", "-target", "-param")):
            call.corruption = fault
        elif fault.startswith("groups-"):
            call.groups = fault.removeprefix("groups-")
        elif fault.startswith("sub-"):
            call.subsampling = fault.removeprefix("sub-")
        elif fault.startswith("mc-"):
            call.mc_samples = {"mc-negative": -1, "mc-float": 1.5, "mc-bool": True}[
                fault
            ]
        elif fault == "generator-int":
            call.generator = "int"
        else:
            call.context = fault
    return call


#: Valid models the library must handle exactly (or refuse by name): the
#: differentiated function is not the chain of layers, or the data change later.
VARIANTS = ["hook-double", "pruned", "no_grad-block", "tuple-output", "mutated-after"]

calls = st.builds(
    _apply,
    st.builds(
        Call,
        dtype=st.sampled_from([torch.float32, torch.float64]),
        batch_size=st.integers(1, 4),
        loss=st.sampled_from(["ce", "ce-ignore", "ce-weight-smooth", "ce-soft", "mse"])
        | st.just("bce"),
        reduction=st.sampled_from(["mean", "sum"]),
        corruption=st.none(),
        groups=st.sampled_from([None, "layers", "last", "generator"]),
        subsampling=st.sampled_from([None, "valid"]),
        mc_samples=st.sampled_from([0, 0, 1, 2]),
        generator=st.sampled_from([None, "generator"]),
        context=st.sampled_from([None, "no_grad"]),
        via_closure=st.booleans(),
        seed=st.integers(0, 3),
        variant=st.sampled_from([None, None, None, *VARIANTS]),
    ),
    st.lists(st.sampled_from(FAULTS), max_size=2),
)


def _loss_and_targets(call: Call, gen: torch.Generator):
    N, reduction, dtype = call.batch_size, call.reduction, call.dtype
    labels = torch.randint(0, C, (N,), generator=gen)
    probs = torch.rand(N, C, generator=gen).to(dtype)
    if call.loss == "ce":
        return nn.CrossEntropyLoss(reduction=reduction), labels
    if call.loss == "ce-ignore":
        labels[::2] = -100
        return nn.CrossEntropyLoss(reduction=reduction), labels
    if call.loss == "ce-weight-smooth":
        weight = torch.tensor([0.5, 1.0, 2.0]).to(dtype)
        loss = nn.CrossEntropyLoss(
            weight=weight, label_smoothing=0.1, reduction=reduction
        )
        return loss, labels
    if call.loss == "ce-soft":
        return nn.CrossEntropyLoss(reduction=reduction), 2 * probs
    if call.loss == "ce-soft-negative":
        return nn.CrossEntropyLoss(reduction=reduction), probs - 0.5
    if call.loss == "mse":
        return nn.MSELoss(reduction=reduction), probs
    if call.loss == "bce":
        return nn.BCEWithLogitsLoss(reduction=reduction), probs
    if call.loss == "function":
        return torch.nn.functional.cross_entropy, labels
    if call.loss == "nll":
        return nn.NLLLoss(reduction=reduction), labels
    return nn.CrossEntropyLoss(reduction="none"), labels


def _param_groups(call: Call, model: nn.Module):
    params = list(model.parameters())
    first, last = params[:2], params[2:]
    return {
        None: None,
        "layers": [first, last],
        "last": [last],
        "empty": [],
        "flat": params,
        "dicts": [{"params": params}],
        "ints": [[0, 1]],
        "duplicate": [params, first],
        "foreign": [[nn.Parameter(torch.zeros(2))]],
        "generator": [iter(params)],
    }[call.groups]


class NoGradBlock(nn.Module):
    """The layers of ``net``, the first one run without gradients."""

    def __init__(self, net: nn.Sequential):
        super().__init__()
        self.net = net

    def forward(self, x):
        with torch.no_grad():
            hidden = self.net[0](x)
        return self.net[2](self.net[1](hidden))


class TupleOutput(nn.Module):
    """``net``'s output and its sum, as a tuple (selected with ``output=0``)."""

    def __init__(self, net: nn.Sequential):
        super().__init__()
        self.net = net

    def forward(self, x):
        out = self.net(x)
        return out, out.sum()


def _variant(call: Call, net: nn.Sequential) -> nn.Module:
    """The model of the call's variant, built around ``net``."""
    if call.variant == "hook-double":
        net[0].register_forward_hook(lambda module, args, out: 2 * out)
    elif call.variant == "pruned":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(call.seed)
            prune.random_unstructured(net[0], "weight", amount=0.5)
    elif call.variant == "no_grad-block":
        return NoGradBlock(net)
    elif call.variant == "tuple-output":
        return TupleOutput(net)
    return net


def _output(call: Call):
    return 0 if call.variant == "tuple-output" else None


def _build(call: Call):
    gen = torch.Generator().manual_seed(call.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(call.seed)
        net = mlp(2, 4, C, activation=nn.Sigmoid)
    net = net.to(call.dtype)
    inputs = torch.randn(call.batch_size, 2, generator=gen).to(call.dtype)
    loss_func, targets = _loss_and_targets(call, gen)
    if call.batch_size:
        if call.corruption == "nan-input":
            inputs[-1, 0] = float("nan")
        elif call.corruption == "inf-input":
            inputs[0, 1] = float("inf")
        elif call.corruption == "nan-target" and targets.is_floating_point():
            targets[-1, 0] = float("nan")
    if call.corruption in ("nan-param", "inf-param"):
        with torch.no_grad():
            net[2].weight[1, 1] = float("nan" if "nan" in call.corruption else "inf")
    model = _variant(call, net)
    subsampling = {
        None: None,
        "valid": list(range(call.batch_size))[::-2] or [0],
        "outside": [call.batch_size],
        "repeated": [0, 0],
        "empty": [],
    }[call.subsampling]
    generator = {
        None: None,
        "generator": torch.Generator().manual_seed(0),
        "int": 0,
    }[call.generator]
    return model, loss_func, inputs, targets, subsampling, generator


@contextlib.contextmanager
def _changed_in_place(call: Call, model: nn.Module, inputs, targets):
    """Inputs, targets and parameters changed in place (variant "mutated-after")
    while the results are computed; restored for the reference afterwards."""
    if call.variant != "mutated-after":
        yield
        return
    tensors = [inputs, *model.parameters()]
    if targets.is_floating_point():
        tensors.append(targets)
    saved = [t.detach().clone() for t in tensors]
    with torch.no_grad():
        for tensor in tensors:
            tensor.mul_(3.0).add_(1.0)
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, saved, strict=True):
                tensor.copy_(value)


def _context(call: Call):
    if call.context == "no_grad":
        return torch.no_grad()
    if call.context == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()


def _run(call: Call, model, loss_func, inputs, targets, subsampling, generator):
    groups = _param_groups(call, model)
    kwargs = {"mc_samples": call.mc_samples, "subsampling": subsampling}
    kwargs["generator"] = generator
    if not call.via_closure:
        return LowRankGGN(
            model,
            loss_func,
            (inputs, targets),
            param_groups=groups,
            output=_output(call),
            **kwargs,
        )
    if isinstance(loss_func, nn.Module):
        loss_func = extend(loss_func)
    model = extend(model)
    select = (lambda out: out[0]) if call.variant == "tuple-output" else (lambda o: o)
    return LowRankGGN.from_loss(
        lambda: loss_func(select(model(inputs)), targets),
        groups if groups is not None else [list(model.parameters())],
        **kwargs,
    )


def _reference(call, model, loss_func, inputs, targets, subsampling, ggn):
    params = ggn.param_groups[0]
    index = slice(None) if subsampling is None else torch.tensor(subsampling)
    if (
        isinstance(loss_func, nn.CrossEntropyLoss)
        and not targets.is_floating_point()
        and (targets[index] == loss_func.ignore_index).all()
    ):
        return None  # the loss on these samples is 0/0: no curvature
    select = (lambda out: out[0]) if call.variant == "tuple-output" else None
    G = dense_ggn(model, loss_func, inputs, targets, params, subsampling, select)
    return torch.linalg.eigvalsh(G)


@SETTINGS
@given(call=calls)
def test_malformed_calls_give_the_dense_result_or_a_library_error(call):
    model, loss_func, inputs, targets, subsampling, generator = _build(call)
    try:
        with _context(call):
            ggn = _run(call, model, loss_func, inputs, targets, subsampling, generator)
            with _changed_in_place(call, model, inputs, targets):
                evals = ggn.eigvalsh()
    except VivitError as error:
        event(f"raised {type(error).__name__}")
        return
    event("returned")
    # a fault is never accepted silently (NaN in integer targets is no fault)
    harmless = {"nan-target"} if not targets.is_floating_point() else set()
    assert not set(call.faults) - harmless, call
    assert torch.isfinite(evals).all(), call
    if call.mc_samples:
        return  # an unbiased estimate: finite is what can be asserted here
    reference = _reference(call, model, loss_func, inputs, targets, subsampling, ggn)
    if reference is None:
        assert (evals == 0).all(), call
        return
    assert_top_eigvals(evals, reference, EIGVAL_RTOL[call.dtype])


# ----------------------------------------------------------------------------------
# Methods of a valid LowRankGGN with malformed arguments
# ----------------------------------------------------------------------------------

TOP_KS = [None, 1, 3, 10_000, 0, -1, 2.0, "2", True]
GROUP_INDICES = [0, 0, 1, 2, -1, "0", 0.0, None]
DAMPINGS = [0.0, 1e-3, 1.0, -1.0, float("nan"), "1", None, "rule", "bad-rule"]
SUBSAMPLINGS = [None, [0, 2], [3, 1], [], [4], [0, 0], "01", [0.5]]


def _valid_top_k(top_k):
    return top_k is None or (type(top_k) is int and top_k >= 1)


def _damping(name):
    if name == "rule":
        return lambda evals, *_: torch.full_like(evals, 0.1)
    if name == "bad-rule":
        return lambda evals, *_: -torch.ones(evals.numel() + 1)
    return name


@pytest.mark.filterwarnings("ignore::vivit.FewerEigenpairsWarning")  # top_k > rank
@reproducible(60)
@given(
    top_k=st.sampled_from(TOP_KS),
    group=st.sampled_from(GROUP_INDICES),
    damping=st.sampled_from(DAMPINGS),
    subsampling_grad=st.sampled_from(SUBSAMPLINGS),
    method=st.sampled_from(["eigh", "directional_derivatives", "newton_step"]),
)
def test_methods_give_finite_results_or_a_library_error(
    top_k, group, damping, subsampling_grad, method
):
    torch.manual_seed(0)
    model = mlp(2, 4, C).double()
    inputs = torch.randn(4, 2, dtype=torch.float64)
    targets = torch.tensor([0, 2, -100, 1])
    ggn = LowRankGGN(
        model,
        nn.CrossEntropyLoss(),
        (inputs, targets),
        param_groups=[list(model[0].parameters()), list(model[2].parameters())],
    )
    kwargs = {"top_k": top_k, "group": group}
    if method != "eigh":
        kwargs["subsampling_grad"] = subsampling_grad
    if method == "newton_step":
        kwargs["damping"] = _damping(damping)
    try:
        result = getattr(ggn, method)(**kwargs)
    except VivitError as error:
        event(f"raised {type(error).__name__}")
        return
    event("returned")
    valid = (
        _valid_top_k(top_k)
        and type(group) is int
        and 0 <= group < 2
        and (method == "eigh" or subsampling_grad in (None, [0, 2], [3, 1]))
        and (method != "newton_step" or damping in (0.0, 1e-3, 1.0, "rule"))
    )
    assert valid, (method, kwargs)
    tensors = (
        [result[0], *result[1]]
        if method == "eigh"
        else result
        if method == "newton_step"
        else [result.gammas, result.lambdas, result.gamma_bar]
    )
    assert all(torch.isfinite(t).all() for t in tensors)
