"""``python -m benches``: see :mod:`benches.front`."""

from __future__ import annotations

import sys

from benches.front import main

if __name__ == "__main__":  # not when multiprocessing re-imports this module as __mp_main__
    sys.exit(main())
