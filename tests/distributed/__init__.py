"""Tests of several processes: gloo groups spawned on CPU."""
