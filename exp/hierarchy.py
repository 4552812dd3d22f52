"""Hierarchy study: Papyan's class / cross-class / within-class parts of the GGN.

Run from the repository root: ``python exp/hierarchy.py`` (``--help`` for options).
The code lives in ``exp/studies/hierarchy.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from studies.hierarchy import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
