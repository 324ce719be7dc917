"""``python -m fedcomp.deploy``: the command-line entry of :mod:`fedcomp.net.deploy`."""

import sys

from fedcomp.net.deploy import main

if __name__ == "__main__":
    sys.exit(main())
