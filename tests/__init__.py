"""Tests of vivit, in folders that mirror the package's.

A package ``vivit/<p>/`` is tested in ``tests/<p>/``; a module ``vivit/<m>.py`` in
``tests/test_<m>.py``, or in ``tests/<m>/`` when several files test it. Bad input at
every front door is tested in ``tests/misuse/``; ``tests/fixtures/`` holds the helpers.
"""
