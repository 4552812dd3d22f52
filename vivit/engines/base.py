"""What every engine hands to the computations: factors and their batch context."""

from __future__ import annotations

from dataclasses import dataclass

from vivit.gram import ParamFactors


@dataclass(frozen=True)
class BatchInfo:
    """How the mini-batch and the loss define the scaling of ``V``.

    Attributes:
        reduction: The loss function's reduction, ``"mean"`` or ``"sum"``.
        batch_size: Number of samples ``N`` in the mini-batch.
        ggn_samples: Samples whose columns ``V`` holds (all, or the subsampling).
        columns_per_sample: ``C`` (exact) or ``M`` (Monte-Carlo samples).
        mc_samples: ``0`` for the exact loss Hessian, else ``M``.
    """

    reduction: str
    batch_size: int
    ggn_samples: tuple[int, ...]
    columns_per_sample: int
    mc_samples: int

    def reduction_factor(self, num_samples: int) -> float:
        """``R`` of the loss restricted to ``num_samples`` samples.

        Args:
            num_samples: Number of samples the loss is evaluated on.

        Returns:
            ``1 / num_samples`` for mean reduction, ``1`` for sum reduction.
        """
        return 1.0 / num_samples if self.reduction == "mean" else 1.0

    @property
    def per_sample_gradient_scale(self) -> float:
        """``1/R`` of the whole batch: turns ``∂L/∂z_n`` into ``∂ℓ_n/∂z_n``."""
        return 1.0 / self.reduction_factor(self.batch_size)

    @property
    def ggn_reduction_factor(self) -> float:
        """``R`` of the GGN's samples (``1/|S|`` or ``1``)."""
        return self.reduction_factor(len(self.ggn_samples))


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
