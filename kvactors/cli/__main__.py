"""``python -m kvactors.cli``: the ``kvactors`` command."""

from __future__ import annotations

import sys

from kvactors.cli import main

if __name__ == "__main__":
    sys.exit(main())
