"""The GGN is that of the function autograd differentiates (issue 19).

Forward hooks that change a layer's output, ``torch.no_grad()`` and ``.detach()``
inside ``forward``, and parametrizations (pruning, ``torch.nn.utils.parametrize``,
weight normalization) make the function autograd differentiates differ from the
chain of layers. The func engine computes their GGN exactly; the BackPACK engine
refuses them by name, and ``engine="auto"`` picks func. Each case is compared
with the dense float64 reference of the same function
(``tests/fixtures/reference.py``, which keeps user hooks), for both reductions;
eigenvalues within ``EIGVAL_RTOL`` (``docs/math.rst``, "Precision and the
numerical zero": float64 error ``≈ N C ε λ_max``).

Also: how often one construction calls the model (``docs/math.rst`` is not
involved; the func engine's module docstring says why it needs two calls).
"""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from torch import nn
from torch.nn.utils import parametrize, prune

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    REORDERED_REL,
    assert_rel,
    assert_top_eigvals,
)
from tests.fixtures.problems import mlp
from tests.fixtures.reference import dense_ggn, dense_gradient, flatten_params
from vivit import LowRankGGN, UnsupportedLayerError
from vivit.engines.func.vjp import ExplicitColumns

N, D, H, C = 6, 5, 4, 3
RTOL = EIGVAL_RTOL[torch.float64]


def _mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return mlp(D, H, C).double()


def _data(reduction: str):
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, dtype=torch.float64, generator=gen)
    y = torch.randint(0, C, (N,), generator=gen)
    return nn.CrossEntropyLoss(reduction=reduction), X, y


class NoGradBlock(nn.Module):
    """A block whose first layer runs without gradients."""

    def __init__(self, detach: bool = False):
        super().__init__()
        self.detach = detach
        self.a, self.act, self.b = nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C)

    def forward(self, x):
        if self.detach:
            return self.b(self.act(self.a(x).detach()))
        with torch.no_grad():
            hidden = self.a(x)
        return self.b(self.act(hidden))


def _hook_double() -> nn.Module:
    model = _mlp()
    model[0].register_forward_hook(lambda module, args, out: 2 * out)
    return model


def _hook_tanh() -> nn.Module:
    model = _mlp()
    model[0].register_forward_hook(lambda module, args, out: torch.tanh(out))
    return model


def _pre_hook_scale() -> nn.Module:
    model = _mlp()
    model[2].register_forward_pre_hook(lambda module, args: (0.5 * args[0],))
    return model


def _no_grad() -> nn.Module:
    torch.manual_seed(1)
    return NoGradBlock().double()


def _detach() -> nn.Module:
    torch.manual_seed(1)
    return NoGradBlock(detach=True).double()


def _pruned() -> nn.Module:
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.4)
    return model


class Half(nn.Module):
    def forward(self, weight):
        return 0.5 * (weight + weight.flip(-1))


def _parametrized() -> nn.Module:
    model = _mlp()
    parametrize.register_parametrization(model[0], "weight", Half())
    return model


def _weight_norm() -> nn.Module:
    model = _mlp()
    model[2] = nn.utils.parametrizations.weight_norm(model[2])
    return model


def _old_weight_norm() -> nn.Module:
    model = _mlp()
    with pytest.warns(FutureWarning):
        model[2] = nn.utils.weight_norm(model[2])
    return model


#: case -> (model factory, what the BackPACK refusal names)
CASES = {
    "hook-double": (_hook_double, "`0` (Linear) has the forward hook"),
    "hook-tanh": (_hook_tanh, "`0` (Linear) has the forward hook"),
    "pre-hook-scale": (_pre_hook_scale, "`2` (Linear) has the forward pre-hook"),
    "no_grad": (_no_grad, "layer `a`, called in the model's forward at"),
    "detach": (_detach, "`.detach()`"),
    "pruned": (_pruned, "`0` (Linear) is pruned"),
    "parametrized": (_parametrized, "`0` (ParametrizedLinear) is parametrized"),
    "weight-norm": (_weight_norm, "`2` (ParametrizedLinear) is parametrized"),
    "old-weight-norm": (_old_weight_norm, "`2` (Linear) is weight-normalized"),
}


# torch.func has no batching rule for weight norm's backward: slower, still exact
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("engine", ["func", "auto"])
def test_ggn_and_gradient_of_the_differentiated_function(case, engine, reduction):
    """Eigenvalues and gradient equal the dense reference of the same function."""
    model = CASES[case][0]()
    loss_func, X, y = _data(reduction)
    ggn = LowRankGGN(model, loss_func, (X, y), engine=engine)
    assert ggn.engine == "func"
    reference = torch.linalg.eigvalsh(dense_ggn(model, loss_func, X, y))
    assert_top_eigvals(ggn.eigvalsh(), reference, RTOL)
    gradient = flatten_params(ggn.gradient())
    expected = dense_gradient(model, loss_func, X, y)
    assert_rel(gradient, expected, REORDERED_REL)  # the dense reference's sums


@pytest.mark.parametrize("case", CASES)
def test_backpack_refuses_by_name_and_points_to_func(case):
    """The BackPACK engine names the module and says engine='func' is exact."""
    factory, named = CASES[case]
    loss_func, X, y = _data("mean")
    with pytest.raises(UnsupportedLayerError) as error:
        LowRankGGN(factory(), loss_func, (X, y), engine="backpack")
    assert named in str(error.value)
    assert "engine='func'" in str(error.value)


def test_no_grad_block_gets_no_gradient_and_no_curvature():
    """A parameter before a no_grad block: zero gradient and zero GGN block."""
    loss_func, X, y = _data("mean")
    model = _no_grad()
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=[[model.a.weight]])
    assert ggn.engine == "func"
    assert not ggn.gradient()[0].any()
    assert not ggn.gram().any()


def test_pruned_gradient_is_masked():
    """The GGN is w.r.t. ``weight_orig``: pruned entries get no curvature."""
    loss_func, X, y = _data("mean")
    model = _pruned()
    layer = model[0]
    ggn = LowRankGGN(model, loss_func, (X, y), param_groups=[[layer.weight_orig]])
    _, evecs = ggn.eigh(top_k=3)
    pruned = layer.weight_mask == 0
    assert pruned.any()
    assert not evecs[0][:, pruned].any()


# ----------------------------------------------------------------------------------
# Forward passes per construction
# ----------------------------------------------------------------------------------


def _counting(model: nn.Module) -> list[int]:
    """Count passes of samples through the model's first Linear (no hook: it would
    change the engine). The request's measurement on a copy of the model, made
    once per request shape (vivit.memory.profile), is made before counting."""
    layer = next(m for m in model.modules() if isinstance(m, nn.Linear))
    calls = [0]
    forward = layer.forward

    def counted(*args):
        calls[0] += len(args[0]) > 1
        return forward(*args)

    layer.forward = counted
    return calls


@pytest.mark.parametrize(
    "engine, chosen, forwards",
    [("backpack", "backpack", 1), ("auto", "backpack", 1), ("func", "func", 2)],
)
def test_forward_calls_per_construction(engine, chosen, forwards):
    """BackPACK: one forward; func: one, plus the sample-independence check."""
    model = _mlp()
    loss_func, X, y = _data("mean")
    LowRankGGN(model, loss_func, (X, y), engine=engine)  # measured once
    calls = _counting(model)
    ggn = LowRankGGN(model, loss_func, (X, y), engine=engine)
    assert (ggn.engine, calls[0]) == (chosen, forwards)


@pytest.mark.parametrize(
    "factory, vectorized, forwards",
    # parameters without a factor form run in chunks of DENSE_CHUNK = 4 samples,
    # each with its own forward pass (vivit.engines.func.engine, "Forward passes");
    # their columns vectorized over the samples add a forward under vmap of one
    # sample at a time, no pass over the batch
    [
        (_hook_double, None, 2),
        (_parametrized, False, 2 + 2),
        (_parametrized, True, 2 + 2),
    ],
    ids=["factor-forms", "dense-chunks", "dense-chunks-vectorized"],
)
def test_forward_calls_of_auto_choosing_func(
    factory, vectorized, forwards, monkeypatch
):
    """Auto's choice runs no forward; func's run as its cost model says."""
    monkeypatch.setattr(  # the route the first chunk's timing would choose
        ExplicitColumns,
        "__init__",
        lambda self: setattr(self, "vectorized", vectorized),
    )
    model = factory()
    loss_func, X, y = _data("mean")
    LowRankGGN(model, loss_func, (X, y))  # measured once
    calls = _counting(model)
    assert LowRankGGN(model, loss_func, (X, y)).engine == "func"
    assert calls[0] == forwards


#: The cases a layer shows by itself (hooks, parametrizations): a loss computed
#: elsewhere is checked layer by layer as the backward pass reaches them.
LAYER_CASES = [case for case in CASES if case not in ("no_grad", "detach")]


@pytest.mark.parametrize("case", LAYER_CASES)
def test_from_loss_refuses_what_the_model_path_refuses(case):
    """A closure's loss through a hooked or parametrized layer: no silent GGN."""
    model = extend(CASES[case][0]())
    loss_func = extend(nn.CrossEntropyLoss())
    _, X, y = _data("mean")
    with pytest.raises(UnsupportedLayerError, match="BackPACK engine cannot handle"):
        LowRankGGN.from_loss(lambda: loss_func(model(X), y), [list(model.parameters())])
