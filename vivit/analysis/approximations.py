"""The top-k eigenpairs and damped Newton step of each approximation of the GGN.

Float64 vectors over all audited parameters (``docs/math.rst``, "Approximation
audit"): low-rank, diagonal, and curvlinops' KFAC and EKFAC (``vivit[audit]``).
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Conv2d, CrossEntropyLoss, Linear, Module, Parameter

from vivit.distributed.sharded import gathered
from vivit.errors import ZeroStepWarning
from vivit.linalg.iterative import block_krylov_eigh
from vivit.lowrank import LowRankGGN
from vivit.sources.implicit import flatten_rows

#: The Kronecker-factored approximations and curvlinops' class of each.
KRONECKER_FACTORED = {"kfac": "KFACLinearOperator", "ekfac": "EKFACLinearOperator"}

#: The layers whose parameters curvlinops' KFAC and EKFAC support (in curvlinops
#: 3; an operator class's own ``_SUPPORTED_MODULES`` takes precedence).
KRONECKER_FACTORED_LAYERS = (Linear, Conv2d)

#: How many unsupported layers a refusal names before it counts the rest.
NAMED_LAYERS = 6

#: What a row says when curvlinops is missing.
NOT_INSTALLED = "pip install 'vivit[audit]' (curvlinops-for-pytorch) for this row"


@dataclass(frozen=True)
class ApproximateCurvature:
    """What the audit compares of one approximation ``Ĝ``, in float64, on the CPU.

    Attributes:
        values: Its top eigenvalues ``[k' ≤ k]``, descending.
        vectors: Their orthonormal eigenvectors ``[k', D]`` over all audited
            parameters.
        step: Its damped Newton step ``−(Ĝ + δI)⁻¹ g``, ``[D]``.
    """

    values: Tensor
    vectors: Tensor
    step: Tensor


def flat_rows(tensors: Sequence[Tensor]) -> Tensor:
    """Tensors ``[K, *p.shape]`` (one per parameter) as float64 ``[K, D]``.

    An FSDP2 model's (``DTensor``) are gathered first.
    """
    return flatten_rows([gathered(t) for t in tensors]).detach().double()


def flat(tensors: Sequence[Tensor]) -> Tensor:
    """Tensors shaped like the parameters as one float64 vector ``[D]``."""
    return flat_rows([t.unsqueeze(0) for t in tensors])[0]


def cosine(a: Tensor, b: Tensor) -> float | None:
    """``⟨a, b⟩ / (‖a‖ ‖b‖)`` of two vectors; ``None`` where one is zero."""
    norms = a.norm() * b.norm()
    return None if norms == 0 else float((a @ b) / norms)


def _embedding(group: Sequence[Parameter], params: Sequence[Parameter]) -> Tensor:
    """Positions of a group's flattened entries in the flattened ``params``."""
    sizes = [p.numel() for p in params]
    where = dict(
        zip(map(id, params), torch.arange(sum(sizes)).split(sizes), strict=True)
    )
    return torch.cat([where[id(p)] for p in group])


def low_rank_curvature(
    ggn: LowRankGGN, params: Sequence[Parameter], top_k: int, damping: float
) -> ApproximateCurvature:
    """Top-k eigenpairs and damped step ``δ > 0`` of a (block-diagonal) LowRankGGN.

    Its groups partition ``params``; a group's step is the library's on the range
    minus the gradient's component outside it divided by ``δ``.
    """
    size = sum(p.numel() for p in params)
    device = ggn.gradient()[0].device
    candidates, directions_of, index_of = [], [], []
    step = torch.zeros(size, dtype=torch.float64, device=device)
    for b, group in enumerate(ggn.param_groups):
        evals, evecs = ggn.eigh(None, b)
        directions = flat_rows(evecs)
        gradient = flat(ggn.gradient(b))
        with warnings.catch_warnings():
            # a group without curvature has no range part; its step is −g/δ
            warnings.simplefilter("ignore", ZeroStepWarning)
            on_range = ggn.newton_step(None, b, damping)
        outside = gradient - directions.T @ (directions @ gradient)
        index = _embedding(group, params).to(device)
        step[index] = flat(on_range) - outside / damping
        directions_of.append(directions)
        index_of.append(index)
        candidates += [(float(v), b, j) for j, v in enumerate(evals.tolist())]
    leading = sorted(candidates, reverse=True)[:top_k]
    # only the leading directions are embedded into the D parameters
    vectors = torch.zeros(len(leading), size, dtype=torch.float64, device=device)
    for row, (_, b, j) in enumerate(leading):
        vectors[row, index_of[b]] = directions_of[b][j]
    return ApproximateCurvature(
        values=torch.tensor([v for v, _, _ in leading], dtype=torch.float64),
        vectors=vectors.cpu(),
        step=step.cpu(),
    )


def diagonal_curvature(
    ggn: LowRankGGN, gradient: Tensor, top_k: int, damping: float
) -> ApproximateCurvature:
    """Top-k eigenpairs and damped step ``−g / (d + δ)`` of the exact GGN's diagonal."""
    evals, evecs = ggn.eigh(None)
    directions = flat_rows(evecs)
    diagonal = (evals.double().unsqueeze(1) * directions.square()).sum(0).cpu()
    values, index = diagonal.topk(min(top_k, diagonal.numel()))
    vectors = torch.zeros(index.numel(), diagonal.numel(), dtype=torch.float64)
    vectors[torch.arange(index.numel()), index] = 1.0
    step = -gradient.double().cpu() / (diagonal + damping)
    return ApproximateCurvature(values=values, vectors=vectors, step=step)


def curvlinops_installed() -> bool:
    """Whether the ``curvlinops`` package is installed."""
    return importlib.util.find_spec("curvlinops") is not None


class CurvlinopsRefusalError(Exception):
    """curvlinops cannot build the approximation for this model (its reason)."""


def unsupported_layers(
    supported: tuple[type[Module], ...], model: Module, params: Sequence[Parameter]
) -> list[str]:
    """``"name (Type: weight, bias)"`` of the layers curvlinops would refuse.

    Each module owning audited parameters that no ``supported`` module holds
    (curvlinops' test: any supported module, submodules included, holding it).
    """
    covered = {
        id(p)
        for module in model.modules()
        if isinstance(module, supported)
        for p in module.parameters()
    }
    outside = {id(p) for p in params} - covered
    layers = []
    for name, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False) if id(p) in outside]
        if own:
            layers.append(
                f"{name or 'the model itself'} ({type(module).__name__}: "
                f"{', '.join(own)})"
            )
    return layers


def refusal_reason(
    kind: str, supported: tuple[type[Module], ...], layers: list[str]
) -> str:
    """Why ``kind``'s row is skipped: the layers curvlinops would leave out."""
    named = "; ".join(layers[:NAMED_LAYERS])
    rest = len(layers) - NAMED_LAYERS
    more = f"; and {rest} more layer(s)" if rest > 0 else ""
    return (
        f"curvlinops' {kind.upper()} supports parameters of "
        f"{' and '.join(t.__name__ for t in supported)} layers only, so the row is "
        f"skipped rather than cover part of the model; not supported: {named}"
        f"{more}. Freeze those parameters (requires_grad_(False)) to audit the "
        "other layers alone"
    )


class _OutputAxis(Module):
    """``model`` with an output axis of one, ``[N]`` to ``[N, 1]``."""

    def __init__(self, model: Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: object) -> Tensor:  # noqa: D102
        return self.model(inputs).unsqueeze(1)


def kronecker_factored_curvature(
    kind: str,
    model: Module,
    loss_func: Module,
    data: tuple[Tensor, Tensor],
    params: Sequence[Parameter],
    gradient: Tensor,
    top_k: int,
    damping: float,
) -> ApproximateCurvature:
    """Top-k eigenpairs and damped step of curvlinops' KFAC or EKFAC (``kind``).

    Type-2 Fisher (the GGN), exactly damped inverse; ``gradient`` ``[D]`` of ``data``.

    Raises:
        CurvlinopsRefusalError: If curvlinops refuses the model, naming the layers
            it does not support.
    """
    import curvlinops

    operator_class = getattr(curvlinops, KRONECKER_FACTORED[kind])
    supported = getattr(operator_class, "_SUPPORTED_MODULES", KRONECKER_FACTORED_LAYERS)
    layers = unsupported_layers(supported, model, params)
    if layers:
        raise CurvlinopsRefusalError(refusal_reason(kind, supported, layers))
    if data[1].dim() == 1 and not isinstance(loss_func, CrossEntropyLoss):
        # curvlinops reads the last axis as the outputs: [N] is [N, 1] (one column)
        model, data = _OutputAxis(model), (data[0], data[1].unsqueeze(1))
    options = {"fisher_type": curvlinops.FisherType.TYPE2, "check_deterministic": False}
    reference, size = params[0], sum(p.numel() for p in params)
    like = {"dtype": reference.dtype, "device": reference.device}
    try:  # curvlinops refuses some inputs only at the first product (soft targets)
        operator = operator_class(model, loss_func, list(params), [data], **options)
        values, vectors, _ = block_krylov_eigh(
            lambda b: operator @ b, size, top_k, **like
        )
        inverse = curvlinops.KFACInverseLinearOperator(
            operator, damping=damping, use_exact_damping=True
        )
        step = inverse @ gradient.to(reference.device, reference.dtype)
    except NotImplementedError as error:  # a refusal the check above did not foresee
        raise CurvlinopsRefusalError(
            f"curvlinops refuses {kind.upper()} for this model ({error})"
        ) from None
    return ApproximateCurvature(
        values=values.flip(0).double().cpu(),
        vectors=flat_rows([vectors.T.flip(0)]).cpu(),
        step=-step.double().cpu(),
    )
