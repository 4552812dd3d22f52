"""Tests of directional derivatives and Newton steps along GGN eigenvectors."""
