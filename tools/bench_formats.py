"""Format benchmark: the same as ``packio bench`` / ``python -m packio.bench`` (see ``--help``)."""

import sys

from packio.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
