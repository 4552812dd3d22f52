"""vivit: exact, cheap curvature of neural networks from the GGN's low-rank structure.

Front doors:

- :class:`LowRankGGN`: one call outside a training loop (a mini-batch or a
  data loader).
- :class:`StreamingGGN`: leading eigenpairs over a data loader whose layer
  factors do not fit into memory.
- :class:`EigvalshComputation`, :class:`EighComputation`,
  :class:`DirectionalDerivativesComputation`,
  :class:`DirectionalDampedNewtonComputation`: the ViViT-compatible BackPACK
  extension + hook API for use inside a training loop.
"""

from vivit.compat import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
)
from vivit.directional.results import DirectionalDerivatives
from vivit.errors import (
    BatchNormTrainingError,
    DistributedError,
    FactorsTooLargeError,
    FewerEigenpairsWarning,
    GradientContextError,
    GramTooLargeError,
    GroupIndexError,
    InvalidArgumentError,
    InvalidSubsamplingError,
    InvalidTargetsError,
    MissingPackageError,
    MissingPackageWarning,
    ModelChangedError,
    NoCurvatureError,
    NondeterministicDataError,
    NonFiniteError,
    ParamGroupError,
    ProductsTooLargeError,
    RandomForwardWarning,
    ResultNotReadyError,
    RoundingFloorWarning,
    SampleCouplingError,
    SharedWeightError,
    SolverNotConvergedError,
    UnboundedStepWarning,
    UnsupportedDtypeError,
    UnsupportedLayerError,
    UnsupportedLossError,
    VivitError,
    ZeroStepWarning,
)
from vivit.lowrank import LowRankGGN
from vivit.streaming import StreamingGGN

__all__ = [
    "BatchNormTrainingError",
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivatives",
    "DirectionalDerivativesComputation",
    "DistributedError",
    "EighComputation",
    "EigvalshComputation",
    "FactorsTooLargeError",
    "ProductsTooLargeError",
    "FewerEigenpairsWarning",
    "GradientContextError",
    "GramTooLargeError",
    "GroupIndexError",
    "InvalidArgumentError",
    "InvalidSubsamplingError",
    "InvalidTargetsError",
    "LowRankGGN",
    "MissingPackageError",
    "MissingPackageWarning",
    "ModelChangedError",
    "NoCurvatureError",
    "NondeterministicDataError",
    "NonFiniteError",
    "ParamGroupError",
    "RandomForwardWarning",
    "ResultNotReadyError",
    "RoundingFloorWarning",
    "SolverNotConvergedError",
    "StreamingGGN",
    "UnboundedStepWarning",
    "UnsupportedDtypeError",
    "SampleCouplingError",
    "SharedWeightError",
    "UnsupportedLayerError",
    "UnsupportedLossError",
    "VivitError",
    "ZeroStepWarning",
]
