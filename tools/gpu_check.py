"""Exercise every GPU path and print figures (run on a CUDA machine; on a CPU-only
machine it prints the CPU figures and says which GPU checks it skipped).

    python tools/gpu_check.py [--images 1024] [--steps 40]

Figures: batched nvjpeg img/s vs one-image-per-call nvjpeg vs CPU decode on the
same bytes; H2D GB/s pinned vs pageable; step time of a fixed model with the
prefetcher vs data already on the GPU vs a plain loop.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=128)
    a = ap.parse_args()

    import simplejpeg

    from packio.bench.synth import photo

    from packio import decode as cpu
    from packio.cuda import GPUTransform, Prefetcher, decode_batch

    rng = np.random.default_rng(0)
    base = [photo(int(rng.integers(400, 501)), int(rng.integers(450, 601)), rng) for _ in range(64)]
    blobs = [simplejpeg.encode_jpeg(base[i % 64], 90, colorsubsampling="420") for i in range(a.images)]
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}; "
          f"{a.images} JPEGs, mean {np.mean([len(b) for b in blobs]) / 1e3:.0f} KB, ~500 px")
    t = timed(lambda: [cpu.decode(b) for b in blobs], repeat=1)
    cpu_rate = a.images / t
    print(f"CPU decode (simplejpeg, 1 thread):            {cpu_rate:8.0f} img/s")
    if not torch.cuda.is_available():
        print("no CUDA: skipped nvjpeg decode, H2D copies, prefetcher step times")
        return 0
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(0)}")
    try:
        decode_batch(blobs[:8], device=dev)
        for bs in (64, 128, 256):
            t = timed(lambda: [decode_batch(blobs[i:i + bs], device=dev) for i in range(0, a.images, bs)])
            print(f"nvjpeg batched decode, batch {bs:3d}:           {a.images / t:8.0f} img/s "
                  f"({a.images / t / cpu_rate:.1f}x one CPU thread)")
        from torchvision.io import decode_jpeg

        tens = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs[:256]]
        t = timed(lambda: [decode_jpeg(x, device="cuda") for x in tens])
        print(f"nvjpeg one image per call (the trap):        {256 / t:8.0f} img/s")
    except Exception as exc:  # report and go on to the other checks
        print(f"nvjpeg decode unavailable: {exc}")

    x = torch.randint(0, 255, (a.batch, 3, 224, 224), dtype=torch.uint8)
    xp = x.pin_memory()
    gb = x.numel() / 1e9
    t_page = timed(lambda: [x.to(dev) for _ in range(20)]) / 20
    t_pin = timed(lambda: [xp.to(dev, non_blocking=True) for _ in range(20)]) / 20
    print(f"H2D uint8 batch {tuple(x.shape)}: pageable {gb / t_page:6.1f} GB/s, pinned {gb / t_pin:6.1f} GB/s")

    try:
        from torchvision.models import resnet18

        model, mname = resnet18(num_classes=10), "resnet18"
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from train_classifier import small_cnn

        model, mname = small_cnn(10), "small cnn"
    model = model.to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    import packio

    tmp = Path(tempfile.mkdtemp())
    folder = tmp / "imgs"
    for i in range(a.batch * 4):
        d = folder / f"c{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:05d}.jpg").write_bytes(blobs[i % len(blobs)])
    packio.convert(folder, tmp / "d.arrays", resize=packio.ResizeSpec(size=(224, 224)), workers=8, progress=False)
    ds = packio.open_dataset(tmp / "d.arrays")
    loader = packio.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=4, drop_last=True,
                               pin_memory=True, persistent_workers=True)
    tf = GPUTransform(size=(224, 224), train=False, channels_last=True)

    def epochs(feed_fn):
        n = 0
        while n < a.steps:
            for batch in feed_fn():
                step(batch["image"], batch["label"])
                n += 1
                if n >= a.steps:
                    break

    on_gpu = tf({"image": torch.randint(0, 255, (a.batch, 3, 224, 224), dtype=torch.uint8, device=dev),
                 "label": torch.randint(0, 10, (a.batch,), device=dev)})

    def resident():
        for _ in range(a.steps):
            step(on_gpu["image"], on_gpu["label"])

    def plain():
        for batch in loader:
            images = batch["image"].to(dev)  # synchronous copy, then transform
            yield tf({"image": images, "label": batch["label"].to(dev)})

    epochs(lambda: Prefetcher(loader, device=dev, transform=tf))  # warm workers and cudnn
    t_res = timed(resident, repeat=2) / a.steps
    t_pre = timed(lambda: epochs(lambda: Prefetcher(loader, device=dev, transform=tf)), repeat=2) / a.steps
    t_plain = timed(lambda: epochs(plain), repeat=2) / a.steps
    print(f"step time ({mname}, batch {a.batch}, bf16 autocast, channels_last):")
    print(f"  data already on GPU:   {t_res * 1e3:7.2f} ms")
    print(f"  packio prefetcher:     {t_pre * 1e3:7.2f} ms  ({t_pre / t_res:.3f}x resident; target <= 1.05x)")
    print(f"  plain loop:            {t_plain * 1e3:7.2f} ms  ({t_plain / t_res:.3f}x resident)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
