"""``python -m fedcomp run ...`` / ``python -m fedcomp plot ...`` (see :mod:`fedcomp.cli`)."""

import sys

from fedcomp.cli import main

if __name__ == "__main__":
    sys.exit(main())
