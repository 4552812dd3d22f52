"""Recurrent layers evaluated step by step by the func engine's capture.

The step-by-step evaluation (:mod:`vivit.engines.func.recurrent`) must be the
fused kernel's function: its outputs and last states agree with the module's to
reordered sums (``REORDERED_REL``, ``docs/math.rst``, "Tolerances of the
tests"; the gates' four terms are added in another order), and every weight
goes through the ``F.linear`` calls the factor forms are read from
(``docs/math.rst``, "Recurrent layers"). The curvature of recurrent models
against the dense float64 reference, which differentiates the fused kernel, is
checked in ``test_func_engine.py`` (``test_func_problem``) and against explicit
columns with Monte Carlo, subsampling and chunks in ``test_func_forms.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from tests.fixtures.checks import EIGVAL_RTOL, REORDERED_REL, assert_rel
from vivit import LowRankGGN, SampleCouplingError
from vivit.engines.func import functional
from vivit.engines.func.functional import FunctionCapture
from vivit.gram import DenseFactors, OuterProductFactors

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning")

#: Built in the test after seeding, so that the weights do not depend on the
#: random numbers other tests drew before (a ReLU cell can output all zeros).
LAYERS = {
    "lstm-2-layers-bidirectional": lambda: nn.LSTM(
        3, 4, num_layers=2, bidirectional=True
    ),
    "lstm-batch-first-projection-no-bias": lambda: nn.LSTM(
        3, 4, batch_first=True, proj_size=2, bias=False
    ),
    "lstm-2-layers-bidirectional-projection-batch-first": lambda: nn.LSTM(
        3, 4, num_layers=2, bidirectional=True, proj_size=2, batch_first=True
    ),
    "gru-2-layers-bidirectional-batch-first": lambda: nn.GRU(
        3, 4, num_layers=2, bidirectional=True, batch_first=True
    ),
    "rnn-relu-2-layers": lambda: nn.RNN(3, 4, num_layers=2, nonlinearity="relu"),
    "rnn-tanh-bidirectional-no-bias": lambda: nn.RNN(
        3, 4, bidirectional=True, bias=False
    ),
    "lstm-cell": lambda: nn.LSTMCell(3, 4),
    "gru-cell": lambda: nn.GRUCell(3, 4),
    "rnn-relu-cell-no-bias": lambda: nn.RNNCell(3, 4, nonlinearity="relu", bias=False),
}


def _uses(layer: nn.Module, steps: int) -> int:
    """``F.linear`` calls of the step-by-step evaluation with a weight of ``layer``.

    Per layer and direction: the input map of all steps at once, the recurrent
    map at every step, an LSTM's projection at every step.
    """
    if isinstance(layer, nn.RNNCellBase):
        return 2
    directions = 2 if layer.bidirectional else 1
    per_step = 2 if getattr(layer, "proj_size", 0) else 1
    return layer.num_layers * directions * (1 + per_step * steps)


def _flat(result) -> torch.Tensor:
    parts = result if isinstance(result, tuple) else (result,)
    flat = [p for part in parts for p in (part if isinstance(part, tuple) else (part,))]
    return torch.cat([p.flatten() for p in flat])


def _initial_state(layer: nn.Module, batched: bool, batch: int):
    """A random initial state of ``layer``'s shape (``h``, or ``(h, c)``)."""
    cell = isinstance(layer, nn.RNNCellBase)
    leading = () if cell else (layer.num_layers * (2 if layer.bidirectional else 1),)
    leading += (batch,) if batched else ()
    features = getattr(layer, "proj_size", 0) or layer.hidden_size
    h = torch.randn(*leading, features, dtype=torch.float64, requires_grad=True)
    if not isinstance(layer, (nn.LSTM, nn.LSTMCell)):
        return h
    c = torch.randn(*leading, layer.hidden_size, dtype=torch.float64)
    return h, c.requires_grad_()


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("given", [False, True], ids=["zero-state", "state-given"])
def test_stepwise_is_the_fused_kernel(name, batched, given):
    """Outputs and last states equal the fused kernel's, and so do the gradients
    of every weight, the input and a given initial state (a weight used in
    another's place, or states of layers and directions taken in another order,
    can leave outputs of one draw close but not every gradient); every weight is
    recorded."""
    torch.manual_seed(0)
    layer = LAYERS[name]().double()
    cell = isinstance(layer, nn.RNNCellBase)
    steps, batch = 5, 2
    if cell:
        shape = (batch, 3) if batched else (3,)
    elif batched:
        shape = (batch, steps, 3) if layer.batch_first else (steps, batch, 3)
    else:
        shape = (steps, 3)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    state = _initial_state(layer, batched, batch) if given else None
    inputs = (x,) if state is None else (x, state)
    states = () if state is None else state if isinstance(state, tuple) else (state,)
    leaves = [x, *states, *layer.parameters()]
    expected = _flat(layer(*inputs))
    cotangent = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, leaves, cotangent)
    capture = FunctionCapture(list(layer.parameters()))
    with capture:
        actual = layer(*inputs)
    assert_rel(_flat(actual), expected, REORDERED_REL)
    grads = torch.autograd.grad(_flat(actual), leaves, cotangent)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        if expected_grad.any():
            assert_rel(grad, expected_grad, REORDERED_REL)
        else:  # W_hh of a cell from a zero state: its input is exactly zero
            assert not grad.any()
    assert len(capture.uses) == _uses(layer, steps)
    recorded = {id(p) for use in capture.uses for p in use.params()}
    assert recorded == {id(p) for p in layer.parameters()}


def test_unrequested_layers_run_fused(monkeypatch):
    """A recurrent layer none of whose weights is requested is not unrolled."""
    evaluated = []
    monkeypatch.setattr(functional, "stepwise", lambda *args: evaluated.append(args))
    layer = nn.LSTM(3, 4).double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    with FunctionCapture([nn.Parameter(torch.zeros(1))]):
        layer(x)
    assert not evaluated
    with FunctionCapture([layer.weight_hh_l0]):
        layer(x)
    assert len(evaluated) == 1


def test_dropout_between_layers_refused_in_training():
    """Dropout between layers is random in training mode: refused, eval() works."""
    torch.manual_seed(0)
    layer = nn.GRU(3, 4, num_layers=2, dropout=0.5, batch_first=True)
    model = nn.Sequential(layer).double()
    X = torch.randn(2, 5, 3, dtype=torch.float64)

    class Head(nn.Module):
        def forward(self, pair):
            return pair[0][:, -1]

    model.append(Head())
    y = torch.tensor([0, 3])
    with pytest.raises(SampleCouplingError, match=r"dropout=0.5 between its layers"):
        LowRankGGN(model, nn.CrossEntropyLoss(), (X, y), engine="func")
    model.eval()
    ggn = LowRankGGN(model, nn.CrossEntropyLoss(), (X, y), engine="func")
    assert isinstance(ggn._group(0).ggn_factors[0], OuterProductFactors)


class _Packed(nn.Module):
    """A recurrent layer on sequences of different lengths, packed; the last
    valid output.

    The input's last channel marks the valid steps ``[N, T, 3 + 1]``.
    """

    def __init__(self, kind: type[nn.RNNBase]):
        super().__init__()
        self.layer = kind(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        lengths = x[:, :, -1].sum(1).long()
        packed = pack_padded_sequence(
            x[:, :, :-1], lengths, batch_first=True, enforce_sorted=False
        )
        h, _ = pad_packed_sequence(self.layer(packed)[0], batch_first=True)
        return self.head(h[torch.arange(len(x)), lengths - 1])


def _looped_dense_ggn(model, loss_func, X, y) -> torch.Tensor:
    """``Jᵀ H J`` in float64 with a loop of backward passes (no vmap: packing
    cannot run under it), as ``tests/fixtures/reference.py`` forms it otherwise."""
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]

    def output_of(*values):
        state = dict(zip(names, values, strict=True))
        return torch.func.functional_call(model, state, (X,))

    output = output_of(*params)
    J = torch.autograd.functional.jacobian(output_of, tuple(params))
    J = torch.cat([j.reshape(output.numel(), -1) for j in J], dim=1)
    H = torch.func.hessian(lambda f: loss_func(f, y))(output.detach())
    return J.T @ H.reshape(output.numel(), output.numel()) @ J


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_packed_sequences_keep_explicit_columns(kind):
    """Packed sequences run the fused kernel: explicit columns, still exact."""
    torch.manual_seed(0)
    model = _Packed(kind).double()
    valid = torch.arange(4) < torch.tensor([[4], [2], [3]])
    X = torch.cat([torch.randn(3, 4, 3), valid[..., None]], dim=2).double()
    y = torch.tensor([0, 1, 1])
    ggn = LowRankGGN(model, nn.CrossEntropyLoss(), (X, y), engine="func")
    params = list(model.parameters())
    recurrent = {id(p) for p in model.layer.parameters()}
    group = ggn._group(0)
    for param, factors in zip(params, group.ggn_factors, strict=True):
        if id(param) in recurrent:
            assert isinstance(factors, DenseFactors)
    G = _looped_dense_ggn(model, nn.CrossEntropyLoss(), X, y)
    expected = torch.linalg.eigvalsh(G)[-len(ggn.eigvalsh()) :]
    rtol = EIGVAL_RTOL[torch.float64]
    assert_rel(ggn.eigvalsh(), expected, rtol)
