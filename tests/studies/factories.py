"""Model factories for the ``--model MODULE:FACTORY`` tests (inputs: 8x8 digits)."""

from backpack import extend
from torch import nn


def small_mlp() -> nn.Module:
    """A tiny MLP for the digits."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10))


def three_outputs() -> nn.Module:
    """Only three outputs: digit labels up to 9 do not fit."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 3))


def layernorm_mlp() -> nn.Module:
    """LayerNorm: not supported by the BackPACK engine."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 8), nn.LayerNorm(8), nn.Linear(8, 10)
    )


class Residual(nn.Module):
    """``x + f(x)``: a custom forward BackPACK cannot follow without conversion."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.inner(x)


def residual() -> nn.Module:
    """A residual network, not converted."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), Residual(), nn.Linear(8, 10))


def residual_converted() -> nn.Module:
    """The residual network, converted as the error message suggests."""
    return extend(residual(), use_converter=True)


def not_a_module():
    """Returns something that is not a module."""
    return 42
