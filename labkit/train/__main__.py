"""``python -m labkit.train``: see :mod:`labkit.train.loop`."""

import sys

from labkit.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
