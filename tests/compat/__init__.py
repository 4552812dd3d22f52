"""Tests of the ViViT-compatible computation classes."""
