"""Byte counts in refusals: the largest binary unit that keeps the number ≥ 1."""

import pytest

from vivit.gram.memory import format_bytes


@pytest.mark.parametrize(
    "count, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (3.5 * 2**20, "3.5 MiB"),
        (2**30 - 2**20, "1023.0 MiB"),
        (22.3 * 2**30, "22.3 GiB"),
        (2**41, "2.0 TiB"),
    ],
)
def test_format_bytes(count, text):
    """A small budget reads in MiB, not as '0.0 GiB'."""
    assert format_bytes(count) == text
