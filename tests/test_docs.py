"""The documentation builds without warnings (``sphinx-build -W``)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None,
    reason="sphinx is not installed (pip install -e '.[docs]')",
)
def test_docs_build_without_warnings(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         str(DOCS), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("index", "guide", "studies", "migration", "architecture", "api"):
        assert (tmp_path / "html" / f"{page}.html").is_file()
    api = (tmp_path / "html" / "api.html").read_text()
    for name in (
        "LowRankGGN",
        "EighComputation",
        "DampedNewton",
        "BootstrapDamping",
        "DirectionalDerivatives",
        "NewtonStep",
        "UnsupportedLayerError",
    ):
        assert name in api
    # every method a front door answers is documented on it, and only those
    for documented in (
        "vivit.options.CurvatureOptions",
        "vivit.results.CurvatureResults",
        "vivit.LowRankGGN.from_options",
        "vivit.LowRankGGN.gram",
        "vivit.LowRankGGN.eigh",
        "vivit.StreamingGGN.eigh",
        "vivit.StreamingGGN.operator",
    ):
        assert f'id="{documented}"' in api, documented
    for refused in ("gram", "eigvalsh", "zero_tolerance"):
        assert f'id="vivit.StreamingGGN.{refused}"' not in api, refused
