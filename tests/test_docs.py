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


def _guide_block(marker: str) -> str:
    """The guide's ``code-block`` that contains ``marker``, dedented."""
    blocks = (DOCS / "guide.rst").read_text().split(".. code-block:: python\n")
    (block,) = [b for b in blocks[1:] if marker in b.split("\n\n\n")[0]]
    lines = []
    for line in block.splitlines()[1:]:
        if line and not line.startswith("   "):
            break
        lines.append(line[3:])
    return "\n".join(lines)


def test_guide_operator_example_runs():
    """The guide's scipy example is complete and converges within its ``maxiter``."""
    code = _guide_block("op.to_scipy()")
    assert "maxiter" in code and "delta" in code
    exec(compile(code, "guide.rst", "exec"), {})
