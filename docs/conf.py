"""Sphinx configuration of the vivit documentation.

Build: ``sphinx-build -W -b html docs docs/_build/html`` (``-W``: warnings fail).
"""

import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document the working tree, installed or not

project = "vivit"
author = "the vivit developers"
copyright = "the vivit developers"
try:
    release = metadata.version("vivit")
except metadata.PackageNotFoundError:
    release = "unknown"
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.mathjax",
]

# Google-style docstrings only; attributes as fields, so that dataclass fields are
# not described twice.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
autoclass_content = "class"

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
html_theme_options = {
    "description": "Exact, cheap curvature from the GGN's low-rank structure",
    "fixed_sidebar": True,
}
