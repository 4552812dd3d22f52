"""Tests of the front door ``LowRankGGN`` (``vivit/lowrank.py``)."""
