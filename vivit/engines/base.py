"""What every engine hands to the computations: factors and their batch context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vivit.gram import ParamFactors
from vivit.losses import LossNormalization


@dataclass(frozen=True)
class BatchInfo:
    """How the mini-batch and the loss define the scaling of ``V``.

    Attributes:
        normalization: The loss's reduction and per-sample weights; gives ``R``
            of the loss on any set of samples (:mod:`vivit.losses`).
        ggn_samples: Samples whose columns ``V`` holds (all, or the subsampling).
        columns_per_sample: ``C`` (exact) or ``M`` (Monte-Carlo samples).
        mc_samples: ``0`` for the exact loss Hessian, else ``M``.
    """

    normalization: LossNormalization
    ggn_samples: tuple[int, ...]
    columns_per_sample: int
    mc_samples: int

    @property
    def reduction(self) -> str:
        """The loss function's reduction, ``"mean"`` or ``"sum"``."""
        return self.normalization.reduction

    @property
    def batch_size(self) -> int:
        """Number of samples ``N`` in the mini-batch."""
        return self.normalization.batch_size

    def reduction_factor(self, samples: Sequence[int] | None = None) -> float:
        """``R`` of the loss evaluated on ``samples`` alone.

        Args:
            samples: Sample indices in the mini-batch; ``None`` for all.

        Returns:
            ``R`` (see :meth:`vivit.losses.LossNormalization.reduction_factor`).
        """
        return self.normalization.reduction_factor(samples)

    @property
    def per_sample_gradient_scale(self) -> float:
        """``1/R`` of the whole batch: turns ``∂L/∂z_n`` into ``∂ℓ_n/∂z_n``."""
        return 1.0 / self.reduction_factor()

    @property
    def ggn_reduction_factor(self) -> float:
        """``R`` of the GGN's samples (the loss on them alone)."""
        return self.reduction_factor(self.ggn_samples)


@dataclass
class ParamContribution:
    """One parameter's share of a backward pass.

    Attributes:
        ggn: The parameter's columns of ``V`` (the GGN's samples).
        grad: Per-sample gradients ``∇ℓ_n`` of every sample in the mini-batch, as
            factors with one column per sample; ``None`` unless requested.
        batch: Scaling context.
    """

    ggn: ParamFactors
    grad: ParamFactors | None
    batch: BatchInfo
