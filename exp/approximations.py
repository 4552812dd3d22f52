"""Approximation study: which approximation recovers the GGN's top-k and Newton step.

Run from the repository root: ``python exp/approximations.py`` (``--help`` for options).
The code lives in ``exp/studies/approximations.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from studies.approximations import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
