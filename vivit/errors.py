"""Exceptions for input the library cannot work with, and its warnings.

Each derives from :class:`VivitError` and the built-in one a caller would expect
(e.g. ``ValueError``): ``except vivit.VivitError`` catches misuse, not bugs.
"""

from __future__ import annotations


class VivitError(Exception):
    """Base class of every exception the library raises on purpose."""


class InvalidArgumentError(VivitError, ValueError, TypeError):
    """An argument of the wrong type or value (says what was given and expected)."""


class UnsupportedLayerError(VivitError, NotImplementedError):
    """A layer the engine cannot backpropagate the GGN square root through."""


class UnsupportedLossError(VivitError, ValueError):
    """A loss function, or an option of it, whose GGN the library does not compute."""


class InvalidTargetsError(VivitError, ValueError):
    """Targets whose shape, type or values the loss function cannot work with."""


class NonFiniteError(VivitError, FloatingPointError):
    """A NaN or infinite value, named where it entered (tensor, sample, parameter)."""


class UnsupportedDtypeError(VivitError, TypeError):
    """A floating-point type the computations do not support (16-bit types)."""


class GradientContextError(VivitError, RuntimeError):
    """A context in which the library cannot run its backward pass."""


class BatchNormTrainingError(VivitError, ValueError):
    """A BatchNorm layer using batch statistics (training mode, or no running stats)."""


class GramTooLargeError(VivitError, MemoryError):
    """The Gram matrix of the requested setting would not fit into memory."""


class FactorsTooLargeError(VivitError, MemoryError):
    """The layer factors of a data loader's batches would not fit into memory."""


class ProductsTooLargeError(VivitError, MemoryError):
    """The implicit route's GGN-vector products and Krylov basis would not fit."""


class ModelTooLargeError(VivitError, MemoryError):
    """An FSDP2 model would not fit gathered whole on a rank."""


class NondeterministicDataError(VivitError, RuntimeError):
    """A data loader yielded different batches in two passes over it."""


class ModelChangedError(VivitError, RuntimeError):
    """The model's parameters or buffers changed between two passes over the data."""


class ResultNotReadyError(VivitError, RuntimeError, KeyError):
    """A result was requested before the backward pass that computes it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NoCurvatureError(VivitError, RuntimeError):
    """Parameters without curvature from the backward pass (not extended or used)."""


class GroupIndexError(VivitError, IndexError):
    """A parameter-group index outside the groups of a result."""


class InvalidSubsamplingError(VivitError, ValueError):
    """Sample indices that are repeated or outside the mini-batch."""


class ParamGroupError(VivitError, ValueError):
    """Parameter groups that are malformed or overlap."""


class SolverNotConvergedError(VivitError, RuntimeError):
    """An iterative eigensolver did not reach the requested residual."""


class ZeroStepWarning(UserWarning):
    """A Newton step is zero because no direction contributes to it."""


class UnboundedStepWarning(UserWarning):
    """A Newton step whose quadratic model promises more than the loss itself."""


class RandomForwardWarning(UserWarning):
    """The forward pass draws random numbers (e.g. Dropout in training mode)."""


class FewerEigenpairsWarning(UserWarning):
    """Fewer numerically non-zero eigenpairs exist than ``top_k`` asked for."""


class RoundingFloorWarning(UserWarning):
    """An iterative eigensolver's tolerance was raised to its products' rounding.

    See ``docs/math.rst``, "Precision and the numerical zero" (rounding floor).
    """


class SampleCouplingError(VivitError, ValueError):
    """A model whose output for one sample depends on other samples or on chance."""


class SharedWeightError(UnsupportedLayerError):
    """A weight used more than once in one forward pass, which an engine cannot sum."""


class DistributedError(VivitError, RuntimeError):
    """Another rank of a process group failed, or the ranks' requests differ."""


class MissingPackageError(VivitError, ImportError):
    """An optional package a feature needs is not installed (named, with pip's line)."""


class MissingPackageWarning(UserWarning):
    """An optional output whose package is not installed: it is skipped."""
