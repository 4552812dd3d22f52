"""Tests of curvature sources: chunks of samples and data loaders."""
