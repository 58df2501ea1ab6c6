import sys

from packio.cli import main

sys.exit(main())
