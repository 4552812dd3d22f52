"""Make the studies package in ``exp/`` importable; fixtures of the study tests."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1] / "exp", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

pytest.importorskip("matplotlib", reason="the studies need matplotlib (study extra)")
pytest.importorskip("sklearn", reason="the studies need scikit-learn (study extra)")

from study_helpers import FACTORIES, Runner  # noqa: E402


@pytest.fixture
def run(capsys):
    """Run a study: ``status, out, err = run(study, output_dir, *options)``."""
    return Runner(capsys)


@pytest.fixture
def factories():
    """Path of the test model factories, for ``--model PATH:FACTORY``."""
    return FACTORIES
