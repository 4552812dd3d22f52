"""Tests of vivit, in folders that mirror the package's."""
