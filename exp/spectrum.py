"""Spectrum study: exact GGN eigenvalues of a mini-batch against cheap approximations.

Run from the repository root: ``python exp/spectrum.py`` (``--help`` for options).
The code lives in ``exp/studies/spectrum.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from studies.spectrum import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
