"""Tests of the DampedNewton optimizer, its dampings and its guards."""
