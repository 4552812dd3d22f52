"""Registry of tiny test problems: every architecture × loss × reduction.

A problem builds ``(model, loss_func, inputs, targets)`` deterministically from a
seed. Models are created in float32 and then cast, and data are drawn in float32
and cast, so a float64 problem holds exactly the numbers of the float32 problem with
the same seed. The global RNG state is left untouched.

Add an architecture to ``ARCHITECTURES`` and it is tested everywhere::

    @pytest.mark.parametrize("problem", PROBLEMS, ids=problem_ids(PROBLEMS))
    def test_something(problem):
        model, loss_func, inputs, targets = prepare(problem, torch.float64, seed=0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import backpack
import torch
from torch import Tensor, nn

LOSSES = ("mse", "ce")
REDUCTIONS = ("mean", "sum")


class Setup(NamedTuple):
    """What a problem builds: unpacks as ``model, loss_func, inputs, targets``."""

    model: nn.Module
    loss_func: nn.Module
    inputs: Tensor
    targets: Tensor


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily set torch's default dtype.

    BackPACK 1.7.1's AvgPool derivatives build their averaging kernels in the
    default dtype, so a float64 AvgPool model fails in the backward pass ("expected
    scalar type Double but found Float") unless it runs under
    ``default_dtype(torch.float64)``; see ``Problem.needs_default_dtype``.
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# ----------------------------------------------------------------------------------
# Architectures
# ----------------------------------------------------------------------------------


class Residual(nn.Module):
    """``h = lin(x); head(h + block(h))``: a custom forward that needs the converter."""

    def __init__(self, in_features: int = 4, hidden: int = 5, out_features: int = 3):
        super().__init__()
        self.lin = nn.Linear(in_features, hidden)
        self.block = nn.Sequential(
            nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, hidden)
        )
        self.head = nn.Sequential(nn.Sigmoid(), nn.Linear(hidden, out_features))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        return self.head(h + self.block(h))


def randomize_batchnorm(model: nn.Module) -> nn.Module:
    """Random running statistics and affine parameters for BatchNorm; eval mode."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
    return model.eval()


def _mlp(activation: type[nn.Module]) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(
        nn.Linear(4, 6), activation(), nn.Linear(6, 5), activation(), nn.Linear(5, 3)
    )


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, kernel_size=3, padding=1),  # 3×6×6
        nn.ReLU(),
        nn.MaxPool2d(2),  # 3×3×3
        nn.Conv2d(3, 4, kernel_size=2, padding=1),  # 4×4×4
        nn.Tanh(),
        nn.AvgPool2d(2),  # 4×2×2
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def _conv1d() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 3, kernel_size=3, stride=2, padding=1),  # 3×4
        nn.Tanh(),
        nn.Conv1d(3, 2, kernel_size=2, dilation=2),  # 2×2
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def _conv3d() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 2, kernel_size=2),  # 2×3×3×3
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(54, 3),
    )


def _sequence_linear() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 5),  # applied at each of the T=3 positions
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(15, 4),
    )


def _batchnorm1d() -> nn.Module:
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)
    )
    return randomize_batchnorm(model)


def _batchnorm2d() -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(2, 3, kernel_size=3),  # 3×3×3
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(27, 3),
    )
    return randomize_batchnorm(model)


@dataclass(frozen=True)
class Architecture:
    """A model builder (called under a fixed seed) and the data shapes it expects.

    Attributes:
        name: Short name, first part of the problem names.
        build: Creates the float32 model (from the global RNG, seeded by the caller).
        input_shape: Shape of one input sample.
        num_outputs: C, the model outputs per sample.
        batch_size: N.
        needs_converter: Whether BackPACK needs ``extend(..., use_converter=True)``.
        needs_default_dtype: Whether BackPACK's backward pass must run with the
            model's dtype as default dtype (AvgPool, see ``default_dtype``).
    """

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    num_outputs: int
    batch_size: int = 5
    needs_converter: bool = False
    needs_default_dtype: bool = False


ARCHITECTURES: list[Architecture] = [
    Architecture("mlp_tanh", _mlp(nn.Tanh), (4,), 3),
    Architecture("mlp_relu", _mlp(nn.ReLU), (4,), 3, batch_size=6),
    Architecture("mlp_sigmoid", _mlp(nn.Sigmoid), (4,), 3),
    Architecture("cnn", _cnn, (2, 6, 6), 3, batch_size=4, needs_default_dtype=True),
    Architecture("conv1d", _conv1d, (2, 8), 3, batch_size=6),
    Architecture("conv3d", _conv3d, (1, 4, 4, 4), 3, batch_size=4),
    Architecture("sequence_linear", _sequence_linear, (3, 4), 4),
    Architecture("batchnorm1d", _batchnorm1d, (4,), 3, batch_size=6),
    Architecture("batchnorm2d", _batchnorm2d, (2, 5, 5), 3, batch_size=4),
    Architecture("residual", Residual, (4,), 3, needs_converter=True),
]


# ----------------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------------


def _make_loss(loss: str, reduction: str) -> nn.Module:
    if loss == "mse":
        return nn.MSELoss(reduction=reduction)
    if loss == "ce":
        return nn.CrossEntropyLoss(reduction=reduction)
    raise ValueError(f"Unknown loss {loss!r}.")


@dataclass(frozen=True)
class Problem:
    """One architecture with one loss and reduction.

    Attributes:
        name: Unique id, ``"{architecture}-{loss}-{reduction}"``.
        architecture: Name of the architecture.
        loss: ``"mse"`` (random float targets) or ``"ce"`` (random labels).
        reduction: ``"mean"`` or ``"sum"``.
        factory: ``factory(dtype, seed) -> Setup`` with the *unextended* model.
        needs_converter: Whether BackPACK needs ``extend(..., use_converter=True)``.
        needs_default_dtype: Whether BackPACK's backward pass must run under
            ``default_dtype(dtype)`` (BackPACK's AvgPool in float64).
        batch_size: N.
        num_outputs: C, the model outputs per sample.
    """

    name: str
    architecture: str
    loss: str
    reduction: str
    factory: Callable[[torch.dtype, int], Setup]
    needs_converter: bool = False
    needs_default_dtype: bool = False
    batch_size: int = 5
    num_outputs: int = 3

    def build(self, dtype: torch.dtype = torch.float64, seed: int = 0) -> Setup:
        """The unextended problem (same as ``factory(dtype, seed)``)."""
        return self.factory(dtype, seed)


def _factory(
    arch: Architecture, loss: str, reduction: str
) -> Callable[[torch.dtype, int], Setup]:
    def factory(dtype: torch.dtype = torch.float64, seed: int = 0) -> Setup:
        N, C = arch.batch_size, arch.num_outputs
        with torch.random.fork_rng(devices=[]), default_dtype(torch.float32):
            torch.manual_seed(seed)
            model = arch.build()
            inputs = torch.randn(N, *arch.input_shape)
            if loss == "mse":
                targets = torch.randn(N, C).to(dtype)
            else:
                targets = torch.randint(0, C, (N,))
        loss_func = _make_loss(loss, reduction)
        return Setup(model.to(dtype), loss_func, inputs.to(dtype), targets)

    return factory


def _problem(arch: Architecture, loss: str, reduction: str) -> Problem:
    return Problem(
        name=f"{arch.name}-{loss}-{reduction}",
        architecture=arch.name,
        loss=loss,
        reduction=reduction,
        factory=_factory(arch, loss, reduction),
        needs_converter=arch.needs_converter,
        needs_default_dtype=arch.needs_default_dtype,
        batch_size=arch.batch_size,
        num_outputs=arch.num_outputs,
    )


PROBLEMS: list[Problem] = [
    _problem(arch, loss, reduction)
    for arch in ARCHITECTURES
    for loss in LOSSES
    for reduction in REDUCTIONS
]


def problem_ids(problems: Sequence[Problem] = PROBLEMS) -> list[str]:
    """Pytest ids for ``problems``."""
    return [p.name for p in problems]


def get_problem(name: str) -> Problem:
    """The registered problem called ``name``."""
    for p in PROBLEMS:
        if p.name == name:
            return p
    raise KeyError(f"No problem {name!r}; known: {problem_ids()}.")


def select(
    *,
    architecture: str | Sequence[str] | None = None,
    loss: str | None = None,
    reduction: str | None = None,
    needs_converter: bool | None = None,
) -> list[Problem]:
    """The registered problems matching all given criteria."""
    archs = [architecture] if isinstance(architecture, str) else architecture
    return [
        p
        for p in PROBLEMS
        if (archs is None or p.architecture in archs)
        and (loss is None or p.loss == loss)
        and (reduction is None or p.reduction == reduction)
        and (needs_converter is None or p.needs_converter == needs_converter)
    ]


def prepare(
    problem: Problem,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    extend: bool = True,
) -> Setup:
    """Build a problem; with ``extend``, BackPACK-extend model and loss function.

    Flagged models are converted with ``extend(model, use_converter=True)``, which
    returns a ``torch.fx.GraphModule`` holding *copies* of the parameters (possibly
    in another order): compute references on the returned model. Without ``extend``
    the plain modules are returned.
    """
    model, loss_func, inputs, targets = problem.build(dtype, seed)
    if extend:
        model = backpack.extend(model, use_converter=problem.needs_converter)
        loss_func = backpack.extend(loss_func)
    return Setup(model, loss_func, inputs, targets)
