"""Tests of the memory estimates, the batch search and the refusals."""
