"""Models BackPACK cannot extend, for the func engine: transformer, LSTM, shared
weights, GroupNorm. Built like ``problems.py``: float32 under a fixed seed, then
cast, with the global RNG left untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from problems import Setup, default_dtype
from torch import Tensor, nn


class PreNormBlock(nn.Module):
    """Pre-norm transformer encoder block on ``[N, T, d]``, mean-pooled classifier."""

    def __init__(self, d: int = 4, heads: int = 2, hidden: int = 6, classes: int = 3):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


class CharLSTM(nn.Module):
    """Embedding → LSTM → Linear per position; output ``[N, C, T]`` (classes second)."""

    def __init__(self, vocab: int = 5, d: int = 3, hidden: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.lstm(self.embedding(x))
        return self.head(h).transpose(1, 2)


class TwiceLinear(nn.Module):
    """One Linear applied twice, ``head(lin(tanh(lin(x))))``."""

    def __init__(self, d: int = 4, classes: int = 3):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lin(torch.tanh(self.lin(x))))


def _group_norm_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, kernel_size=3, padding=1),  # 4×4×4
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 2, kernel_size=2, stride=2),  # 2×2×2
        nn.Flatten(),
        nn.Linear(8, 3),
    )


@dataclass(frozen=True)
class FuncProblem:
    """A model with data and a loss.

    Attributes:
        name: Id.
        build: Float32 model from the seeded global RNG.
        inputs: Draws the inputs of ``N`` samples.
        targets: Draws targets given the model output's shape.
        loss: ``"mse"``, ``"ce"`` or ``"bce"``.
        reduction: ``"mean"`` or ``"sum"``.
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Tensor]
    loss: str
    reduction: str
    batch_size: int = 4

    def setup(self, dtype: torch.dtype = torch.float64, seed: int = 0) -> Setup:
        """The problem's model, loss, inputs and targets."""
        with torch.random.fork_rng(devices=[]), default_dtype(torch.float32):
            torch.manual_seed(seed)
            model = self.build()
            inputs = self.inputs(self.batch_size)
            with torch.no_grad():
                shape = model(inputs).shape
            if self.loss == "ce":
                targets = torch.randint(0, shape[1], (shape[0], *shape[2:]))
            elif self.loss == "bce":
                targets = torch.rand(shape)
            else:
                targets = torch.randn(shape)
        loss_func = {
            "mse": nn.MSELoss,
            "ce": nn.CrossEntropyLoss,
            "bce": nn.BCEWithLogitsLoss,
        }[self.loss](reduction=self.reduction)
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        if targets.is_floating_point():
            targets = targets.to(dtype)
        return Setup(model.to(dtype).eval(), loss_func, inputs, targets)


def _sequences(n: int) -> Tensor:
    return torch.randn(n, 3, 4)


def _tokens(n: int) -> Tensor:
    return torch.randint(0, 5, (n, 3))


FUNC_PROBLEMS = [
    FuncProblem("transformer-ce-mean", PreNormBlock, _sequences, "ce", "mean"),
    FuncProblem("transformer-mse-sum", PreNormBlock, _sequences, "mse", "sum"),
    FuncProblem("lstm-ce-mean", CharLSTM, _tokens, "ce", "mean", batch_size=3),
    FuncProblem("lstm-ce-sum", CharLSTM, _tokens, "ce", "sum", batch_size=3),
    FuncProblem(
        "twice-mse-mean", TwiceLinear, lambda n: torch.randn(n, 4), "mse", "mean"
    ),
    FuncProblem(
        "twice-bce-sum", TwiceLinear, lambda n: torch.randn(n, 4), "bce", "sum"
    ),
    FuncProblem(
        "groupnorm-ce-sum",
        _group_norm_cnn,
        lambda n: torch.randn(n, 2, 4, 4),
        "ce",
        "sum",
    ),
    FuncProblem(
        "groupnorm-bce-mean",
        _group_norm_cnn,
        lambda n: torch.randn(n, 2, 4, 4),
        "bce",
        "mean",
    ),
]
