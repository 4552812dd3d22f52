"""Tests of the Gram algebra."""
