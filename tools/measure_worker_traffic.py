"""Bytes sent to the local worker pool when converting a packed dataset.

    python tools/measure_worker_traffic.py [--samples 16000] [--workers 2]

Packs N tiny JPEGs into tar shards, converts them to LMDB with ``--workers``, and
counts the bytes the parent writes into the pool's task pipes. Also prints what
the old scheme (the reader pickled with every chunk of 8 tasks) would send: the
pickled size of the task function times the number of chunks.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from multiprocessing import connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import packio  # noqa: E402
from packio import converter  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16000)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    import simplejpeg
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "imgs" / "c"
        root.mkdir(parents=True)
        tiny = simplejpeg.encode_jpeg(np.full((8, 8, 3), 128, np.uint8))
        for k in range(a.samples):
            (root / f"{k:06d}.jpg").write_bytes(tiny)
        packio.convert(root.parent, Path(tmp) / "src.wds", progress=False)
        reader = packio.open_reader(Path(tmp) / "src.wds")
        fn_bytes = len(pickle.dumps(converter._Prep("encoded", packio.ResizeSpec(), 90, 1, reader)))
        sent: list[int] = []
        real = connection.Connection._send_bytes

        def counting(self, buf):  # type: ignore[no-untyped-def]
            sent.append(len(buf))
            return real(self, buf)

        connection.Connection._send_bytes = counting  # type: ignore[method-assign]
        t0 = time.perf_counter()
        s = packio.convert(Path(tmp) / "src.wds", Path(tmp) / "out.lmdb", workers=a.workers, progress=False)
        seconds = time.perf_counter() - t0
        connection.Connection._send_bytes = real  # type: ignore[method-assign]
    chunks = -(-a.samples // 8)
    print(f"samples {s.packed}, workers {a.workers}, {seconds:.1f} s")
    print(f"sent to the pool now:            {sum(sent):>14,d} bytes ({sum(sent) / a.samples:.1f} per sample)")
    print(f"reader pickled once per worker:  {fn_bytes:>14,d} bytes")
    print(f"old scheme (reader per chunk):   {fn_bytes * chunks:>14,d} bytes ({chunks} chunks)")
    print(f"ratio old / now:                 {fn_bytes * chunks / max(1, sum(sent)):>14,.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
