"""ViViT 1.0's import path; the class lives in vivit.compat.eigh."""

from vivit.compat.eigh import EighComputation

__all__ = ["EighComputation"]
