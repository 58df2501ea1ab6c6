import sys

from packio.bench.runner import main

sys.exit(main())
