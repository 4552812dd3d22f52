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

from vivit.directional.results import DirectionalDerivatives
from vivit.errors import (
    BatchNormTrainingError,
    DistributedError,
    FactorsTooLargeError,
    GradientContextError,
    GramTooLargeError,
    GroupIndexError,
    InvalidArgumentError,
    InvalidSubsamplingError,
    InvalidTargetsError,
    ModelChangedError,
    NoCurvatureError,
    NondeterministicDataError,
    NonFiniteError,
    ParamGroupError,
    RandomForwardWarning,
    ResultNotReadyError,
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
from vivit.linalg.eigh import EighComputation
from vivit.linalg.eigvalsh import EigvalshComputation
from vivit.lowrank import LowRankGGN
from vivit.optim.directional_damped_newton import DirectionalDampedNewtonComputation
from vivit.optim.directional_derivatives import DirectionalDerivativesComputation
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
    "GradientContextError",
    "GramTooLargeError",
    "GroupIndexError",
    "InvalidArgumentError",
    "InvalidSubsamplingError",
    "InvalidTargetsError",
    "LowRankGGN",
    "ModelChangedError",
    "NoCurvatureError",
    "NondeterministicDataError",
    "NonFiniteError",
    "ParamGroupError",
    "RandomForwardWarning",
    "ResultNotReadyError",
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
