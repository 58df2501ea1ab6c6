"""packio's GPU feed side by side with NVIDIA DALI and the torchvision baseline, in one run
on the same in-memory JPEG bytes (ImageNet-like ~500x375 q90 4:2:0, plus the real photos under
../shared/data), batch 256, output fp16 (or bf16) 224x224 normalised NHWC (channels_last),
random resized crop and a 50 % flip, in alternating rounds.

    python tools/gpu_vs_dali.py                      # on a CUDA machine: every pipeline it can run
    python tools/gpu_vs_dali.py --train-steps 200    # also ResNet-50 bf16 training fed by each
    python tools/gpu_vs_dali.py --allow-cpu --images 64 --batch 16 --rounds 1   # the CPU parts only

Pipelines (one is reported "unavailable: why" when its package or CUDA is missing):
  dali hw=LOAD      fn.external_source → decoders.image(device="mixed", hw_decoder_load=LOAD; "default":
                    DALI's own) → random_resized_crop → crop_mirror_normalize (mirror 50 %)
  dali-cpu          the same with decoders.image(device="cpu") (CPU-only: runs without a GPU)
  packio BACKEND    packio dataset (decode=False) → packio.DataLoader → Prefetcher → BatchDecoder(BACKEND)
                    + GPUTransform(train); nvimgcodec with its hardware-decoder share swept
  packio cpu        the same code on the CPU (decode on CPU threads; --allow-cpu)
  torchvision       ImageFolder + RandomResizedCrop + flip + ToTensor + Normalize, DataLoader on all cores
Prints img/s per pipeline, × DALI (the fastest "dali hw=" setting), GPU memory, CPU cores busy
and the decoder engines used.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DATA, interleaved, median, table  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class Feed:
    """One pipeline: ``batches()`` is one pass over the data (its own batch objects),
    ``to_torch`` makes one an NCHW (channels_last) tensor, ``engines()`` says what decoded."""

    batches: Callable[[], Iterator[Any]]
    engines: Callable[[], str]
    to_torch: Callable[[Any], Any] = lambda b: b
    sync: Callable[[], None] = lambda: None

    def epoch(self) -> int:
        n = 0
        for b in self.batches():
            n += len(b)
        self.sync()
        return n


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=5000, help="generated ImageNet-like JPEGs (>= 5000 for figures)")
    ap.add_argument("--real", default=str(DATA), help="also every JPEG under this folder ('' for none)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="output dtype (DALI: fp16 only)")
    ap.add_argument("--hw-loads", default="default,0.5,0.75,0.9,1.0",
                    help="hardware-decoder shares to sweep (DALI hw_decoder_load, nvImageCodec hw_load)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="DataLoader workers (packio) / all cores (torchvision baseline) / DALI threads")
    ap.add_argument("--pipelines", default="", help="comma-separated name prefixes to run (default: all)")
    ap.add_argument("--train-steps", type=int, default=0, help="also train ResNet-50 bf16 this many steps per feed")
    ap.add_argument("--allow-cpu", action="store_true", help="without CUDA: run the CPU pipelines, report the rest")
    a = ap.parse_args(argv)
    if a.images < 1 or a.batch < 1 or a.rounds < 1 or a.workers < 0 or a.train_steps < 0:
        ap.error("--images, --batch and --rounds must be >= 1; --workers and --train-steps >= 0")
    try:
        a.loads = [None if x == "default" else float(x) for x in a.hw_loads.split(",") if x]
    except ValueError:
        ap.error(f"--hw-loads: numbers in [0, 1] or 'default', got {a.hw_loads!r}")
    if any(x is not None and not 0 <= x <= 1 for x in a.loads):
        ap.error(f"--hw-loads: shares are in [0, 1], got {a.hw_loads!r}")
    return a


def make_data(a: argparse.Namespace, work: Path) -> tuple[list[bytes], Path, Path]:
    """The JPEG bytes, an ImageFolder of them (the baseline's input) and a packio LMDB of them."""
    import packio
    from gpu import imagenet_like

    blobs = imagenet_like(a.images)
    if a.real and Path(a.real).is_dir():
        blobs += [p.read_bytes() for p in sorted(Path(a.real).rglob("*"))
                  if p.suffix.lower() in (".jpg", ".jpeg") and p.is_file()]
    folder = work / "images"
    for i, b in enumerate(blobs):
        d = folder / f"c{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.jpg").write_bytes(b)
    packio.convert(folder, work / "d.lmdb", progress=False, workers=0)  # stores the bytes as they are
    return blobs, folder, work / "d.lmdb"


class Unavailable(Exception):
    """A pipeline that cannot run here (its package, CUDA or a GPU decoder is missing)."""


def _cuda(a: argparse.Namespace) -> Any:
    import torch

    if not torch.cuda.is_available():
        raise Unavailable("no CUDA")
    return torch.device("cuda", torch.cuda.current_device())


def _dali_modules() -> tuple[Any, Any, Any]:
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        raise Unavailable("nvidia.dali not installed (pip install nvidia-dali-cuda130)") from None
    return fn, pipeline_def, types


def dali(a: argparse.Namespace, blobs: list[bytes], device: str, hw_load: float | None) -> Feed:
    """DALI: external_source over the same bytes, decode (mixed or cpu), crop, flip, normalise."""
    import numpy as np

    fn, pipeline_def, types = _dali_modules()
    gpu = device == "mixed"
    if gpu:
        _cuda(a)
    chunks = [[np.frombuffer(b, np.uint8) for b in blobs[i:i + a.batch]]
              for i in range(0, len(blobs) - a.batch + 1, a.batch)]
    if not chunks:
        raise Unavailable(f"fewer images than one batch of {a.batch}")
    extra = {} if hw_load is None or not gpu else {"hw_decoder_load": hw_load}

    @pipeline_def(batch_size=a.batch, num_threads=max(1, a.workers), device_id=0 if gpu else None,
                  prefetch_queue_depth=2, seed=0)
    def pipe() -> Any:
        jpegs = fn.external_source(source=chunks, cycle=True, batch=True, dtype=types.UINT8)
        img = fn.decoders.image(jpegs, device=device, output_type=types.RGB, **extra)
        img = fn.random_resized_crop(img, size=(224, 224))
        return fn.crop_mirror_normalize(img, dtype=types.FLOAT16, output_layout="HWC",
                                        mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                        mirror=fn.random.coin_flip(probability=0.5))

    p = pipe()
    p.build()
    last: list[Any] = []

    def batches() -> Iterator[Any]:
        for _ in chunks:
            (out,) = p.run()
            last[:] = [out]
            yield out
    engines = f"DALI decoders.image(device={device!r}" + (f", hw_decoder_load={hw_load})" if extra else ")")
    def sync() -> None:
        if gpu and last:
            last[0].as_tensor()  # waits until the last batch is ready on the GPU
    return Feed(batches, lambda: engines, _dali_to_torch, sync)


def _dali_to_torch(out: Any) -> Any:
    """A DALI batch (NHWC fp16) as a torch NCHW view, copied on torch's current stream."""
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray

    t = out.as_tensor()
    dev = torch.device("cuda", torch.cuda.current_device()) if hasattr(t, "device_id") else torch.device("cpu")
    x = torch.empty(t.shape(), dtype=torch.float16, device=dev)
    feed_ndarray(t, x, cuda_stream=torch.cuda.current_stream() if dev.type == "cuda" else None)
    return x.permute(0, 3, 1, 2)


def packio_feed(a: argparse.Namespace, path: Path, backend: Any, label: str) -> Feed:
    """packio: decode=False dataset → DataLoader → Prefetcher(BatchDecoder + GPUTransform(train))."""
    import torch

    import packio
    from packio.cuda import BatchDecoder, GPUTransform, Prefetcher

    dev = torch.device("cpu") if backend == "cpu" else _cuda(a)
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    dec = BatchDecoder(dev, backend)
    tf = GPUTransform(size=(224, 224), train=True, channels_last=True, dtype=dtype, device=dev, decoder=dec)
    ds = packio.open_dataset(path, decode=False)
    loader = packio.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers, drop_last=True,
                               persistent_workers=a.workers > 0, pin_memory=dev.type == "cuda")

    def batches() -> Iterator[Any]:
        for batch in Prefetcher(loader, device=dev, transform=tf):
            yield batch["image"]
    return Feed(batches, lambda: f"packio {label}: {dec.gpu_decoded} on the GPU, {dec.cpu_decoded} on CPU threads",
                sync=lambda: dev.type == "cuda" and torch.cuda.synchronize(dev))


def torchvision_baseline(a: argparse.Namespace, folder: Path) -> Feed:
    """What a user has today: ImageFolder + torchvision transforms in a DataLoader on all cores."""
    import torch

    try:
        from torchvision import datasets, transforms
    except ImportError:
        raise Unavailable("torchvision not installed (kept out of packio's installs: pip install torchvision)") \
            from None
    dev = _cuda(a) if torch.cuda.is_available() or not a.allow_cpu else torch.device("cpu")
    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    loader = torch.utils.data.DataLoader(datasets.ImageFolder(str(folder), tf), batch_size=a.batch, shuffle=True,
                                         num_workers=os.cpu_count() or 1, drop_last=True, persistent_workers=True,
                                         pin_memory=dev.type == "cuda")
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16

    def batches() -> Iterator[Any]:
        for x, _ in loader:
            yield x.to(dev, non_blocking=True).to(dtype).contiguous(memory_format=torch.channels_last)
    return Feed(batches, lambda: "PIL decode on CPU (DataLoader workers)",
                sync=lambda: dev.type == "cuda" and torch.cuda.synchronize(dev))


def pipelines(a: argparse.Namespace, blobs: list[bytes], folder: Path, path: Path) -> dict[str, Callable]:
    """name → a builder returning a Feed; builders raise Unavailable."""
    from packio.cuda.backends import ORDER, NvImageCodecBackend

    out: dict[str, Callable] = {}
    for load in a.loads:
        out[f"dali hw={'default' if load is None else load}"] = lambda load=load: dali(a, blobs, "mixed", load)
    out["dali-cpu"] = lambda: dali(a, blobs, "cpu", None)
    for name in ORDER:
        if name == "nvimgcodec":
            for load in (x for x in a.loads if x is not None):
                out[f"packio nvimgcodec hw={load}"] = lambda load=load: packio_feed(
                    a, path, _backend("nvimgcodec", lambda: NvImageCodecBackend(hw_load=load)), f"nvimgcodec {load}")
        out[f"packio {name}"] = lambda name=name: packio_feed(a, path, _backend(name), name)
    out["packio cpu"] = lambda: packio_feed(a, path, "cpu", "cpu")
    out["torchvision"] = lambda: torchvision_baseline(a, folder)
    wanted = [p.strip() for p in a.pipelines.split(",") if p.strip()]
    return {k: v for k, v in out.items() if not wanted or any(k.startswith(w) for w in wanted)}


def _backend(name: str, make: Callable[[], Any] | None = None) -> Any:
    from packio.cuda.backends import available

    if not available(name):
        raise Unavailable(f"packio GPU backend {name!r} not installed (make gpu-check installs the extras)")
    return make() if make else name


def measure(builders: dict[str, Callable], rounds: int) -> tuple[dict[str, dict], dict[str, str]]:
    """Build every pipeline (skipping the unavailable), one warm-up epoch each, then
    alternating rounds of one epoch each: img/s, CPU cores busy, GPU memory."""
    from packio.measure import cpu_seconds

    built, skipped, stats = {}, {}, {}
    for name, build in builders.items():
        try:
            built[name] = build()
            built[name].epoch()  # warm-up: workers, page cache, codecs, CUDA contexts
        except Unavailable as exc:
            skipped[name] = str(exc)
            print(f"{name}: unavailable: {exc}", flush=True)

    def case(name: str) -> Callable[[], float]:
        def run() -> float:
            t, c = time.perf_counter(), cpu_seconds()
            n = built[name].epoch()
            dt = time.perf_counter() - t
            stats.setdefault(name, []).append(((cpu_seconds() - c) / dt, _gpu_used()))
            return n / dt
        return run
    got = interleaved({name: case(name) for name in built}, rounds)
    res = {name: {"rate": median(v), "cores": median(s[0] for s in stats[name]),
                  "gpu_mib": max(s[1] for s in stats[name]), "engines": built[name].engines()}
           for name, v in got.items()}
    return res, skipped


def _gpu_used() -> float:
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def report(res: dict[str, dict], skipped: dict[str, str], a: argparse.Namespace, n: int) -> None:
    dali_best = max((r["rate"] for k, r in res.items() if k.startswith("dali hw=")), default=float("nan"))
    dali_cpu = res.get("dali-cpu", {}).get("rate", float("nan"))
    rows = [(k, f"{r['rate']:.0f}", f"{r['rate'] / dali_best:.2f}" if dali_best == dali_best else "-",
             f"{r['rate'] / dali_cpu:.2f}" if dali_cpu == dali_cpu else "-", f"{r['cores']:.1f}",
             "-" if r["gpu_mib"] != r["gpu_mib"] else f"{r['gpu_mib']:.0f}", r["engines"]) for k, r in res.items()]
    rows += [(k, "unavailable", "", "", "", "", why) for k, why in skipped.items()]
    table(("pipeline", "img/s", "× DALI (best hw=)", "× DALI-CPU", "CPU cores busy", "GPU MiB used", "decoders"),
          rows, f"{n} JPEGs, batch {a.batch}, {a.dtype} 224x224 NHWC normalised, random resized crop + flip; "
                f"median of {a.rounds} alternating rounds")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import torch

    if not torch.cuda.is_available() and not a.allow_cpu:
        print("gpu_vs_dali.py: no CUDA here; run on a GPU machine, or pass --allow-cpu for the CPU pipelines only",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="packio-vs-dali-") as tmp:
        blobs, folder, path = make_data(a, Path(tmp))
        print(f"{len(blobs)} JPEGs, {sum(map(len, blobs)) / len(blobs) / 1e3:.0f} KB mean; torch {torch.__version__}, "
              f"CUDA {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}", flush=True)
        res, skipped = measure(pipelines(a, blobs, folder, path), a.rounds)
        report(res, skipped, a, len(blobs))
        if a.train_steps:
            train_report(a, blobs, folder, path)
    return 0


def train_report(a: argparse.Namespace, blobs: list[bytes], folder: Path, path: Path) -> None:
    """ResNet-50 bf16 channels_last for --train-steps steps fed by each feed: img/s and the share
    of step time the GPU waits for data (CUDA events around each step vs wall time)."""
    import torch

    if not torch.cuda.is_available():
        print("end-to-end training: not run (no CUDA)")
        return
    feeds = {k: v for k, v in pipelines(a, blobs, folder, path).items()
             if k in ("dali hw=default", "packio nvimgcodec", "packio torchvision", "torchvision")}
    rows = []
    for name, build in feeds.items():
        try:
            rows.append((name, *_train(a, build)))
        except Unavailable as exc:
            rows.append((name, "unavailable", "", str(exc)))
    table(("feed", "img/s", "GPU waits for data", "note"), rows,
          f"ResNet-50 bf16 channels_last, batch {a.batch}, {a.train_steps} steps")


def _train(a: argparse.Namespace, build: Callable[[], Feed]) -> tuple[str, str, str]:
    import torch
    from gpu import resnet50

    dev = _cuda(a)
    model = resnet50()[0].to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = _batches(build())
    busy, steps, t0 = 0.0, 0, None
    while steps < a.train_steps:
        x = next(batches)
        if t0 is None:
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().logsumexp(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        end.record()
        steps += 1
        end.synchronize()
        busy += start.elapsed_time(end) / 1e3
    wall = time.perf_counter() - t0
    return f"{steps * a.batch / wall:.0f}", f"{max(0.0, 1 - busy / wall) * 100:.0f} %", f"{steps} steps"


def _batches(feed: Feed) -> Iterator[Any]:
    """An endless stream of NCHW (channels_last) batches from one feed."""
    while True:
        for b in feed.batches():
            yield feed.to_torch(b)


if __name__ == "__main__":
    sys.exit(main())
