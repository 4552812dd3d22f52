"""Recurrent kernels step by step, every weight entering through ``F.linear``.

PyTorch's per-step equations (``docs/math.rst``, "Recurrent layers"); packed
sequences and dropout between layers keep the fused kernel.
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


def bind(args: tuple, kwargs: dict, names: tuple[str, ...], defaults=None) -> dict:
    """A call's arguments by name: ``defaults``, then ``args``, then ``kwargs``."""
    return {**(defaults or {}), **dict(zip(names, args, strict=False)), **kwargs}


def _bound(func: Callable, args: tuple, kwargs: dict) -> dict:
    """A recurrent kernel call's arguments (empty: another call, or a packed input)."""
    if func in CELL_KERNELS:
        return bind(args, kwargs, _CELL_ARGS)
    packed = len(args) < 4 or isinstance(args[3], (list, tuple))  # params fourth
    if func in SEQUENCE_KERNELS and not packed:
        return bind(args, kwargs, _SEQUENCE_ARGS)
    return {}


def recurrent_weights(func: Callable, args: tuple, kwargs: dict) -> list[Tensor]:
    """The weights a recurrent kernel call uses (empty for any other call)."""
    bound = _bound(func, args, kwargs)
    if "params" in bound:
        return list(bound["params"])
    return [bound[k] for k in _CELL_ARGS[2:] if bound.get(k) is not None]


def stepwise(func: Callable, args: tuple, kwargs: dict) -> Tensor | tuple | None:
    """What ``func(*args, **kwargs)`` returns, step by step (``None``: not here)."""
    bound = _bound(func, args, kwargs)
    if func in CELL_KERNELS:
        return _cell_call(CELL_KERNELS[func], bound)
    if not bound:
        return None
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
            layout = (bool(direction), batch_first, bound["has_biases"])
            steps, (h, c) = _direction(cell, x, state, weights, layout)
            outputs.append(steps)
            last_h.append(h)
            last_c.append(c)
        x = torch.cat(outputs, dim=-1) if directions > 1 else outputs[0]
    if cell == "lstm":
        return x, torch.stack(last_h), torch.stack(last_c)
    return x, torch.stack(last_h)


def _direction(
    cell: str,
    x: Tensor,
    state: tuple[Tensor, Tensor | None],
    weights: Sequence[Tensor],
    layout: tuple[bool, bool, bool],
) -> tuple[Tensor, tuple[Tensor, Tensor | None]]:
    """One direction of one layer: ``W_ih, W_hh[, b_ih, b_hh][, W_hr]``.

    ``layout``: ``(reverse, batch_first, has_biases)``; ``W_hr``: LSTM projection.
    """
    reverse, batch_first, has_biases = layout
    w_ih, w_hh = weights[:2]
    b_ih, b_hh = weights[2:4] if has_biases else (None, None)
    w_hr = weights[-1] if len(weights) in (3, 5) else None
    time = 1 if batch_first else 0
    # the steps as views of one unbind: its backward pass stacks their vectors
    # once (selecting step by step would add T zero-padded copies, O(T²))
    gates_in = F.linear(x, w_ih, b_ih).unbind(time)
    length = len(gates_in)
    order = range(length - 1, -1, -1) if reverse else range(length)
    outputs: list[Tensor | None] = [None] * length
    h, c = state
    for t in order:
        h, c = _step(cell, gates_in[t], (h, c), w_hh, b_hh)
        if w_hr is not None:
            h = F.linear(h, w_hr)
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
