"""`make demo`: pack raccoon (or a generated photo set) into LMDB, read it back, print samples/s."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packio

import packio  # noqa: E402
from packio.bench.synth import make_photo_folder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "demo-out"), help="where to write the packed dataset")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    ap.add_argument("--epochs", type=int, default=3)
    a = ap.parse_args()

    raccoon = ROOT.parent / "shared" / "data" / "raccoon"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if raccoon.is_dir():
        src, csv = raccoon / "images", raccoon / "data" / "raccoon_labels.csv"
        print(f"source: {src} + {csv}")
    else:
        src, csv = make_photo_folder(Path(tempfile.mkdtemp()) / "photos", count=200, with_csv=True)
        print(f"source: {src} (generated: ../shared/data/raccoon is absent)")
    dst = out / "demo.lmdb"
    summary = packio.convert(src, dst, csv=csv, overwrite=True)  # workers="auto": measured per file
    print(summary.text())

    ds = packio.LMDBDataset(dst, resize=224)
    first = ds[0]
    print(f"sample 0: key={first['key']} image={tuple(first['image'].shape)} {first['image'].dtype} "
          f"label={first['label']} boxes={first['boxes'].tolist()}")
    batch_size = 32
    loader = packio.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=a.workers,
                               persistent_workers=a.workers > 0)
    for epoch in range(a.epochs):
        t0, boxes, sizes = time.perf_counter(), 0, []
        for batch in loader:
            sizes.append(len(batch["label"]))
            boxes += sum(len(b) for b in batch["boxes"])
        n = sum(sizes)
        dt = time.perf_counter() - t0
        last = f", the last one {sizes[-1]}" if sizes and sizes[-1] != batch_size else ""
        print(f"epoch {epoch}: {n} samples, {boxes} boxes in {len(sizes)} batches of {batch_size}{last} "
              f"(images {tuple(batch['image'].shape[1:])} each): {n / dt:.0f} samples/s (decode + resize 224, "
              f"{a.workers} DataLoader workers{', includes their start' if epoch == 0 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
