"""Tests of the studies in exp/."""
