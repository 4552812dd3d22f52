"""The top-k eigenpairs and the damped Newton step of each approximation of the GGN.

What the audit compares (``docs/math.rst``, "Approximation audit"), as float64
vectors over all audited parameters, for the low-rank and diagonal approximations.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Parameter

from vivit.errors import ZeroStepWarning
from vivit.lowrank import LowRankGGN


@dataclass(frozen=True)
class ApproximateCurvature:
    """What the audit compares of one approximation ``Ĝ``, in float64.

    Attributes:
        values: Its top eigenvalues ``[k' ≤ k]``, descending (fewer than ``k``
            where it has fewer non-zero ones).
        vectors: Their eigenvectors as orthonormal rows ``[k', D]`` over all
            audited parameters (zero outside a block).
        step: Its damped Newton step ``−(Ĝ + δI)⁻¹ g``, ``[D]``.
    """

    values: Tensor
    vectors: Tensor
    step: Tensor


def flat_rows(tensors: Sequence[Tensor], rows: int) -> Tensor:
    """Tensors ``[rows, *p.shape]`` (one per parameter) as float64 ``[rows, D]``."""
    return torch.cat([t.detach().reshape(rows, -1).double() for t in tensors], dim=1)


def _embedding(group: Sequence[Parameter], params: Sequence[Parameter]) -> Tensor:
    """Positions of a group's flattened entries in the flattened ``params``."""
    offsets, start = {}, 0
    for p in params:
        offsets[id(p)] = start
        start += p.numel()
    return torch.cat(
        [torch.arange(offsets[id(p)], offsets[id(p)] + p.numel()) for p in group]
    )


def low_rank_curvature(
    ggn: LowRankGGN, params: Sequence[Parameter], top_k: int, damping: float
) -> ApproximateCurvature:
    """Top-k eigenpairs and damped step of a (block-diagonal) ``LowRankGGN``.

    A group's step is the library's damped step on the range minus the
    gradient's component outside it divided by ``δ`` (``docs/math.rst``,
    "Approximation audit").

    Args:
        ggn: The approximation; its groups must partition ``params``.
        params: All audited parameters, in the order of the flattened vectors.
        top_k: Number of leading eigenpairs.
        damping: ``δ > 0``.

    Returns:
        The approximation's curvature (float64, CPU).
    """
    size = sum(p.numel() for p in params)
    device = ggn.gradient()[0].device
    candidates, directions_of, index_of = [], [], []
    step = torch.zeros(size, dtype=torch.float64, device=device)
    for b, group in enumerate(ggn.param_groups):
        evals, evecs = ggn.eigh(None, b)
        directions = flat_rows(evecs, evals.numel())
        gradient = flat_rows([g.unsqueeze(0) for g in ggn.gradient(b)], 1)[0]
        with warnings.catch_warnings():
            # a group without curvature has no range part; its step is −g/δ
            warnings.simplefilter("ignore", ZeroStepWarning)
            on_range = ggn.newton_step(None, b, damping)
        outside = gradient - directions.T @ (directions @ gradient)
        index = _embedding(group, params).to(device)
        step[index] = flat_rows([s.unsqueeze(0) for s in on_range], 1)[0]
        step[index] -= outside / damping
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


def exact_diagonal(ggn: LowRankGGN) -> Tensor:
    """The diagonal ``Σ_j λ_j e_jd²`` of the exact GGN (one group), float64 ``[D]``.

    From the non-zero eigenpairs (``docs/math.rst``, "Approximation audit").
    """
    evals, evecs = ggn.eigh(None)
    directions = flat_rows(evecs, evals.numel())
    return (evals.double().unsqueeze(1) * directions.square()).sum(0).cpu()


def diagonal_curvature(
    diagonal: Tensor, gradient: Tensor, top_k: int, damping: float
) -> ApproximateCurvature:
    """Top-k eigenpairs and damped step ``−g / (d + δ)`` of ``Ĝ = diag(d)``, ``d ≥ 0``.

    ``top_k`` and ``damping`` as for :func:`low_rank_curvature`; ``d``, ``g``
    ``[D]``.
    """
    diagonal, gradient = diagonal.double().cpu(), gradient.double().cpu()
    values, index = diagonal.topk(min(top_k, diagonal.numel()))
    vectors = torch.zeros(index.numel(), diagonal.numel(), dtype=torch.float64)
    vectors[torch.arange(index.numel()), index] = 1.0
    return ApproximateCurvature(
        values=values, vectors=vectors, step=-gradient / (diagonal + damping)
    )
