"""Measure every GPU path of packio.cuda and check it against the targets.

    python tools/gpu.py                 # on a CUDA machine (fails without CUDA or a GPU decode backend)
    python tools/gpu.py --allow-cpu     # run the CPU-runnable parts here; GPU figures "not measured"
    python tools/gpu.py --sweep         # only: decode backends and nvImageCodec's hardware share, alternating rounds

Installs nothing (``make gpu-check`` installs the ``gpu`` extra first). Prints:
batched decode img/s per GPU backend and for the CPU decoder (all cores, warmed
up) on ImageNet-sized JPEGs (~500x375, q90, 4:2:0); decode + resize 224 +
normalise img/s; H2D GB/s pinned vs pageable; ResNet-50 bf16-autocast training
step time fed by the Prefetcher vs the same batches already resident on the GPU,
both through the same GPUTransform, over one long epoch (no restarts). Then the
targets table. Every GPU figure is a median of CUDA-synchronised rounds after
warm-up rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved, median, table  # noqa: E402

TARGETS = (("batched decode (best backend)", ">= 10,000 img/s"),
           ("decode + resize 224 + normalise", ">= 8,000 img/s"),
           ("prefetcher step / resident step", "<= 1.05x"))


def timed(fn: Callable[[], object], rounds: int = 5, warmup: int = 1, sync: bool = False) -> float:
    """Median seconds of ``rounds`` calls after ``warmup`` calls (CUDA-synchronised when ``sync``)."""
    times = []
    for k in range(warmup + rounds):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def imagenet_like(n: int, seed: int = 0) -> list[bytes]:
    """``n`` JPEGs like ImageNet's: 500 px long side, 4:3 and 3:4 (some 3:2), q90, 4:2:0."""
    import simplejpeg

    from packio.bench.synth import photo

    rng = np.random.default_rng(seed)
    shapes = [(375, 500), (500, 375), (333, 500), (375, 500)]
    base = [photo(*shapes[k % 4], rng) for k in range(min(n, 32))]
    return [simplejpeg.encode_jpeg(base[i % len(base)], 90, colorsubsampling="420") for i in range(n)]


# ResNet-50 (v1.5: stride on the 3x3), used when torchvision is absent.
class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(True),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(True),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet50_local(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, mid, stride if b == 0 else 1))
            cin = mid * 4
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def resnet50() -> tuple[nn.Module, str]:
    try:
        from torchvision.models import resnet50 as tv_resnet50

        return tv_resnet50(num_classes=1000), "torchvision resnet50"
    except ImportError:
        return resnet50_local(1000), "ResNet-50 defined in tools/gpu.py (torchvision absent)"


def cpu_decode_rate(blobs: list[bytes], threads: int) -> float:
    from packio import decode as cpu

    with ThreadPoolExecutor(threads) as pool:
        def run() -> None:
            list(pool.map(cpu.decode, blobs))

        return len(blobs) / timed(run, rounds=3, warmup=1)


def check_decode(blobs: list[bytes], batch: int, dev: torch.device, names: list[str], results: dict) -> None:
    from packio.cuda import BatchDecoder, GPUTransform

    chunks = [blobs[i:i + batch] for i in range(0, len(blobs), batch)]
    tf = GPUTransform(size=(224, 224), train=False, channels_last=True, dtype=torch.bfloat16)
    for name in names:
        try:
            dec = BatchDecoder(dev, name)
        except Exception as exc:  # report and go on with the next backend
            print(f"  {name:12s} unavailable: {exc}")
            continue
        t = timed(lambda: [dec(c) for c in chunks], rounds=5, warmup=2, sync=True)
        rate = len(blobs) / t
        t2 = timed(lambda: [tf({"image": dec(c)}) for c in chunks], rounds=5, warmup=2, sync=True)
        rate2 = len(blobs) / t2
        decoded = [dec(c) for c in chunks]
        t3 = timed(lambda: [tf({"image": d}) for d in decoded], rounds=5, warmup=2, sync=True)
        print(f"  {name:12s} decode {rate:9.0f} img/s   decode+resize224+normalise {rate2:9.0f} img/s   "
              f"(CPU fallbacks: {dec.cpu_decoded} of {dec.cpu_decoded + dec.gpu_decoded}; "
              f"resize224+normalise alone {len(blobs) / t3:.0f} img/s)")
        if name == "nvimgcodec":
            from packio.cuda.backends import NvImageCodecBackend

            shares = []
            for load in (0.5, 0.75, 1.0):
                d2 = BatchDecoder(dev, NvImageCodecBackend(hw_load=load))
                shares.append(f"{load:.2f}: {len(blobs) / timed(lambda: [d2(c) for c in chunks], 5, 2, True):.0f}")
            print(f"  {'':12s} decode img/s by hardware-decoder share (default 0.9): {', '.join(shares)}")
        results["decode"] = max(results.get("decode", 0.0), rate)
        results["pipeline"] = max(results.get("pipeline", 0.0), rate2)


def check_h2d(dev: torch.device, batch: int) -> None:
    x = torch.randint(0, 255, (batch, 3, 224, 224), dtype=torch.uint8)
    xp = x.pin_memory()
    gb = x.numel() / 1e9
    t_page = timed(lambda: [x.to(dev) for _ in range(10)], sync=True) / 10
    t_pin = timed(lambda: [xp.to(dev, non_blocking=True) for _ in range(10)], sync=True) / 10
    print(f"H2D uint8 {tuple(x.shape)} ({gb * 1e3:.0f} MB): pageable {gb / t_page:6.1f} GB/s, "
          f"pinned non_blocking {gb / t_pin:6.1f} GB/s")


def _steps_loader(blobs: list[bytes], a: argparse.Namespace) -> torch.utils.data.DataLoader:
    """A pinned-memory packio loader over ``blobs`` stored pre-resized to 256x256 uint8 (the
    prefetcher path moves uint8 and crops on the GPU), one long epoch sampled with replacement."""
    import packio

    tmp = Path(tempfile.mkdtemp(prefix="packio-gpucheck-"))
    folder = tmp / "imgs"
    for i, b in enumerate(blobs[:1024]):
        d = folder / f"c{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:05d}.jpg").write_bytes(b)
    packio.convert(folder, tmp / "d.arrays", resize=packio.ResizeSpec(size=(256, 256)), workers=min(8, os.cpu_count()),
                   progress=False)
    ds = packio.open_dataset(tmp / "d.arrays")
    sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=(a.warmup + a.steps) * a.batch)
    return packio.DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=a.workers, drop_last=True,
                             pin_memory=True, persistent_workers=False)


def check_steps(blobs: list[bytes], dev: torch.device, a: argparse.Namespace, results: dict) -> None:
    from packio.cuda import GPUTransform, Prefetcher

    model, mname = resnet50()
    model = model.to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    loader = _steps_loader(blobs, a)
    tf = GPUTransform(size=(224, 224), train=True, channels_last=True, dtype=torch.bfloat16,
                      generator=torch.Generator(device=dev).manual_seed(0))

    def fed() -> float:
        feed = iter(Prefetcher(loader, device=dev, transform=tf))
        for _ in range(a.warmup):
            b = next(feed)
            step(b["image"], b["label"])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in feed:
            step(b["image"], b["label"])
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / a.steps

    resident_batches = []
    for b in loader:  # the same kind of batches, uint8 on the GPU before timing
        resident_batches.append((b["image"].to(dev), b["label"].to(dev)))
        if len(resident_batches) == 8:
            break

    def resident() -> float:
        for k in range(a.warmup):
            img, lab = resident_batches[k % 8]
            step(tf({"image": img})["image"], lab)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(a.steps):
            img, lab = resident_batches[k % 8]
            step(tf({"image": img})["image"], lab)  # the same transform as the prefetcher path
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / a.steps

    t_res = min(resident() for _ in range(2))
    t_pre = min(fed() for _ in range(2))
    print(f"step time ({mname}, batch {a.batch}, bf16 autocast, channels_last, {a.steps} steps after "
          f"{a.warmup} warm-up, same GPUTransform(train) both ways):")
    print(f"  batches already resident on the GPU: {t_res * 1e3:8.2f} ms  ({a.batch / t_res:7.0f} img/s)")
    print(f"  packio Prefetcher from {a.workers} workers:  {t_pre * 1e3:8.2f} ms  ({t_pre / t_res:.3f}x resident)")
    results["steps"] = t_pre / t_res


def check_cpu_parts(blobs: list[bytes], batch: int) -> None:
    """What runs here without a GPU: the decode dispatch, the transform code and the
    ResNet-50 definition (CPU figures, never GPU figures)."""
    from packio.cuda import BatchDecoder, GPUTransform

    chunks = [blobs[i:i + batch] for i in range(0, len(blobs), batch)]
    dec = BatchDecoder("cpu", "cpu")
    tf = GPUTransform(size=(224, 224), train=False)
    t = timed(lambda: [tf({"image": dec(c)}) for c in chunks], rounds=1, warmup=1)
    print(f"CPU-only pipeline (decode + batched resize-matmul + normalise, on the CPU): {len(blobs) / t:8.0f} img/s")
    model, mname = resnet50()
    with torch.no_grad():
        out = model.eval()(torch.zeros(1, 3, 64, 64))
    print(f"{mname}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, forward ok {tuple(out.shape)}")


def sweep(blobs: list[bytes], batch: int, rounds: int) -> None:
    """GPU batched decode per backend and nvImageCodec hardware-decoder share, alternating
    rounds (clock warm-up and order favour none): median img/s and ratio to the best."""
    from packio.cuda import BatchDecoder, GPUTransform
    from packio.cuda.backends import NvImageCodecBackend, available

    dev = torch.device("cuda", 0)
    chunks = [blobs[i:i + batch] for i in range(0, len(blobs), batch)]
    settings: dict[str, BatchDecoder] = {}
    if available("nvimgcodec"):
        for load in (0.0, 0.5, 0.9, 1.0):
            settings[f"nvimgcodec hw_load={load}"] = BatchDecoder(dev, NvImageCodecBackend(hw_load=load))
    if available("torchvision"):
        settings["torchvision"] = BatchDecoder(dev, "torchvision")
    tf = GPUTransform(size=(224, 224), train=False, channels_last=True, dtype=torch.bfloat16)
    cases = {}
    for name, dec in settings.items():
        cases[f"{name} decode"] = lambda dec=dec: len(blobs) / timed(lambda: [dec(c) for c in chunks], 3, 1, True)
        cases[f"{name} +resize224+normalise"] = lambda dec=dec: len(blobs) / timed(
            lambda: [tf({"image": dec(c)}) for c in chunks], 3, 1, True)
    got = {k: median(v) for k, v in interleaved(cases, rounds).items()}
    best = {kind: max(v for k, v in got.items() if k.endswith(kind)) for kind in (" decode", "normalise")}
    table(("setting", "img/s", "× best"), [(k, f"{v:.0f}", f"{v / best[' decode' if k.endswith(' decode') else 'normalise']:.2f}")
                                          for k, v in got.items()],
          f"{torch.cuda.get_device_name(dev)}; {len(blobs)} JPEGs ~500x375 q90, batch {batch}, median of {rounds} "
          "alternating rounds (each the median of 3 timed passes)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2048, help="JPEGs decoded per round")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50, help="timed training steps per path")
    ap.add_argument("--warmup", type=int, default=10, help="untimed training steps first")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--allow-cpu", action="store_true", help="no CUDA / no GPU decoder: run the CPU parts, exit 0")
    ap.add_argument("--sweep", action="store_true", help="only the decode backend / hardware-share sweep")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of --sweep")
    a = ap.parse_args()

    from packio.cuda.backends import ORDER, available

    has_cuda = torch.cuda.is_available()
    names = [n for n in ORDER if available(n)]
    print(f"torch {torch.__version__}, CUDA {'yes: ' + torch.cuda.get_device_name(0) if has_cuda else 'no'}; "
          f"GPU decode backends installed: {', '.join(names) or 'none'}")
    missing = [] if has_cuda else ["CUDA (a CUDA build of torch on a GPU machine)"]
    if not names:
        missing.append("a GPU decode backend (pip install 'packio[nvimgcodec]' and/or 'packio[gpu]')")
    if missing and not a.allow_cpu:
        print(f"gpu.py: missing {' and '.join(missing)}; nothing to measure. Run on a GPU machine with them, "
              f"or pass --allow-cpu to run the CPU parts only.", file=sys.stderr)
        return 2

    blobs = imagenet_like(a.images)
    if a.sweep and has_cuda:
        sweep(blobs, a.batch, a.rounds)
        return 0
    sizes = [len(b) for b in blobs]
    print(f"{len(blobs)} JPEGs ~500x375 q90 4:2:0, mean {np.mean(sizes) / 1e3:.0f} KB, batch {a.batch}")
    cores = os.cpu_count() or 1
    one, alln = cpu_decode_rate(blobs, 1), cpu_decode_rate(blobs, cores)
    print(f"CPU decode (packio, simplejpeg): 1 thread {one:8.0f} img/s; {cores} threads {alln:8.0f} img/s")

    results: dict[str, float] = {}
    if has_cuda:
        dev = torch.device("cuda", torch.cuda.current_device())
        print("GPU batched decode, per backend:")
        check_decode(blobs, a.batch, dev, names, results)
        check_h2d(dev, a.batch)
        check_steps(blobs, dev, a, results)
    else:
        check_cpu_parts(blobs[:min(len(blobs), 2 * a.batch)], a.batch)

    print("targets (one H100):")
    shown = [("decode", "{:.0f} img/s", lambda v: v >= 10_000), ("pipeline", "{:.0f} img/s", lambda v: v >= 8_000),
             ("steps", "{:.3f}x", lambda v: v <= 1.05)]
    for (label, target), (key, fmt, ok) in zip(TARGETS, shown):
        if key in results:
            got = fmt.format(results[key])
            verdict = "met" if ok(results[key]) else "NOT met"
        else:
            got, verdict = "not measured: no GPU" if not has_cuda else "not measured", "-"
        print(f"  {label:34s} {target:16s} {got:22s} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
