"""Recurrent kernels step by step, so that their weights' linear maps are seen.

A fused LSTM, GRU or RNN call (or a cell's) is evaluated by PyTorch's per-step
equations, every weight entering through ``F.linear`` (``docs/math.rst``, "Recurrent
layers"); packed sequences and dropout between layers keep the fused kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

#: Each fused sequence kernel and the cell it runs at every step.
SEQUENCE_KERNELS = {
    torch.lstm: "lstm",
    torch.gru: "gru",
    torch.rnn_tanh: "tanh",
    torch.rnn_relu: "relu",
}
#: Each one-step kernel (``nn.LSTMCell``, ...) and its cell.
CELL_KERNELS = {
    torch.lstm_cell: "lstm",
    torch.gru_cell: "gru",
    torch.rnn_tanh_cell: "tanh",
    torch.rnn_relu_cell: "relu",
}

_SEQUENCE_ARGS = (
    *("input", "hx", "params", "has_biases", "num_layers", "dropout"),
    *("train", "bidirectional", "batch_first"),
)
_CELL_ARGS = ("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh")


def recurrent_weights(func: Callable, args: tuple, kwargs: dict) -> list[Tensor]:
    """The weights a recurrent kernel call uses (empty for any other call)."""
    if func in CELL_KERNELS:
        bound = dict(zip(_CELL_ARGS, args, strict=False)) | kwargs
        return [bound[k] for k in _CELL_ARGS[2:] if bound.get(k) is not None]
    if func in SEQUENCE_KERNELS and _unpacked(args):
        bound = dict(zip(_SEQUENCE_ARGS, args, strict=False)) | kwargs
        return list(bound["params"])
    return []


def _unpacked(args: tuple) -> bool:
    """Whether the input is padded: a packed call has its ``params`` list fourth."""
    return len(args) > 3 and not isinstance(args[3], (list, tuple))


def stepwise(func: Callable, args: tuple, kwargs: dict) -> Tensor | tuple | None:
    """What ``func(*args, **kwargs)`` returns, step by step (``None``: not here)."""
    if func in CELL_KERNELS:
        bound = dict(zip(_CELL_ARGS, args, strict=False)) | kwargs
        return _cell_call(CELL_KERNELS[func], bound)
    if not _unpacked(args):
        return None
    bound = dict(zip(_SEQUENCE_ARGS, args, strict=False)) | kwargs
    if bound["dropout"] > 0 and bound["train"] and bound["num_layers"] > 1:
        return None
    return _sequence(SEQUENCE_KERNELS[func], bound)


def _cell_call(cell: str, bound: dict) -> Tensor | tuple[Tensor, Tensor]:
    hx = bound["hx"]
    gates_in = F.linear(bound["input"], bound["w_ih"], bound.get("b_ih"))
    state = (hx[0], hx[1]) if cell == "lstm" else (hx, None)
    h, c = _step(cell, gates_in, state, bound["w_hh"], bound.get("b_hh"))
    return (h, c) if cell == "lstm" else h


def _sequence(cell: str, bound: dict) -> tuple[Tensor, ...]:
    """A sequence kernel on a padded input ``[T, N, I]`` (or ``[N, T, I]``)."""
    layers, batch_first = bound["num_layers"], bound["batch_first"]
    directions = 2 if bound["bidirectional"] else 1
    params: Sequence[Tensor] = bound["params"]
    per_direction = len(params) // (layers * directions)
    hx = bound["hx"]
    h0, c0 = (hx[0], hx[1]) if cell == "lstm" else (hx, None)
    x = bound["input"]
    last_h, last_c = [], []
    for layer in range(layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            weights = params[index * per_direction : (index + 1) * per_direction]
            state = (h0[index], None if c0 is None else c0[index])
            layout = (bool(direction), batch_first)
            weights = _Weights(weights, bound["has_biases"])
            steps, (h, c) = _direction(cell, x, state, weights, layout)
            outputs.append(steps)
            last_h.append(h)
            last_c.append(c)
        x = torch.cat(outputs, dim=-1) if directions > 1 else outputs[0]
    if cell == "lstm":
        return x, torch.stack(last_h), torch.stack(last_c)
    return x, torch.stack(last_h)


class _Weights:
    """One layer's and direction's weights: ``W_ih, W_hh[, b_ih, b_hh][, W_hr]``."""

    def __init__(self, weights: Sequence[Tensor], has_biases: bool):
        self.w_ih, self.w_hh = weights[0], weights[1]
        self.b_ih, self.b_hh = (weights[2], weights[3]) if has_biases else (None, None)
        self.w_hr = weights[-1] if len(weights) in (3, 5) else None  # LSTM projection


def _direction(
    cell: str,
    x: Tensor,
    state: tuple[Tensor, Tensor | None],
    weights: _Weights,
    layout: tuple[bool, bool],
) -> tuple[Tensor, tuple[Tensor, Tensor | None]]:
    """One direction of one layer (``layout``: ``(reverse, batch_first)``)."""
    reverse, batch_first = layout
    time = 1 if batch_first else 0
    # the steps as views of one unbind: its backward pass stacks their vectors
    # once (selecting step by step would add T zero-padded copies, O(T²))
    gates_in = F.linear(x, weights.w_ih, weights.b_ih).unbind(time)
    length = len(gates_in)
    order = range(length - 1, -1, -1) if reverse else range(length)
    outputs: list[Tensor | None] = [None] * length
    h, c = state
    for t in order:
        h, c = _step(cell, gates_in[t], (h, c), weights.w_hh, weights.b_hh)
        if weights.w_hr is not None:
            h = F.linear(h, weights.w_hr)
        outputs[t] = h
    return torch.stack(outputs, dim=time), (h, c)


def _step(
    cell: str,
    gates_in: Tensor,
    state: tuple[Tensor, Tensor | None],
    w_hh: Tensor,
    b_hh: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """One step of a cell from its input map ``W_ih x_t + b_ih`` (PyTorch's gates)."""
    h, c = state
    gates_h = F.linear(h, w_hh, b_hh)
    if cell == "lstm":
        i, f, g, o = (gates_in + gates_h).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if cell == "gru":
        in_r, in_z, in_n = gates_in.chunk(3, dim=-1)
        h_r, h_z, h_n = gates_h.chunk(3, dim=-1)
        r = torch.sigmoid(in_r + h_r)
        z = torch.sigmoid(in_z + h_z)
        n = torch.tanh(in_n + r * h_n)
        return (1 - z) * n + z * h, None
    pre = gates_in + gates_h
    return (torch.tanh(pre) if cell == "tanh" else torch.relu(pre)), None
