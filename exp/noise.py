"""Noise study: top GGN eigenvalues and directional-derivative noise during SGD.

Run from the repository root: ``python exp/noise.py`` (``--help`` for options).
The code lives in ``exp/studies/noise.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from studies.noise import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
