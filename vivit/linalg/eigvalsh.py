"""ViViT 1.0's import path; the class lives in vivit.compat.eigvalsh."""

from vivit.compat.eigvalsh import EigvalshComputation

__all__ = ["EigvalshComputation"]
