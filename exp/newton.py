"""Newton study: DampedNewton against SGD and Adam from one initialisation.

Run from the repository root: ``python exp/newton.py`` (``--help`` for options).
The code lives in ``exp/studies/newton.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from studies.newton import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
