"""GPU batched JPEG decode, backends and nvImageCodec's hardware-decoder share compared
in alternating rounds (so clock warm-up and order do not favour one), on the same
ImageNet-like JPEGs as ``gpu_check.py``.

    python tools/bench_gpu_decode.py [--images 2048] [--batch 256] [--rounds 4]

Prints the median img/s of each setting over the rounds and its ratio to the best.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import imagenet_like, timed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: nothing to measure", file=sys.stderr)
        return 2
    from packio.cuda import BatchDecoder, GPUTransform
    from packio.cuda.backends import NvImageCodecBackend, available

    dev = torch.device("cuda", 0)
    blobs = imagenet_like(a.images)
    chunks = [blobs[i:i + a.batch] for i in range(0, len(blobs), a.batch)]
    settings: dict[str, BatchDecoder] = {}
    if available("nvimgcodec"):
        for load in (0.0, 0.5, 0.9, 1.0):
            settings[f"nvimgcodec hw_load={load}"] = BatchDecoder(dev, NvImageCodecBackend(hw_load=load))
    if available("torchvision"):
        settings["torchvision"] = BatchDecoder(dev, "torchvision")
    tf = GPUTransform(size=(224, 224), train=False, channels_last=True, dtype=torch.bfloat16)
    rates: dict[str, list[float]] = {k: [] for k in settings}
    piped: dict[str, list[float]] = {k: [] for k in settings}
    for r in range(a.rounds):
        names = list(settings) if r % 2 == 0 else list(reversed(settings))
        for name in names:
            dec = settings[name]
            rates[name].append(len(blobs) / timed(lambda: [dec(c) for c in chunks], rounds=3, warmup=1, sync=True))
            piped[name].append(len(blobs) / timed(lambda: [tf({"image": dec(c)}) for c in chunks], rounds=3,
                                                  warmup=1, sync=True))
    print(f"{torch.cuda.get_device_name(dev)}; {len(blobs)} JPEGs ~500x375 q90, batch {a.batch}, "
          f"median of {a.rounds} alternating rounds (each the median of 3 timed passes)")
    best = max(statistics.median(v) for v in rates.values())
    best_p = max(statistics.median(v) for v in piped.values())
    for name in settings:
        m, p = statistics.median(rates[name]), statistics.median(piped[name])
        print(f"  {name:26s} decode {m:8.0f} img/s ({m / best:.2f}x best)   "
              f"+resize224+normalise {p:8.0f} img/s ({p / best_p:.2f}x best)   "
              f"rounds: {', '.join(f'{x:.0f}' for x in rates[name])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
