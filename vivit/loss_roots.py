"""The columns of a loss-Hessian root, formed a block of columns at a time.

Unit roots (``S Sᵀ`` the unit loss's Hessian at every position), exact or Monte
Carlo, in BackPACK's layout ``[K, N, *out]`` (``docs/math.rst``, "Losses").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from vivit.errors import InvalidArgumentError

#: Entries of the unit root formed at once (float64 for a float32 output) when
#: many columns are asked for: 2**22, 32 MiB.
ROOT_BLOCK_ENTRIES = 2**22

#: ``(start, stop, rows) ↦`` columns ``start:stop`` of a unit root for the samples
#: ``rows``, ``[stop - start, len(rows), *out]``.
_Columns = Callable[[int, int, "slice | Tensor"], Tensor]


class LossRoot:
    """A loss-Hessian root ``[K, |S|, *out]``; a slice of columns forms just those.

    Args:
        unit: ``(start, stop, rows) ↦`` unit-root columns ``start:stop`` of the
            samples ``rows``.
        num_columns: ``K``.
        samples_shape: ``[|S|, *out]``.
        factor: ``√R_S`` times the positions' scales, ``[|S|, ...]``
            broadcasting to ``samples_shape``.
        rows: The samples (of ``S``) this root holds: all, or an index.
    """

    def __init__(
        self,
        unit: _Columns,
        num_columns: int,
        samples_shape: torch.Size,
        factor: Tensor,
        rows: slice | Tensor = slice(None),
    ):
        self._unit = unit
        self._factor = factor
        self._rows = rows
        num_rows = (
            len(range(samples_shape[0])[rows]) if isinstance(rows, slice) else len(rows)
        )
        self.shape = torch.Size((num_columns, num_rows, *samples_shape[1:]))
        self._samples_shape = samples_shape

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def device(self) -> torch.device:
        """Where the columns are formed."""
        return self._factor.device

    def rows(self, index: Tensor) -> LossRoot:
        """The root ``[K, len(index), *out]`` of the samples at positions ``index``."""
        return LossRoot(self._unit, len(self), self._samples_shape, self._factor, index)

    def __getitem__(self, columns: slice) -> Tensor:
        """Columns ``columns`` (a slice with step 1), ``[len, |S|, *out]``."""
        start, stop, step = columns.indices(len(self))
        if step != 1:
            raise InvalidArgumentError(
                f"A loss root is indexed by consecutive columns, got step {step}."
            )
        stop = max(start, stop)
        factor = self._factor[self._rows].unsqueeze(0)
        per_column = max(1, self.shape[1:].numel())
        step = max(1, ROOT_BLOCK_ENTRIES // per_column)
        if stop - start <= step:
            return self._unit(start, stop, self._rows) * factor
        # many columns (BackPACK takes them all): the float64 unit root of one
        # block of columns at a time, written into the result
        root = factor.new_empty(stop - start, *self.shape[1:])
        for first in range(start, stop, step):
            last = min(stop, first + step)
            torch.mul(
                self._unit(first, last, self._rows),
                factor,
                out=root[first - start : last - start],
            )
        return root


def exact_columns(kind: str, output: Tensor) -> _Columns:
    """Columns of the exact unit root of ``output``, each non-zero at one position.

    Computed in float64 and rounded once to the output's dtype: a float32 softmax
    root breaks its exact null space (``S_nᵀ 1 = 0``) and shows spurious
    eigenvalues near ``ε₃₂²`` (``docs/math.rst``, "Precision and the numerical
    zero").
    """
    wide = output.double() if output.dtype == torch.float32 else output
    if kind == "ce":
        probs = wide.softmax(1)
        return _softmax_columns(probs.reshape(*probs.shape[:2], -1), output)
    if kind == "bce":
        sigma = wide.sigmoid()
        values = (sigma * (1 - sigma)).sqrt()
    else:
        values = torch.ones_like(wide)
    # [N, E]: an output [N] without axes past the samples has E = 1
    return _diagonal_columns(values.reshape(len(wide), -1), output)


def _diagonal_columns(values: Tensor, output: Tensor) -> _Columns:
    """Columns ``k`` of ``values [N, E]`` at entry ``k``, in the output's dtype."""

    def columns(start: int, stop: int, rows: slice | Tensor) -> Tensor:
        index = torch.arange(start, stop, device=values.device)
        picked = values[rows]
        unit = picked.new_zeros(stop - start, *picked.shape)
        unit[index - start, :, index] = picked[:, index].T
        return unit.reshape(stop - start, len(picked), *output.shape[1:]).to(
            output.dtype
        )

    return columns


def _softmax_columns(probs: Tensor, output: Tensor) -> _Columns:
    """Columns ``v·P + p``: ``√p_c δ_vc - p_c √p_v`` at position ``p`` alone."""
    positions = probs.shape[2]

    def columns(start: int, stop: int, rows: slice | Tensor) -> Tensor:
        index = torch.arange(start, stop, device=probs.device)
        v, p = index // positions, index % positions
        picked = probs[rows]
        tau = picked.sqrt()
        block = -picked[:, :, p] * tau[:, v, p].unsqueeze(1)  # [N, C, k]
        block[:, v, index - start] += tau[:, v, p]
        unit = picked.new_zeros(stop - start, *picked.shape)
        unit[index - start, :, :, p] = block.permute(2, 0, 1)
        return unit.reshape(stop - start, len(picked), *output.shape[1:]).to(
            output.dtype
        )

    return columns


def draw_columns(draws: Tensor) -> _Columns:
    """Columns of Monte-Carlo draws ``[M, N, *out]`` as they are."""
    return lambda start, stop, rows: draws[start:stop, rows]


def position_columns(draws: Tensor) -> _Columns:
    """Columns ``m·P + p`` of draws ``[M, N, C, *T]``: draw ``m`` at position ``p``."""
    flat = draws.reshape(*draws.shape[:3], -1)  # [M, N, C, P]
    positions = flat.shape[3]

    def columns(start: int, stop: int, rows: slice | Tensor) -> Tensor:
        index = torch.arange(start, stop, device=draws.device)
        m, p = index // positions, index % positions
        picked = flat[:, rows]
        unit = picked.new_zeros(stop - start, *picked.shape[1:])
        unit[index - start, :, :, p] = picked[m, :, :, p]
        return unit.reshape(stop - start, picked.shape[1], *draws.shape[2:])

    return columns


def sampled_unit_roots(
    kind: str, output: Tensor, mc_samples: int, generator: torch.Generator | None
) -> Tensor:
    """``M^{-1/2}`` times ``M`` sampled unit-loss gradients, ``[M, N, *out]``."""
    shape = (mc_samples, *output.shape)
    if kind == "mse":  # unit Hessian 1 (the 2 of (f - y)² is in the scale): ε ~ N(0, 1)
        draws = torch.randn(
            shape, dtype=output.dtype, device=output.device, generator=generator
        )
    elif kind == "bce":  # y ~ Bernoulli(σ): ∇ℓ = σ - y
        sigma = output.sigmoid().expand(shape)
        draws = sigma - torch.bernoulli(sigma, generator=generator)
    else:  # y ~ Categorical(p): ∇ℓ = p - onehot(y)
        num_classes = output.shape[1]
        probs = output.softmax(1)
        flat = probs.movedim(1, -1).reshape(-1, num_classes)
        labels = torch.multinomial(
            flat, mc_samples, replacement=True, generator=generator
        )  # [N·P, M]
        onehot = torch.nn.functional.one_hot(labels.T, num_classes).to(output.dtype)
        onehot = onehot.reshape(mc_samples, *probs.movedim(1, -1).shape).movedim(-1, 2)
        draws = probs.unsqueeze(0) - onehot
    return draws / math.sqrt(mc_samples)
