"""Pack one dataset into every format and compare readers, limits and a naive baseline.

    python tools/bench_formats.py                      # 5,000 generated JPEGs
    python tools/bench_formats.py --src ../shared/data/hymenoptera/hymenoptera_data
    python tools/bench_formats.py --tune bench-out/synth-5000-lmdb.lmdb

Same as `packio bench`; see packio/bench.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packio.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
