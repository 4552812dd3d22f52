"""The Gram eigenpairs a parameter group's criterion selects, by ViViT 1.0's rules.

Directions of numerically zero eigenvalues are zero vectors; Gram-space vectors are
handed out class-major, as ViViT's were (``docs/migration.rst``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from warnings import warn

import torch
from torch import Tensor

from vivit.directional.gram_space import (
    batch_directional_gradient,
    directional_curvatures,
    directional_gradients,
)
from vivit.directional.results import DirectionalDerivatives
from vivit.engines.base import BatchInfo
from vivit.errors import InvalidArgumentError
from vivit.linalg.solvers import gram_eigh, numerical_zero_tolerance
from vivit.sources.collector import GroupCurvature


def to_class_major(gram_vectors: Tensor, columns_per_sample: int) -> Tensor:
    """Vectors ``[N·C, K]`` from sample-major rows ``n·C + c`` to ViViT's ``c·N+n``."""
    rows, num_vectors = gram_vectors.shape
    num_samples = rows // columns_per_sample
    return (
        gram_vectors.reshape(num_samples, columns_per_sample, num_vectors)
        .transpose(0, 1)
        .reshape(rows, num_vectors)
    )


def criterion_indices(keep: object, num_evals: int) -> Tensor:
    """Indices ``[K]`` kept by ``keep``: ints (negative from the end) or a mask.

    Raises:
        InvalidArgumentError: If ``keep`` is none of these, or an index is out
            of range.
    """
    try:
        indices = torch.as_tensor(keep)
    except (TypeError, ValueError, RuntimeError):
        indices = None
    if indices is not None and indices.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    mask = indices is not None and indices.dtype == torch.bool
    if mask and indices.shape == (num_evals,):
        return indices.nonzero().flatten().cpu()
    if (
        mask
        or indices is None
        or indices.dim() != 1
        or indices.is_floating_point()
        or indices.is_complex()
    ):
        raise InvalidArgumentError(
            'A group\'s "criterion" must return the indices of the eigenvalues to '
            "keep (a list or 1-d tensor of ints, e.g. [evals.numel() - 1] for the "
            f"largest) or a boolean mask over all {num_evals} of them; got {keep!r}."
        )
    indices = indices.to(torch.long).cpu()
    outside = indices[(indices < -num_evals) | (indices >= num_evals)]
    if outside.numel():
        raise InvalidArgumentError(
            f'The "criterion" returned indices {outside.tolist()} outside the '
            f"{num_evals} eigenvalues it received (valid: 0 to {num_evals - 1}, or "
            "negative from the end)."
        )
    return indices


@dataclass(frozen=True)
class Selection:
    """The Gram eigenpairs a group's criterion selected.

    Attributes:
        evals: Selected eigenvalues ``[K]`` as computed, in the criterion's order.
        gram_evecs: Their Gram eigenvectors, sample-major, ``[N·C, K]``.
        tolerance: Numerical-zero tolerance (directions at or below: zero vectors).
    """

    evals: Tensor
    gram_evecs: Tensor
    tolerance: float

    @property
    def resolved(self) -> Tensor:
        """Which selected eigenvalues lie above the tolerance, ``[K]`` (bool)."""
        return self.evals > self.tolerance


def select_eigenpairs(
    curvature: GroupCurvature,
    criterion: Callable[[Tensor], object],
    warn_small_eigvals: float,
) -> Selection:
    """The Gram eigenpairs the criterion (given all, ascending) keeps; warn if small."""
    evals, evecs = gram_eigh(curvature.gram)
    tolerance = numerical_zero_tolerance(evals, factor_dtype=curvature.factor_dtype)
    keep = criterion_indices(criterion(evals), evals.numel()).to(evals.device)
    evals, evecs = evals[keep], evecs[:, keep]
    if (evals.abs() < warn_small_eigvals).any():
        warn(
            f"Some selected eigenvalues are smaller than {warn_small_eigvals} in "
            "magnitude. Their transformation to parameter space divides by the "
            "eigenvalue's square root and is numerically unstable; consider a "
            "more restrictive criterion. Directions of eigenvalues at or below "
            f"the numerical-zero tolerance {tolerance:.3g} are zero vectors.",
            stacklevel=3,
        )
    return Selection(evals=evals, gram_evecs=evecs, tolerance=tolerance)


def selected_directional_derivatives(
    vt_grads: Tensor,
    selection: Selection,
    batch: BatchInfo,
    grad_samples: Sequence[int] | None = None,
) -> DirectionalDerivatives:
    """``γ``, ``λ``, ``γ̄`` along the selection, from ``Vᵀ∇ℓ_n`` ``[N·C, N_grad]``."""
    resolved = selection.resolved
    evecs, evals = selection.gram_evecs[:, resolved], selection.evals[resolved]
    gammas = directional_gradients(vt_grads, evecs, evals)

    def scatter(values: Tensor) -> Tensor:
        full = values.new_zeros(*values.shape[:-1], resolved.numel())
        full[..., resolved] = values
        return full

    return DirectionalDerivatives(
        evals=selection.evals,
        gammas=scatter(gammas),
        lambdas=scatter(directional_curvatures(evecs, evals, batch)),
        gamma_bar=scatter(batch_directional_gradient(gammas, batch, grad_samples)),
    )
