"""The optimizer tests' problems: least squares (GGN = Hessian), three blobs."""

import torch
from backpack import extend
from torch import nn

from tests.fixtures.problems import mlp

DTYPE = torch.float64


def least_squares(reduction: str):
    """A linear model, MSE on 20 samples it cannot interpolate: GGN = Hessian."""
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(20, 3, generator=gen, dtype=DTYPE)
    y = X @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=DTYPE) + 0.3
    y = y + 0.5 * torch.randn(20, 1, generator=gen, dtype=DTYPE)  # not interpolable
    model = extend(nn.Linear(3, 1).to(DTYPE))
    return model, extend(nn.MSELoss(reduction=reduction)), X, y


def blobs(per_class: int = 10, seed: int = 0):
    """Three Gaussian blobs in 2d, an MLP with a hidden layer of 8 (extended).

    The global RNG is left as it was.
    """
    gen = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]], dtype=DTYPE)
    y = torch.arange(3).repeat(per_class)
    X = centers[y] + 0.8 * torch.randn(3 * per_class, 2, generator=gen, dtype=DTYPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = mlp(2, 8, 3)
    return extend(model.to(DTYPE)), extend(nn.CrossEntropyLoss()), X, y
