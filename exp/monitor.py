"""Monitor study: the GGN's curvature every k steps of SGD, and its overhead.

Run from the repository root: ``python exp/monitor.py`` (``--help`` for options);
``python exp/monitor.py --plot FILE`` draws a monitor's JSON lines file.
The code lives in ``exp/studies/monitor.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from studies.monitor import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
