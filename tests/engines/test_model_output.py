"""Models returning structured outputs: the ``output`` option (issue 19).

A tuple, dict, named tuple or ``ModelOutput``-like mapping is refused without
``output=``, naming its type and fields; with it, the GGN is that of
``loss_func(selected, targets)``, equal to the dense float64 reference of the same
selection (``EIGVAL_RTOL``, ``docs/math.rst``, "Precision and the numerical
zero"). A selection by name or position keeps BackPACK under ``engine="auto"``; a
function may compute and goes to func, and BackPACK refuses one that does.
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from tests.fixtures.checks import EIGVAL_RTOL, assert_top_eigvals
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn
from vivit import (
    InvalidArgumentError,
    LowRankGGN,
    StreamingGGN,
    UnsupportedLayerError,
)
from vivit.optim import DampedNewton

N, D, C = 5, 4, 3
RTOL = EIGVAL_RTOL[torch.float64]
Pair = namedtuple("Pair", ["logits", "features"])


class ModelOutput(OrderedDict):
    """Like ``transformers.ModelOutput``: a mapping with attribute access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(name) from error


class Structured(nn.Module):
    """A small MLP returning its logits inside a structured output."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.net = mlp(D, 4, C)

    def forward(self, x):
        logits = self.net(x)
        if self.kind == "tuple":
            return logits, x
        if self.kind == "dict":
            return {"logits": logits, "features": x}
        if self.kind == "namedtuple":
            return Pair(logits, x)
        return ModelOutput(logits=logits, features=x)


def _problem(kind: str, reduction: str = "mean"):
    torch.manual_seed(0)
    model = Structured(kind).double()
    X = torch.randn(N, D, dtype=torch.float64)
    y = torch.randint(0, C, (N,))
    return model, nn.CrossEntropyLoss(reduction=reduction), X, y


@pytest.mark.parametrize(
    "kind, named",
    [
        ("tuple", "a tuple of 2 entries"),
        ("dict", "a dict with fields ['logits', 'features']"),
        ("namedtuple", "a Pair with fields ['logits', 'features']"),
        ("model-output", "a ModelOutput with fields ['logits', 'features']"),
    ],
)
@pytest.mark.parametrize("engine", ["auto", "func"])
def test_structured_output_without_selector_is_refused_by_name(kind, named, engine):
    model, loss_func, X, y = _problem(kind)
    with pytest.raises(InvalidArgumentError) as error:
        LowRankGGN(model, loss_func, (X, y), engine=engine)
    message = str(error.value)
    if engine == "auto" and kind == "model-output":
        # BackPACK runs the model converted by torch.fx, which returns a dict
        named = named.replace("ModelOutput", "dict")
    assert named in message
    assert ("output=0" if kind == "tuple" else "output='logits'") in message


def test_backpack_refuses_building_a_named_tuple():
    """Its converter cannot follow the constructor call; auto picks func."""
    model, loss_func, X, y = _problem("namedtuple")
    with pytest.raises(UnsupportedLayerError, match="function `.*Pair`"):
        LowRankGGN(model, loss_func, (X, y), engine="backpack", output="logits")
    ggn = LowRankGGN(model, loss_func, (X, y), output="logits")
    assert ggn.engine == "func"


#: kind -> (selection by name or position, the same selection by a function)
SELECTORS = {
    "tuple": (0, lambda out: out[0]),
    "dict": ("logits", lambda out: out["logits"]),
    "namedtuple": ("logits", lambda out: out.logits),
    "model-output": ("logits", lambda out: out["logits"]),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("by", ["name", "function"])
@pytest.mark.parametrize(
    "engine, kind",
    # BackPACK refuses to build a named tuple (test above)
    [
        (engine, kind)
        for engine in ("auto", "backpack", "func")
        for kind in SELECTORS
        if (engine, kind) != ("backpack", "namedtuple")
    ],
)
def test_selected_output_gives_the_reference_ggn(kind, by, engine, reduction):
    model, loss_func, X, y = _problem(kind, reduction)
    name, function = SELECTORS[kind]
    output = name if by == "name" else function
    ggn = LowRankGGN(model, loss_func, (X, y), engine=engine, output=output)
    if engine == "auto":  # a function may compute: func; a name: BackPACK
        backpack = by == "name" and kind != "namedtuple"
        assert ggn.engine == ("backpack" if backpack else "func")
    reference = dense_ggn(model, loss_func, X, y, output=function)
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(reference), RTOL)


def test_computing_selector_is_exact_in_func_and_refused_by_backpack():
    model, loss_func, X, y = _problem("tuple")

    def output(out):
        return 2 * out[0]

    ggn = LowRankGGN(model, loss_func, (X, y), output=output)
    assert ggn.engine == "func"
    reference = dense_ggn(model, loss_func, X, y, output=output)
    assert_top_eigvals(ggn.eigvalsh(), torch.linalg.eigvalsh(reference), RTOL)
    with pytest.raises(UnsupportedLayerError, match="engine='func'"):
        LowRankGGN(model, loss_func, (X, y), engine="backpack", output=output)


@pytest.mark.parametrize(
    "output, match",
    [
        ("logit", "output='logit' names no field"),
        (2, "output=2 names no field"),
        ("features", None),
    ],
)
def test_bad_selection_is_named(output, match):
    model, loss_func, X, y = _problem("dict" if isinstance(output, str) else "tuple")
    if match is None:  # selects the inputs: refused by the loss, not silently
        output = lambda out: None  # noqa: E731
        match = "output=<function> selected a NoneType"
    with pytest.raises(InvalidArgumentError, match=match):
        LowRankGGN(model, loss_func, (X, y), output=output)


@pytest.mark.parametrize("output", ["", 1.5, True, ["logits"]])
def test_malformed_output_option_is_refused(output):
    model, loss_func, X, y = _problem("dict")
    with pytest.raises(InvalidArgumentError, match="output must be None"):
        LowRankGGN(model, loss_func, (X, y), output=output)


def test_streaming_and_damped_newton_take_the_selector():
    model, loss_func, X, y = _problem("model-output")
    expected = LowRankGGN(model, loss_func, (X, y), output="logits").eigvalsh()
    stream = StreamingGGN(model, loss_func, [(X, y)], output="logits")
    evals, _ = stream.eigh(top_k=2)
    # each within its solver's tol·λ_max, the dense one within EIGVAL_RTOL·λ_max
    tol = stream.solver_report().tolerance or 0.0
    assert_top_eigvals(evals, expected, tol + EIGVAL_RTOL[torch.float64])
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DampedNewton(
        model.parameters(), model=model, loss_func=loss_func, output="logits"
    )
    optimizer.step(data=(X, y))
    assert any(
        not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
    )
