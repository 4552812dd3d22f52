"""Exceptions raised for input the library cannot work with.

Each says what is wrong and what to do about it.
"""

from __future__ import annotations


class UnsupportedLayerError(NotImplementedError):
    """A layer the engine cannot backpropagate the GGN square root through."""


class BatchNormTrainingError(ValueError):
    """A BatchNorm layer in training mode: its output couples the samples."""


class GramTooLargeError(MemoryError):
    """The Gram matrix of the requested setting would not fit into memory."""


class ResultNotReadyError(RuntimeError, KeyError):
    """A result was requested before the backward pass that computes it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvalidSubsamplingError(ValueError):
    """Sample indices that are repeated or outside the mini-batch."""


class ParamGroupError(ValueError):
    """Parameter groups that are malformed or overlap."""


class SharedWeightError(UnsupportedLayerError):
    """A weight used more than once in one forward pass, which an engine cannot sum."""
