"""Tests of the BackPACK and func engines and the layers they support."""
