"""Make the studies package in ``exp/`` importable; fixtures of the study tests."""

import sys
from pathlib import Path

import pytest

from tests.fixtures.optional_packages import installed

EXP = Path(__file__).resolve().parents[2] / "exp"
if str(EXP) not in sys.path:
    sys.path.insert(0, str(EXP))

installed("matplotlib")  # the studies' extra, and the test extra
installed("sklearn")

from tests.studies.study_helpers import FACTORIES, Runner  # noqa: E402


@pytest.fixture
def run(capsys):
    """Run a study: ``status, out, err = run(study, output_dir, *options)``."""
    return Runner(capsys)


@pytest.fixture
def factories():
    """Path of the test model factories, for ``--model PATH:FACTORY``."""
    return FACTORIES
