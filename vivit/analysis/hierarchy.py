"""Papyan's three levels of a cross-entropy GGN, from its Gram matrix alone.

Papyan's means are weighted by the softmax probabilities, which the GGN does not
keep: the caller passes them, or asks for the plain-mean variant by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vivit._validation import check_positive_int
from vivit.errors import InvalidArgumentError
from vivit.linalg.solvers import gram_eigh, numerical_zero_tolerance
from vivit.results import CurvatureResults

#: The parts of :class:`Hierarchy`, in the order of the hierarchy.
PARTS = ("class_means", "cross_class", "within_class")


@dataclass(frozen=True)
class SpectrumPart:
    """The non-zero eigenpairs of one part of the GGN.

    Attributes:
        eigenvalues: ``[K]`` eigenvalues above the numerical-zero tolerance, descending.
        coefficients: ``[N·C, K]``; unit eigenvector ``k``: ``V @ coefficients[:, k]``.
    """

    eigenvalues: Tensor
    coefficients: Tensor


@dataclass(frozen=True)
class Hierarchy:
    """The GGN split exactly into class means, cross-class means and within-class.

    Attributes:
        weighting: ``"probabilities"``: Papyan's parts (probability-weighted means);
            ``"plain"``: the plain-mean variant (``docs/math.rst``, "Hierarchy of
            the spectrum").
        full: The GGN of all analysed groups together.
        class_means: ``G_class``, rank at most ``C``.
        cross_class: ``G_cross``, rank at most ``C(C−1)``.
        within_class: ``G_within``, the deviations from the pair means.
        group_spectra: All eigenvalues of each analysed group's GGN block, ascending.
        zero_tolerance: The full Gram matrix's numerical zero, used for every part.
        gram: The full ``[N·C, N·C]`` Gram matrix ``G̃ = Vᵀ V``.
    """

    weighting: str
    full: SpectrumPart
    class_means: SpectrumPart
    cross_class: SpectrumPart
    within_class: SpectrumPart
    group_spectra: list[Tensor]
    zero_tolerance: float
    gram: Tensor

    def part(self, name: str) -> SpectrumPart:
        """A part by name: ``"full"`` or one of :data:`PARTS`.

        Raises:
            InvalidArgumentError: For another name.
        """
        if name not in ("full", *PARTS):
            parts = ", ".join(repr(p) for p in ("full", *PARTS))
            raise InvalidArgumentError(f"No part {name!r}; the parts are {parts}.")
        return getattr(self, name)

    def cosines(self, name: str, top_k: int | None = None) -> Tensor:
        """``[K_full, top_k]`` products ``e_iᵀ f_j`` of the GGN's and a part's eigvecs.

        Args:
            name: The part (see :meth:`part`).
            top_k: Leading eigenvectors of the part (``None``: all of them).
        """
        part = self.part(name).coefficients[:, :top_k]
        return self.full.coefficients.T @ (self.gram @ part)

    def overlap(self, name: str, top_k: int, full_top_k: int | None = None) -> float:
        """Share of a part's top eigenspace in the GGN's, ``‖E_fullᵀ E_part‖_F² / k``.

        In ``[0, 1]``; 0 without non-zero eigenvalues.

        Args:
            name: The part (see :meth:`part`).
            top_k: Leading eigenvectors of the part; fewer if fewer are non-zero.
            full_top_k: Leading eigenvectors of the full GGN (default: ``top_k``).

        Raises:
            InvalidArgumentError: For a count that is not a positive integer.
        """
        check_positive_int(top_k, "top_k", "leading eigenvectors of the part")
        check_positive_int(
            full_top_k, "full_top_k", "leading eigenvectors of the GGN", none="top_k"
        )
        cosines = self.cosines(name, top_k)[: full_top_k or top_k]
        if cosines.shape[1] == 0:
            return 0.0
        return (cosines.square().sum() / cosines.shape[1]).item()


def hierarchy(
    ggn: CurvatureResults,
    labels: Tensor,
    *,
    probabilities: Tensor | str | None = None,
    groups: Sequence[int] | None = None,
) -> Hierarchy:
    """Split a cross-entropy GGN into Papyan's class, cross-class and within parts.

    Of all ``groups`` together, from exact loss-Hessian roots (``mc_samples=0``), in
    about five ``N·C × N·C`` matrices (``docs/math.rst``, "Hierarchy of the spectrum").
    Papyan weights the means by the softmax probabilities, which the GGN does not
    keep: pass them for his decomposition, or ``"plain"`` for the plain-mean variant
    (the result's ``weighting`` says which).

    Args:
        ggn: The GGN (:class:`~vivit.LowRankGGN`; its Gram matrices are formed).
        labels: ``[N]`` int labels in ``[0, C)`` of the GGN's (subsampled) samples.
        probabilities: ``[N, C]`` softmax outputs of those samples,
            ``model(X).softmax(1)`` (Papyan's decomposition), or ``"plain"``; no
            default (``None`` is refused).
        groups: Indices of the (disjoint) parameter groups analysed (default: all).

    Raises:
        InvalidArgumentError: Without ``probabilities``; for mismatched labels or
            probabilities, or no ``groups``.
    """
    if probabilities is None:
        raise InvalidArgumentError(
            "hierarchy needs the weighting of the class means: pass "
            "probabilities=model(X).softmax(1) (the [N, C] softmax outputs of the "
            "GGN's samples) for Papyan's decomposition, or probabilities='plain' "
            "for the plain-mean variant (not Papyan's: its class part differs on "
            "an imbalanced batch)."
        )
    indices = list(range(len(ggn.param_groups))) if groups is None else list(groups)
    if not indices:
        raise InvalidArgumentError("groups is empty; name at least one group index.")
    gram = sum((ggn.gram(g) for g in indices[1:]), ggn.gram(indices[0]))
    num_rows = gram.shape[0]
    classes = _check_labels(labels, num_rows)
    weights = _column_weights(labels, classes, probabilities, gram.dtype)
    evals, evecs = gram_eigh(gram)
    factor_dtype = ggn.param_groups[indices[0]][0].dtype
    tolerance = numerical_zero_tolerance(evals, factor_dtype=factor_dtype)
    full_evals, full_evecs = _kept(evals, evecs, tolerance)
    full = SpectrumPart(full_evals, full_evecs / full_evals.sqrt())
    means = _pair_means(labels.to(gram.device), classes, weights.to(gram.device))
    class_means, cross_class = means
    within = torch.eye(num_rows, dtype=gram.dtype, device=gram.device)
    within -= class_means @ class_means.T + cross_class @ cross_class.T
    # one group: its spectrum is the one just computed from the same Gram matrix
    spectra = [ggn.eigvalsh(g) for g in indices] if indices[1:] else [evals.clone()]
    return Hierarchy(
        weighting="plain" if isinstance(probabilities, str) else "probabilities",
        full=full,
        class_means=_part(gram, class_means, tolerance),
        cross_class=_part(gram, cross_class, tolerance),
        within_class=_part(gram, within, tolerance),
        group_spectra=spectra,
        zero_tolerance=tolerance,
        gram=gram,
    )


def _check_labels(labels: object, num_rows: int) -> int:
    """The number of classes ``C = N·C / N``, after checking the labels."""
    if (
        not isinstance(labels, Tensor)
        or labels.dim() != 1
        or labels.is_floating_point()
    ):
        raise InvalidArgumentError(
            "labels must be a 1-d integer tensor [N] of class labels, got "
            f"{getattr(labels, 'shape', type(labels).__name__)}"
            f"{' of ' + str(labels.dtype) if isinstance(labels, Tensor) else ''}."
        )
    num_samples = labels.numel()
    if num_samples == 0 or num_rows % num_samples:
        raise InvalidArgumentError(
            f"The Gram matrix has {num_rows} rows, not C rows for each of the "
            f"{num_samples} labels: pass the labels of the GGN's samples (of its "
            "subsampling), one per sample."
        )
    classes = num_rows // num_samples
    if labels.min() < 0 or labels.max() >= classes:
        raise InvalidArgumentError(
            f"labels must lie in [0, {classes}) (C = {classes} Gram rows per "
            f"sample), got values from {labels.min().item()} to "
            f"{labels.max().item()}."
        )
    return classes


def _column_weights(
    labels: Tensor, classes: int, probabilities: Tensor | str, dtype: torch.dtype
) -> Tensor:
    """``[N·C]`` weights of the columns in their pair's mean: 1 or ``√p_nc``."""
    shape = (labels.numel(), classes)
    if isinstance(probabilities, str) and probabilities == "plain":
        return torch.ones(shape[0] * classes, dtype=dtype)
    if not isinstance(probabilities, Tensor) or tuple(probabilities.shape) != shape:
        raise InvalidArgumentError(
            f"probabilities must be the softmax outputs, a tensor of shape "
            f"{list(shape)} (samples, classes), for Papyan's decomposition, or "
            f"'plain' for plain means; got "
            f"{getattr(probabilities, 'shape', probabilities)!r}."
        )
    if not probabilities.isfinite().all() or (probabilities < 0).any():
        raise InvalidArgumentError(
            "probabilities must be finite and non-negative (softmax outputs)."
        )
    # C entries, each rounded once in the softmax, summed: at most 2C roundings,
    # of float32 at least (a float32 model's softmax, cast up, keeps its rounding)
    eps = max(torch.finfo(probabilities.dtype).eps, torch.finfo(torch.float32).eps)
    rounding = 2 * classes * eps
    if ((probabilities.sum(1) - 1).abs() > rounding).any():
        raise InvalidArgumentError(
            "probabilities must sum to 1 over the classes (dim 1) for each "
            "sample: pass model(X).softmax(1), not logits or a softmax over dim 0."
        )
    return probabilities.detach().to(dtype).sqrt().flatten().cpu()


def _pair_means(labels: Tensor, classes: int, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Unit weight columns of the non-empty pairs ``(y_n, c)``, ``c = y_n`` first."""
    rows = torch.arange(labels.numel() * classes, device=labels.device)
    pair = labels.repeat_interleave(classes) * classes + rows % classes
    member = torch.zeros(rows.numel(), classes * classes, dtype=weights.dtype)
    member = member.to(weights.device)
    member[rows, pair] = weights
    norms = member.norm(dim=0)
    same = torch.arange(classes * classes, device=labels.device)
    same = same // classes == same % classes
    kept = norms > 0
    columns = member[:, kept] / norms[kept]
    return columns[:, same[kept]], columns[:, ~same[kept]]


def _kept(evals: Tensor, evecs: Tensor, tolerance: float) -> tuple[Tensor, Tensor]:
    """Eigenpairs above the tolerance, descending."""
    keep = evals > tolerance
    return evals[keep].flip(0), evecs[:, keep].flip(1)


def _part(gram: Tensor, basis: Tensor, tolerance: float) -> SpectrumPart:
    """The part ``V A Aᵀ Vᵀ``: spectrum of ``Aᵀ G̃ A``, coefficients ``A s / √μ``."""
    small = basis.T @ gram @ basis
    evals, evecs = _kept(*gram_eigh((small + small.T) / 2), tolerance)
    return SpectrumPart(evals, basis @ evecs / evals.sqrt())
