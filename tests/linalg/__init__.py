"""Tests of the Gram eigensolvers, the GGN operator and the Gram precision."""
