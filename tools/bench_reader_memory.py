"""Peak memory (PSS summed over the process tree) of one epoch through packio's HDF5 reader
versus a plain h5py reader of the same file, each in a fresh process:

    python tools/bench_reader_memory.py [--path DATA.h5] [--workers 0,2] [--n 3000]

packio: ``packio.open_dataset(path, resize=224)`` + ``packio.DataLoader(batch_size=64)``.
plain: a torch Dataset over ``h5py.File(path)["images_bytes"]`` / ``["offsets"]`` (the
layout packio writes), the same decode + resize per sample, torch's default collate.
Without ``--path`` a synthetic ImageNet-like folder of ``--n`` JPEGs is packed first.
Prints each peak and packio / plain (the target is <= 1.2).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

BATCH, SIZE = 64, 224


def child(kind: str, path: str, workers: int) -> None:
    import torch

    if kind == "packio":
        import packio

        loader = packio.DataLoader(packio.open_dataset(path, resize=SIZE), batch_size=BATCH, num_workers=workers)
    else:
        import h5py

        from packio import decode as dec

        class Plain(torch.utils.data.Dataset):
            def __init__(self) -> None:
                self.f = None
                with h5py.File(path, "r") as f:
                    self.off = f["offsets"][:]

            def __len__(self) -> int:
                return len(self.off) - 1

            def __getitem__(self, i: int) -> torch.Tensor:
                if self.f is None:
                    self.f = h5py.File(path, "r")
                data = self.f["images_bytes"][self.off[i]:self.off[i + 1]].tobytes()
                img = dec.resize(dec.decode(data, min_size=(SIZE, SIZE)), (SIZE, SIZE))
                return torch.from_numpy(img).permute(2, 0, 1)

        loader = torch.utils.data.DataLoader(Plain(), batch_size=BATCH, num_workers=workers)
    n = 0
    for b in loader:  # consumed as the peers harness does: boxes padded to one [B, 8, 4] tensor
        if isinstance(b, dict):
            boxes = torch.full((len(b["boxes"]), 8, 4), -1.0)
            for j, x in enumerate(b["boxes"]):
                boxes[j, :min(len(x), 8)] = x[:8]
            b = b["image"]
        n += len(b)
    print(n)


def measure(kind: str, path: str, workers: int) -> tuple[float, str]:
    from packio.bench.probe import Probe, wait_and_probe

    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, "--path", path, "--workers", str(workers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    probe = Probe(proc.pid, str(Path(path).parent), sample_fds=False)
    out, err = wait_and_probe(proc, probe, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{kind} failed: {err[-2000:]}")
    return probe.peak_mb, probe.memory_kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", help="a packio HDF5 file of encoded images (default: a generated one)")
    ap.add_argument("--n", type=int, default=3000, help="images to generate without --path")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.path, int(a.workers))
        return 0
    tmp = None
    if a.path is None:
        import packio
        from packio.bench.synth import make_photo_folder

        tmp = tempfile.TemporaryDirectory(prefix="packio-mem-")
        src, csv = make_photo_folder(Path(tmp.name) / "src", a.n, size=(375, 500))
        a.path = str(Path(tmp.name) / "d.h5")
        packio.convert(src, a.path, csv=csv, progress=False)
    size = Path(a.path).stat().st_size / 2**20
    print(f"{a.path}: {size:.0f} MiB; peak memory of the process tree over one epoch (batch {BATCH}, resize {SIZE})")
    for w in (int(x) for x in a.workers.split(",")):
        packio_mb, kind = measure("packio", a.path, w)
        plain_mb, _ = measure("plain", a.path, w)
        print(f"nw={w}: packio {packio_mb:6.0f} MiB  plain h5py {plain_mb:6.0f} MiB  ({kind})  "
              f"packio/plain {packio_mb / plain_mb:.2f} (target <= 1.2)", flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
