"""Issue 40's one GPU run: packio's GPU feed beside torchvision's on the same chip, end to end.

    python tools/gpu_run.py --plan                    # the steps and their time budgets (<= 8 min), what travels
    python tools/gpu_run.py --fetch-wheels            # here, once: the wheels the GPU machine lacks, into .whl/
    python tools/gpu_run.py --out DIR                 # on the GPU machine: every step (tools/README.md: the command)
    python tools/gpu_run.py --allow-cpu --tiny --out DIR   # the dry run, on a machine without CUDA

Steps, each cut at its time budget (what it measured by then is kept), with DIR/gpu-run.json and
DIR/gpu-run.md rewritten after each:
  1 tests    pytest on the GPU tests (tests/test_cuda_*.py, tests/test_pinned_gpu.py): pass/fail per test
  2 decode   one process, alternating rounds, the same in-memory JPEGs (ImageNet-like ~500x375 q90, made on
             the spot), batch 256, fp16 224x224 normalised channels_last: packio GPU decode (each backend;
             nvImageCodec's hardware share swept; decode alone too) + random resized crop + flip + normalise,
             also fed through packio.DataLoader + Prefetcher; torchvision's GPU decode + transforms.v2;
             packio CPU decode on DataLoader workers. img/s, GPU MiB, CPU cores busy
  3 train    ResNet-50 (defined here: no torchvision weights), bf16 autocast, channels_last, SGD, batch 256,
             --steps steps fed by: the naive loader (CSV parsed in every __getitem__, PIL, ToTensor, a default
             DataLoader), torch's DataLoader + torchvision CPU transforms on --workers workers, packio CPU
             decode, packio GPU decode + Prefetcher; and resident batches (the GPU's ceiling). img/s, the
             share of step time the GPU waits for data (CUDA events), naive / packio epoch time
  4 profile  where packio is behind a goal: torch.profiler over its best GPU pipeline (kernels, GPU busy share)
A pipeline that cannot run (no CUDA, torchvision or nvImageCodec missing) is reported "unavailable: why".
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import gzip
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, interleaved, median, table  # noqa: E402

# packio's CPU path crops and flips at read time (issue 39's DecodeOptions; random_resized_crop takes --size),
# or with a per-sample transform (CropFlip). The switch is this one line: the open_dataset keywords of the
# read-time crop, or None for the transform.
CPU_READ_CROP: dict[str, Any] | None = {"random_resized_crop": 224, "flip_p": 0.5}

DALI_FLOOR = 19_000  # img/s: DALI's CI floor, ResNet-50 pipeline, one Hopper GPU (published; DALI cannot travel)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
GPU_TESTS = ("tests/test_cuda_feed.py", "tests/test_cuda_transforms.py", "tests/test_pinned_gpu.py")
# What the GPU machine's image lacks (its package list: torch 2.11 cu130, torchvision 0.26, opencv, h5py,
# msgpack, xxhash, pillow, pytest, hypothesis are there); bytes as pip downloaded them for CPython 3.12.
WHEELS = (("simplejpeg", "1.9.0", 407_547), ("lmdb", "3.0.0", 569_828), ("braceexpand", "0.1.7", 5_923),
          ("nvidia-nvimgcodec-cu13", "0.9.0.20", 25_044_224), ("nvidia-nvjpeg", "13.0.4.44", 3_727_905))
TRAVEL_LIMIT = 64 << 20
# (step, what, seconds): the plan of one run; the sum stays <= 480 s.
PLAN = (("setup", "imports, 5,000 JPEGs made on 16 threads, image folder + CSV + LMDB", 40),
        ("tests", "pytest: the GPU tests", 100),
        ("decode", "img/s, GPU MiB, CPU cores: warm-up pass each, then alternating rounds", 90),
        ("train", "ResNet-50 bf16: resident ceiling, then the four feeds (each capped)", 170),
        ("profile", "torch.profiler over packio's best GPU pipeline, where a goal is missed", 30),
        ("report", "gpu-run.json, gpu-run.md", 5))
DEVICE_COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
                  "/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=/tmp/site/nvidia/cu13/lib:"
                  "$LD_LIBRARY_PATH PYTHONUNBUFFERED=1 && set -o pipefail && python3 tools/gpu_run.py --out $OUT "
                  "2>&1 | tee $OUT/gpu-run.log")
DEVICE_TIMEOUT = 540
TINY = {"images": 24, "jpeg_side": 64, "batch": 8, "size": 32, "rounds": 1, "steps": 2, "warmup": 0, "workers": 0,
        "gpu_feed_workers": 0, "naive_cap": 20.0, "model": "small"}


class Unavailable(Exception):
    """A pipeline that cannot run here; the message says why."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-out", help="folder for gpu-run.json / gpu-run.md (the device's $OUT)")
    ap.add_argument("--plan", action="store_true", help="print the steps, budgets, wheels and device command; exit")
    ap.add_argument("--fetch-wheels", action="store_true", help="pip download the wheels that travel into .whl/")
    ap.add_argument("--allow-cpu", action="store_true", help="without CUDA: run every CPU-runnable part")
    ap.add_argument("--tiny", action="store_true", help="the dry run's sizes: " + json.dumps(TINY))
    ap.add_argument("--images", type=int, default=5000, help="ImageNet-like JPEGs made on the spot (>= 5000)")
    ap.add_argument("--jpeg-side", type=int, default=500, help="the JPEGs' long side (ImageNet-like: 500)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224, help="output side (crop, resize)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of step 2")
    ap.add_argument("--steps", type=int, default=150, help="timed training steps per feed")
    ap.add_argument("--warmup", type=int, default=10, help="untimed training steps per feed first")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="CPU-decode DataLoader workers")
    ap.add_argument("--gpu-feed-workers", type=int, default=4, help="workers reading bytes for packio GPU decode")
    ap.add_argument("--model", choices=("resnet50", "small"), default="resnet50",
                    help="the trained model (small: a 4-layer CNN, for the dry run on a CPU)")
    ap.add_argument("--naive-workers", type=int, default=0, help="the naive loader's workers (a default DataLoader)")
    ap.add_argument("--naive-cap", type=float, default=40.0, help="seconds the naive feed may train")
    ap.add_argument("--tests", default=",".join(GPU_TESTS), help="comma-separated test files of step 1 ('' none)")
    ap.add_argument("--profile", action="store_true",
                    help="profile step 2's best packio GPU pipeline even where no goal is missed (or on the CPU)")
    ap.add_argument("--steps-only", default="", help="comma-separated steps to run (tests,decode,train,profile)")
    a = ap.parse_args(argv)
    if a.tiny:
        for k, v in TINY.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    if (min(a.images, a.batch, a.size, a.rounds, a.steps) < 1 or a.jpeg_side < 16
            or min(a.warmup, a.workers, a.gpu_feed_workers, a.naive_workers) < 0):
        ap.error("--images, --batch, --size, --rounds and --steps must be >= 1; --warmup and workers >= 0; "
                 "--jpeg-side >= 16")
    if a.images < a.batch:
        ap.error(f"--images {a.images} is fewer than one batch of {a.batch}")
    return a


# ---------------------------------------------------------------- plan, wheels, report

def plan_text() -> str:
    total = sum(s for _, _, s in PLAN)
    lines = ["steps of one run (each cut at its budget):"]
    lines += [f"  {name:8s} {secs:4d} s  {what}" for name, what, secs in PLAN]
    lines += [f"  {'total':8s} {total:4d} s  ({total // 60} min {total % 60} s; the plan's ceiling is 8 min)", "",
              "wheels that travel (carry=['.whl']; made by --fetch-wheels):"]
    lines += [f"  {n + '==' + v:34s} {size / 2**20:6.2f} MiB" for n, v, size in WHEELS]
    lines += [f"  {'total':34s} {sum(s for *_, s in WHEELS) / 2**20:6.2f} MiB of the 64 MiB that may travel", "",
              f"device tool: run(command={DEVICE_COMMAND!r}, timeout_s={DEVICE_TIMEOUT}, carry=['.whl'])"]
    return "\n".join(lines)


def fetch_wheels(dest: Path) -> int:
    """Download WHEELS for the GPU machine's CPython 3.12 (x86-64) into ``dest``; print sizes."""
    plats = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                         "manylinux2014_x86_64", "manylinux1_x86_64")]
    dest.mkdir(exist_ok=True)
    for name, version, _ in WHEELS:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp", *plats, "-d", str(dest),
                            f"{name}=={version}"], capture_output=True, text=True)
        if r.returncode:
            print(f"gpu_run.py: pip download {name}=={version} failed: {r.stderr.strip()[-400:]}", file=sys.stderr)
            return 1
    files = sorted(dest.glob("*.whl"))
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"{f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    print(f"{total / 2**20:7.2f} MiB in {dest} (of {TRAVEL_LIMIT >> 20} MiB that may travel with the tree)")
    return 0 if total < TRAVEL_LIMIT else 1


@dataclass
class Report:
    """The run's record: rewritten (JSON + Markdown, atomically) after every step."""

    out: Path
    data: dict[str, Any] = field(default_factory=dict)
    md: dict[str, str] = field(default_factory=dict)

    ORDER = ("head", "tests", "decode", "train", "goals", "profile", "notes")

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        md = "\n\n".join(self.md[k] for k in self.ORDER if k in self.md) + "\n"
        for name, text in (("gpu-run.json", json.dumps(self.data, indent=1, default=str)), ("gpu-run.md", md)):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(self.out / name)


def cell(text: Any) -> str:
    """``text`` as one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def cpu_seconds() -> float:
    """CPU seconds of this process and its live children (DataLoader workers), from /proc."""
    total = time.process_time()
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(rest[1]) == me:  # ppid
            total += (int(rest[11]) + int(rest[12])) / tick  # utime + stime
    return total


# ---------------------------------------------------------------- environment and data

def find_gpu_libs() -> dict[str, str]:
    """Make carried nvImageCodec importable beside the image's own nvidia/ packages, and load the carried
    libnvjpeg by path (nvImageCodec dlopens it by name). Says what it found."""
    found: dict[str, str] = {}
    for p in map(Path, sys.path):
        lib = p / "nvidia" / "cu13" / "lib" / "libnvjpeg.so.13"
        if lib.is_file() and "libnvjpeg" not in found:
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                found["libnvjpeg"] = str(lib)
            except OSError as exc:
                found["libnvjpeg"] = f"{lib}: {exc}"
    try:
        import nvidia

        if isinstance(nvidia.__path__, list):  # a regular package shadowing the carried one: join them
            carried = [str(p / "nvidia") for p in map(Path, sys.path) if (p / "nvidia" / "nvimgcodec").is_dir()]
            nvidia.__path__.extend(d for d in carried if d not in nvidia.__path__)
    except ImportError:
        pass
    return found


def environment(dev: Any) -> dict[str, Any]:
    import torch

    from packio.cuda.backends import ORDER, available

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cores": os.cpu_count(), "device": str(dev),
                           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                           "cpu_crop": "read-time " + json.dumps(CPU_READ_CROP) if CPU_READ_CROP
                           else "per-sample transform (cv2 crop + resize + flip)", **find_gpu_libs()}
    for mod in ("torchvision", "nvidia.nvimgcodec", "simplejpeg", "cv2", "PIL", "lmdb"):
        try:
            env[mod] = getattr(__import__(mod, fromlist=["_"]), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
            env[mod] = f"unavailable: {type(exc).__name__}: {exc}"
    env["packio_gpu_backends"] = [n for n in ORDER if available(n)]
    if dev.type == "cuda":
        smi = shutil.which("nvidia-smi")
        if smi:
            r = subprocess.run([smi, "--query-gpu=driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                               capture_output=True, text=True)
            env["nvidia_smi"] = r.stdout.strip()
    return env


def make_jpegs(n: int, long_side: int = 500, seed: int = 0) -> list[bytes]:
    """``n`` distinct ImageNet-like JPEGs: 500 px long side (4:3, 3:4, 3:2), q90, 4:2:0, ~100 KB: crops of
    a bank of smooth photo-like backgrounds with per-image gain, grain and mirror, encoded on all cores."""
    import simplejpeg

    rng = np.random.default_rng(seed)
    side = long_side + 32
    y, x = np.mgrid[0:side, 0:side].astype(np.float32)
    bank = []
    for _ in range(8):
        img = np.stack([110 + 70 * np.sin(x * fx + y * fy + ph) for fx, fy, ph in rng.uniform(0.002, 0.03, (3, 3))],
                       -1)
        for _ in range(6):
            cy, cx, r = rng.uniform(0, side, 2).tolist() + [rng.uniform(15, 200)]
            m = (y - cy) ** 2 + (x - cx) ** 2 < r * r
            img[m] = img[m] * 0.4 + rng.uniform(0, 255, 3) * 0.6
        bank.append(img)
    grain = rng.normal(0, 24, (side, side, 3)).astype(np.float32)
    shapes = [(round(h * long_side / 500), round(w * long_side / 500))
              for h, w in ((375, 500), (375, 500), (500, 375), (333, 500))]
    jobs = [(k, shapes[k % 4], rng.integers(0, 32, 4).tolist(), rng.uniform(0.7, 1.3, 3)) for k in range(n)]

    def one(job: tuple) -> bytes:
        k, (h, w), (y0, x0, ny, nx), gain = job
        img = bank[k % len(bank)][y0:y0 + h, x0:x0 + w] * gain.astype(np.float32) + grain[ny:ny + h, nx:nx + w]
        img = np.clip(img, 0, 255).astype(np.uint8)
        return simplejpeg.encode_jpeg(np.ascontiguousarray(img[:, ::-1] if k % 2 else img), 90,
                                      colorsubsampling="420")

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(one, jobs))


def write_data(blobs: list[bytes], work: Path, workers: int) -> tuple[Path, Path, Path]:
    """An image folder (10 classes), the naive loader's CSV of path,label, and a packio LMDB of the bytes."""
    import packio

    folder, rows = work / "images", []
    for i, b in enumerate(blobs):
        d = folder / f"c{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.jpg").write_bytes(b)
        rows.append((str(d / f"{i:06d}.jpg"), i % 10))
    with open(work / "train.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "label"), *rows])
    packio.convert(folder, work / "d.lmdb", progress=False, workers=min(workers, 16))  # the bytes as they are
    return folder, work / "train.csv", work / "d.lmdb"


# ---------------------------------------------------------------- step 1: the GPU tests

def run_tests(files: list[str], budget: float, work: Path) -> dict[str, Any]:
    """pytest on ``files`` in a child (cut at ``budget`` s): counts, and each test's outcome."""
    if not files:
        return {"status": "not run: no test files given"}
    xml = work / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
    if len(files) > 1 and (os.cpu_count() or 1) >= 8 and _has("xdist"):
        cmd += ["-n", "4"]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget)
        rc, tail = r.returncode, (r.stdout + r.stderr)[-1500:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = None, f"cut at its budget of {budget:.0f} s: {str(exc.stdout or '')[-1000:]}"
    res: dict[str, Any] = {"command": " ".join(cmd[1:]), "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                           "tail": tail, "tests": {}}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            outcome = "passed" if bad is None else {"failure": "FAILED", "error": "ERROR"}.get(bad.tag, "skipped")
            res["tests"][name] = outcome if bad is None else f"{outcome}: {(bad.get('message') or '')[:300]}"
    counts: dict[str, int] = {}
    for v in res["tests"].values():
        counts[v.split(":")[0]] = counts.get(v.split(":")[0], 0) + 1
    res["counts"] = counts
    res["status"] = "pass" if rc == 0 else ("cut" if rc is None else "FAIL")
    return res


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------- shared transforms

def rrc_window(h: int, w: int, rng: random.Random, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, ...]:
    """torchvision's RandomResizedCrop rule: (top, left, height, width)."""
    for _ in range(10):
        area = h * w * rng.uniform(*scale)
        r = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = int(round(math.sqrt(area * r))), int(round(math.sqrt(area / r)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, h - ch), rng.randint(0, w - cw), ch, cw
    s = min(h, w)
    return (h - s) // 2, (w - s) // 2, s, s


class CropFlip:
    """packio's per-sample CPU transform (with CPU_READ_CROP = None): CHW uint8 → random resized crop
    (cv2, bilinear) + 50 % mirror → CHW uint8 ``size``². One RNG per process and thread."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.local = threading.local()

    def __getstate__(self) -> dict:
        return {"size": self.size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["size"])

    def __call__(self, img: Any) -> Any:
        import cv2
        import torch

        rng = getattr(self.local, "rng", None)
        if rng is None:
            rng = self.local.rng = random.Random(hash((os.getpid(), threading.get_ident(), torch.initial_seed())))
        a = img.permute(1, 2, 0).numpy()
        t, l, h, w = rrc_window(a.shape[0], a.shape[1], rng)
        out = cv2.resize(a[t:t + h, l:l + w], (self.size, self.size), interpolation=cv2.INTER_LINEAR)
        if rng.random() < 0.5:
            out = out[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(out)).permute(2, 0, 1)


class PilCropFlipToTensor:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize on PIL images, without
    torchvision (the naive feed's stand-in where torchvision is absent: the dry run)."""

    def __init__(self, size: int) -> None:
        self.size, self.rng = size, random.Random(0)

    def __call__(self, img: Any) -> Any:
        import torch
        from PIL import Image

        t, l, h, w = rrc_window(img.height, img.width, self.rng)
        img = img.resize((self.size, self.size), Image.BILINEAR, box=(l, t, l + w, t + h))
        if self.rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255)
        return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


def tv_cpu_transform(size: int) -> tuple[Callable, str]:
    try:
        from torchvision import transforms as T
    except ImportError:
        return PilCropFlipToTensor(size), "PIL + ToTensor equivalent (torchvision absent)"
    return (T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]),
            "torchvision RandomResizedCrop + flip + ToTensor + Normalize")


class NaiveCSV:
    """The loader packio exists to replace: the CSV is parsed in every ``__getitem__``, PIL opens the file."""

    def __init__(self, csv_path: Path, transform: Callable) -> None:
        self.csv_path, self.transform = csv_path, transform
        with open(csv_path, newline="") as f:
            self.n = sum(1 for _ in f) - 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        with open(self.csv_path, newline="") as f:
            rows = list(csv.reader(f))[1:]
        path, label = rows[i]
        return self.transform(Image.open(path).convert("RGB")), int(label)


# ---------------------------------------------------------------- step 2: pipelines on the same bytes

@dataclass
class Ctx:
    """What every step shares: the arguments, the device, the bytes and the files made of them."""

    a: argparse.Namespace
    dev: Any
    blobs: list[bytes]
    folder: Path
    csv: Path
    lmdb: Path

    @property
    def chunks(self) -> list[list[bytes]]:
        b = self.a.batch
        return [self.blobs[i:i + b] for i in range(0, len(self.blobs) - b + 1, b)]

    def sync(self) -> None:
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def cuda(self) -> None:
        if self.dev.type != "cuda":
            raise Unavailable("no CUDA here")


@dataclass
class Pipe:
    """One pipeline of step 2: ``run()`` is one pass over the bytes and returns the images made."""

    run: Callable[[], int]
    engines: Callable[[], str] = lambda: ""


def gpu_backends(c: Ctx) -> dict[str, Any]:
    """label → packio decode backend: each GPU backend here (nvImageCodec at several hardware shares), or
    packio's CPU decoder as the dry run's stand-in."""
    from packio.cuda.backends import ORDER, NvImageCodecBackend, available

    if c.dev.type != "cuda":
        return {"cpu stand-in (no CUDA)": "cpu"}
    out: dict[str, Any] = {}
    for name in ORDER:
        if not available(name):
            continue
        if name == "nvimgcodec":
            for load in (0.9, 0.0, 1.0):
                out[f"nvimgcodec hw={load}"] = NvImageCodecBackend(hw_load=load)
        else:
            out[name] = name
    return out


def packio_bare(c: Ctx, backend: Any, decode_only: bool) -> Pipe:
    """packio.cuda on the bytes in memory: BatchDecoder (one batched call) + GPUTransform(train): random
    resized crop + flip + normalise to fp16 channels_last."""
    import torch

    from packio.cuda import BatchDecoder, GPUTransform

    dec = BatchDecoder(c.dev, backend)
    gen = torch.Generator(device=c.dev).manual_seed(0)
    tf = GPUTransform(size=(c.a.size, c.a.size), train=True, dtype=torch.float16, channels_last=True, device=c.dev,
                      decoder=dec, generator=gen)
    chunks = c.chunks

    def run() -> int:
        for chunk in chunks:
            if decode_only:
                dec(chunk)
            else:
                tf({"image": chunk})
        c.sync()
        return len(chunks) * c.a.batch
    return Pipe(run, lambda: f"{dec.gpu_decoded} decoded on the GPU, {dec.cpu_decoded} on CPU threads")


def packio_fed(c: Ctx, workers: int) -> Pipe:
    """The same, as users run it: LMDB (decode=False) → packio.DataLoader → Prefetcher(GPUTransform)."""
    import torch

    import packio
    from packio.cuda import BatchDecoder, GPUTransform

    dec = BatchDecoder(c.dev, "auto" if c.dev.type == "cuda" else "cpu")
    tf = GPUTransform(size=(c.a.size, c.a.size), train=True, dtype=torch.float16, channels_last=True, device=c.dev,
                      decoder=dec, generator=torch.Generator(device=c.dev).manual_seed(0))
    loader = packio.DataLoader(packio.open_dataset(c.lmdb, decode=False), batch_size=c.a.batch, shuffle=True,
                               drop_last=True, num_workers=workers, persistent_workers=workers > 0,
                               pin_memory=c.dev.type == "cuda")

    run = prefetched(c, loader, tf)
    return Pipe(run, lambda: f"backend {getattr(dec.impl, 'name', 'cpu')}: {dec.gpu_decoded} on the GPU, "
                             f"{dec.cpu_decoded} on CPU threads")


def prefetched(c: Ctx, loader: Any, tf: Callable[[dict], dict]) -> Callable[[], int]:
    """One epoch of ``loader`` through packio's Prefetcher onto the device with ``tf``: the images it gave."""
    from packio.cuda import Prefetcher

    def run() -> int:
        n = sum(len(b["image"]) for b in Prefetcher(loader, device=c.dev, transform=tf))
        c.sync()
        return n
    return run


def cpu_dataset(c: Ctx) -> Any:
    """packio's CPU decode path with the crop and flip: read-time when ``CPU_READ_CROP`` says how, else the
    per-sample transform."""
    import packio

    if CPU_READ_CROP:
        return packio.open_dataset(c.lmdb, **{**CPU_READ_CROP, "random_resized_crop": c.a.size})
    return packio.open_dataset(c.lmdb, transform=CropFlip(c.a.size))


def normaliser(c: Ctx, dtype: Any) -> Callable[[dict], dict]:
    from packio.cuda import normalize

    return lambda b: {**b, "image": normalize(b["image"], MEAN, STD, dtype=dtype, channels_last=True)}


def packio_cpu(c: Ctx) -> Pipe:
    """packio CPU decode + crop + flip on DataLoader workers, uint8 pinned → Prefetcher → normalise on the GPU."""
    import torch

    import packio

    w = c.a.workers
    loader = packio.DataLoader(cpu_dataset(c), batch_size=c.a.batch, shuffle=True, drop_last=True, num_workers=w,
                               persistent_workers=w > 0, pin_memory=c.dev.type == "cuda")
    tf = normaliser(c, torch.float16)

    run = prefetched(c, loader, tf)
    how = "read-time crop" if CPU_READ_CROP else "transform="
    return Pipe(run, lambda: f"packio CPU decoder on {w} DataLoader workers ({how})")


def torchvision_gpu(c: Ctx, decode_only: bool) -> Pipe:
    """What the GPU machine's image offers: torchvision.io.decode_jpeg(list, device='cuda') + transforms.v2
    (RandomResizedCrop + flip per image, as v2 draws per call) + ToDtype + Normalize on the batch."""
    c.cuda()
    try:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms import v2
    except ImportError as exc:
        raise Unavailable(f"torchvision not installed here ({exc}); the GPU machine's image has it") from None
    aug = v2.Compose([v2.RandomResizedCrop(c.a.size, antialias=True), v2.RandomHorizontalFlip()])
    post = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    chunks = c.chunks

    def run() -> int:
        for chunk in chunks:
            imgs = decode_jpeg([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in chunk],
                               mode=ImageReadMode.RGB, device=c.dev)
            if not decode_only:
                x = post(torch.stack([aug(im) for im in imgs]))
                x.to(torch.float16, memory_format=torch.channels_last)
        c.sync()
        return len(chunks) * c.a.batch
    return Pipe(run, lambda: "torchvision nvjpeg (batched decode_jpeg)")


def _no_gpu_backend() -> Pipe:
    raise Unavailable("no packio GPU decode backend importable (torchvision, or the carried nvImageCodec: see env)")


def pipelines(c: Ctx) -> dict[str, Callable[[], Pipe]]:
    """name → builder of step 2 (a builder raises Unavailable)."""
    out: dict[str, Callable[[], Pipe]] = {}
    backends = gpu_backends(c)
    if not backends:
        out["packio GPU"] = _no_gpu_backend
    for label, be in backends.items():
        out[f"packio GPU {label}"] = lambda be=be: packio_bare(c, be, False)
        if label in ("torchvision", "nvimgcodec hw=0.9", "cpu stand-in (no CUDA)"):
            out[f"packio GPU {label} (decode alone)"] = lambda be=be: packio_bare(c, be, True)
    for w in sorted({0, c.a.gpu_feed_workers}):
        out[f"packio GPU via DataLoader nw={w} + Prefetcher"] = lambda w=w: packio_fed(c, w)
    out["torchvision GPU (decode_jpeg + v2)"] = lambda: torchvision_gpu(c, False)
    out["torchvision GPU (decode alone)"] = lambda: torchvision_gpu(c, True)
    out[f"packio CPU decode, {c.a.workers} workers"] = lambda: packio_cpu(c)
    return out


def _gpu_mib(dev: Any) -> tuple[float | None, float | None]:
    """(torch's peak allocated MiB since the last reset, device MiB in use by everyone) on CUDA."""
    import torch

    if dev.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(dev)
    return torch.cuda.max_memory_allocated(dev) / 2**20, (total - free) / 2**20


def build_pipes(c: Ctx, until: float) -> tuple[dict[str, Pipe], dict[str, dict], dict[str, str]]:
    """Build every pipeline and run its warm-up pass (workers, codecs, kernels): GPU MiB of that pass."""
    import torch

    built, stats, skipped = {}, {}, {}
    for name, build in pipelines(c).items():
        if time.monotonic() > until:
            skipped[name] = "not run: the step's time budget was spent"
            continue
        try:
            pipe = build()
            if c.dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(c.dev)
            pipe.run()
        except Unavailable as exc:
            skipped[name] = f"unavailable: {exc}"
        except Exception as exc:  # noqa: BLE001 - a broken pipeline is reported; the others still run
            skipped[name] = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
        else:
            built[name] = pipe
            peak, used = _gpu_mib(c.dev)
            stats[name] = {"torch_peak_mib": peak, "device_used_mib": used}
        print(f"  {name}: {skipped.get(name, 'ready')}", flush=True)
    return built, stats, skipped


def measure_decode(c: Ctx, budget: float) -> tuple[dict[str, Any], str]:
    """Step 2: warm-up pass each, then alternating rounds until ``--rounds`` or the budget: medians."""
    until = time.monotonic() + budget
    built, stats, skipped = build_pipes(c, until - 0.35 * budget)
    cores: dict[str, list[float]] = {k: [] for k in built}

    def case(name: str) -> Callable[[], float]:
        def one() -> float:
            if time.monotonic() > until or name in skipped:
                return float("nan")
            t, cpu = time.perf_counter(), cpu_seconds()
            try:
                n = built[name].run()
            except Exception as exc:  # noqa: BLE001 - said in the table; the other pipelines go on
                skipped[name] = f"FAILED in a round: {type(exc).__name__}: {str(exc)[:300]}"
                return float("nan")
            dt = time.perf_counter() - t
            cores[name].append((cpu_seconds() - cpu) / dt)
            return n / dt
        return one
    got = interleaved({k: case(k) for k in built}, c.a.rounds)
    rows = {k: {"img_s": median(v), "rounds": sum(math.isfinite(x) for x in v), "cpu_cores_busy": median(cores[k]),
                **stats[k], "engines": built[k].engines()} for k, v in got.items() if k not in skipped}
    tv = rows.get("torchvision GPU (decode_jpeg + v2)", {}).get("img_s", float("nan"))
    res = {"rows": rows, "unavailable": skipped, "images_per_pass": len(c.chunks) * c.a.batch,
           "torchvision_gpu_img_s": tv}
    fmt = lambda v, f="{:.0f}": "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f.format(v)
    text = table(("pipeline", "img/s", f"× DALI floor {DALI_FLOOR:,}", "× torchvision GPU", "CPU cores busy",
                  "torch peak MiB", "GPU MiB used", "rounds", "decoded by"),
                 [(k, fmt(r["img_s"]), fmt(r["img_s"] / DALI_FLOOR, "{:.2f}"), fmt(r["img_s"] / tv, "{:.2f}"),
                   fmt(r["cpu_cores_busy"], "{:.1f}"), fmt(r["torch_peak_mib"]), fmt(r["device_used_mib"]),
                   r["rounds"], r["engines"]) for k, r in rows.items()]
                 + [(k, why.split(":")[0], "", "", "", "", "", "", cell(why)) for k, why in skipped.items()],
                 f"## 2. Decode + random resized crop + flip + normalise ({res['images_per_pass']} JPEGs a pass, "
                 f"batch {c.a.batch}, fp16 {c.a.size}x{c.a.size} channels_last; median of alternating rounds)")
    return res, text


# ---------------------------------------------------------------- step 3: end to end

def resnet50(classes: int = 1000) -> Any:
    """ResNet-50 v1.5 (stride on the 3x3), torch only: no torchvision, no weights (random init)."""
    import torch.nn as nn

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

        def forward(self, x: Any) -> Any:
            return (self.body(x) + self.skip(x)).relu_()

    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, mid, stride if b == 0 else 1))
            cin = mid * 4
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def small_cnn(classes: int = 1000) -> Any:
    """Four strided conv blocks: the dry run's model (ResNet-50 on a shared CPU costs seconds a step)."""
    import torch.nn as nn

    blocks = [nn.Sequential(nn.Conv2d(i, o, 3, 2, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True))
              for i, o in ((3, 16), (16, 32), (32, 64), (64, 128))]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


def _sampler(c: Ctx, n: int) -> Any:
    """One long shuffled epoch of ``n`` samples (no epoch restarts inside the timed steps)."""
    import torch

    return torch.utils.data.RandomSampler(range(len(c.blobs)), num_samples=n,
                                          generator=torch.Generator().manual_seed(0))


def best_backend(c: Ctx, decode: dict[str, Any]) -> tuple[str, Any]:
    """The packio GPU decode backend that made step 2's fastest full pipeline ("auto" when none was measured)."""
    rows = {k[len("packio GPU "):]: r["img_s"] for k, r in decode.get("rows", {}).items()
            if k.startswith("packio GPU") and "decode alone" not in k and "DataLoader" not in k}
    backends = gpu_backends(c)
    best = max((k for k in rows if k in backends and math.isfinite(rows[k])), key=rows.get, default=None)
    if best is None:
        return "auto", "auto" if c.dev.type == "cuda" else "cpu"
    return best, backends[best]


def feeds(c: Ctx, n: int, backend: tuple[str, Any]) -> dict[str, Callable[[], Iterator[tuple[Any, Any]]]]:
    """name → a builder of an iterator of (images on the device, labels on the device), ``n`` samples long;
    packio GPU decode with ``backend`` (label, backend)."""
    import torch

    dt = torch.bfloat16 if c.dev.type == "cuda" else torch.float32
    pin = c.dev.type == "cuda"

    def to_dev(x: Any, y: Any) -> tuple[Any, Any]:
        x = x.to(c.dev, non_blocking=pin).to(dt, memory_format=torch.channels_last)
        return x, y.to(c.dev, non_blocking=pin)

    def naive() -> Iterator:
        tf, _ = tv_cpu_transform(c.a.size)
        loader = torch.utils.data.DataLoader(NaiveCSV(c.csv, tf), batch_size=c.a.batch, sampler=_sampler(c, n),
                                             num_workers=c.a.naive_workers)
        return (to_dev(x, y) for x, y in loader)

    def torch_cpu() -> Iterator:
        try:
            from torchvision import datasets
        except ImportError as exc:
            raise Unavailable(f"torchvision not installed here ({exc}); the GPU machine's image has it") from None
        ds = datasets.ImageFolder(str(c.folder), tv_cpu_transform(c.a.size)[0])
        loader = torch.utils.data.DataLoader(ds, batch_size=c.a.batch, sampler=_sampler(c, n), drop_last=True,
                                             num_workers=c.a.workers, pin_memory=pin,
                                             persistent_workers=c.a.workers > 0)
        return (to_dev(x, y) for x, y in loader)

    def packio_cpu_feed() -> Iterator:
        import packio
        from packio.cuda import Prefetcher

        loader = packio.DataLoader(cpu_dataset(c), batch_size=c.a.batch, sampler=_sampler(c, n), drop_last=True,
                                   num_workers=c.a.workers, pin_memory=pin, persistent_workers=c.a.workers > 0)
        return ((b["image"], b["label"]) for b in Prefetcher(loader, device=c.dev, transform=normaliser(c, dt)))

    def packio_gpu_feed() -> Iterator:
        import packio
        from packio.cuda import BatchDecoder, GPUTransform, Prefetcher

        dec = BatchDecoder(c.dev, backend[1])
        tf = GPUTransform(size=(c.a.size, c.a.size), train=True, dtype=dt, channels_last=True, device=c.dev,
                          decoder=dec, generator=torch.Generator(device=c.dev).manual_seed(0))
        w = c.a.gpu_feed_workers
        loader = packio.DataLoader(packio.open_dataset(c.lmdb, decode=False), batch_size=c.a.batch,
                                   sampler=_sampler(c, n), drop_last=True, num_workers=w, pin_memory=pin,
                                   persistent_workers=w > 0)
        return ((b["image"], b["label"]) for b in Prefetcher(loader, device=c.dev, transform=tf))

    return {"(a) naive: CSV per __getitem__, PIL, ToTensor, default DataLoader": naive,
            f"(b) torch DataLoader + torchvision CPU transforms, {c.a.workers} workers": torch_cpu,
            f"(c) packio CPU decode, {c.a.workers} workers": packio_cpu_feed,
            f"(d) packio GPU decode ({backend[0]}) + Prefetcher, {c.a.gpu_feed_workers} workers": packio_gpu_feed}


@dataclass
class Trainer:
    """ResNet-50, SGD, bf16 autocast on CUDA (fp32 on the CPU), channels_last: one model for every feed."""

    c: Ctx
    model: Any = None
    opt: Any = None

    def __post_init__(self) -> None:
        import torch

        torch.backends.cudnn.benchmark = True
        small = self.c.a.model == "small"
        self.model = (small_cnn() if small else resnet50()).to(self.c.dev, memory_format=torch.channels_last)
        # torch.optim's first use imports torch._dynamo (seconds on a busy CPU): the dry run's model steps by hand
        self.opt = None if small else torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, x: Any, y: Any) -> None:
        import torch

        with torch.autocast(self.c.dev.type, dtype=torch.bfloat16, enabled=self.c.dev.type == "cuda"):
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        if self.opt is not None:
            self.opt.step()
            return
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(p.grad, alpha=-0.01)

    def run(self, batches: Iterator[tuple[Any, Any]], cap: float, warmup: int) -> dict[str, Any]:
        """``warmup`` untimed steps, then up to ``--steps`` timed ones (fewer when ``cap`` s run out).
        Headline figures come from the last half of the timed steps (a loader's first batches were made
        while the workers started, ahead of the steps). GPU wait: 1 - (the steps' CUDA-event time) / (the
        first one's start to the last one's end); on the CPU: the share of wall time spent in next(batch)."""
        import torch

        a, cuda = self.c.a, self.c.dev.type == "cuda"
        t_end = time.perf_counter() + cap
        for _ in range(warmup):
            self.step(*next(batches))
        self.c.sync()
        events, fetch, stamps = [], [], [time.perf_counter()]
        while len(fetch) < a.steps and (not fetch or time.perf_counter() < t_end):
            x, y = next(batches)
            fetch.append(time.perf_counter() - stamps[-1])
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if ev:
                ev[0].record()
            self.step(x, y)
            if ev:
                ev[1].record()
                events.append(ev)
            stamps.append(time.perf_counter())
        self.c.sync()
        stamps[-1] = time.perf_counter()
        steps, half = len(fetch), len(fetch) // 2
        if cuda:  # the gaps between one step's end and the next one's start, on the GPU's own clock
            busy = [s.elapsed_time(e) / 1e3 for s, e in events]
            span = events[half][0].elapsed_time(events[-1][1]) / 1e3
            wait_all = 1 - sum(busy) / (events[0][0].elapsed_time(events[-1][1]) / 1e3)
            wait = 1 - sum(busy[half:]) / span
        else:
            span = stamps[-1] - stamps[half]
            wait_all, wait = sum(fetch) / (stamps[-1] - stamps[0]), sum(fetch[half:]) / span
        return {"img_s": (steps - half) * a.batch / span, "gpu_wait": wait, "steps": steps,
                "img_s_all_steps": steps * a.batch / (stamps[-1] - stamps[0]), "gpu_wait_all_steps": wait_all,
                "seconds": round(stamps[-1] - stamps[0], 2), "warmup": warmup,
                "wait_method": "CUDA events" if cuda else "wall time in next(batch) (CPU: no CUDA events)",
                "capped": steps < a.steps}


def resident(c: Ctx) -> Iterator[tuple[Any, Any]]:
    """The same batch, already on the device, for ever: the GPU-bound ceiling of the training step."""
    import torch

    dt = torch.bfloat16 if c.dev.type == "cuda" else torch.float32
    x = torch.randn(c.a.batch, 3, c.a.size, c.a.size, device=c.dev).to(dt, memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (c.a.batch,), device=c.dev)
    while True:
        yield x, y


def measure_train(c: Ctx, budget: float, decode: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Step 3: the resident ceiling, then each feed (the naive one capped at ``--naive-cap`` s, each at
    its share of what is left of the budget); packio GPU decode with step 2's fastest backend."""
    import gc

    until = time.monotonic() + budget
    trainer = Trainer(c)
    rows: dict[str, dict[str, Any]] = {
        "resident batches (no loader: the ceiling)": trainer.run(resident(c), 0.15 * budget, c.a.warmup)}
    todo = feeds(c, (c.a.warmup + c.a.steps) * c.a.batch, best_backend(c, decode))
    for k, (name, build) in enumerate(todo.items()):
        left = until - time.monotonic()
        cap = min(left / (len(todo) - k), c.a.naive_cap if name.startswith("(a)") else left)
        try:
            if cap < 2:
                raise Unavailable("not run: the step's time budget was spent")
            batches = build()
            # start-up and warm-up come out of the cap too; the naive loader has no workers to warm
            rows[name] = trainer.run(batches, cap * 0.8, min(c.a.warmup, 2) if name.startswith("(a)") else c.a.warmup)
            del batches
        except Unavailable as exc:
            rows[name] = {"unavailable": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a broken feed is reported; the others still run
            rows[name] = {"unavailable": f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"}
        gc.collect()
        print(f"  {name}: {rows[name]}", flush=True)
    return train_table(c, rows)


def train_table(c: Ctx, rows: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    ceiling = next(iter(rows.values()))["img_s"]
    naive = next((r.get("img_s") for k, r in rows.items() if k.startswith("(a)")), None)
    out = []
    for k, r in rows.items():
        if "unavailable" in r:
            out.append((k, "unavailable", "", "", "", "", cell(r["unavailable"])))
            continue
        r["naive_over_this"] = r["img_s"] / naive if naive else None  # epoch time naive ÷ epoch time this
        out.append((k, f"{r['img_s']:.0f}", f"{r['steps']}{' (capped)' if r['capped'] else ''}",
                    f"{100 * r['gpu_wait']:.1f} %", f"{r['img_s'] / ceiling:.2f}",
                    f"{r['naive_over_this']:.1f}" if r["naive_over_this"] else "-", r["wait_method"]))
    text = table(("feed", "img/s", "timed steps", "GPU waits for data", "× resident", "epoch time naive ÷ this",
                  "how"), out,
                 f"## 3. End to end: {'ResNet-50' if c.a.model == 'resnet50' else 'a small CNN'}, "
                 f"{'bf16 autocast' if c.dev.type == 'cuda' else 'fp32 (CPU)'}, "
                 f"channels_last, batch {c.a.batch}, {c.a.size}x{c.a.size}, {c.a.warmup} warm-up + up to "
                 f"{c.a.steps} timed steps per feed; img/s and waits over the last half of the timed steps (all "
                 f"of them: gpu-run.json)")
    return {"rows": rows}, text


# ---------------------------------------------------------------- goals, profile, main

def goals(res: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The issue's four goals against what was measured ("not measured" where a step did not run)."""
    dec = res.get("decode", {}).get("rows", {})
    full = {k: r["img_s"] for k, r in dec.items() if k.startswith("packio GPU") and "decode alone" not in k
            and math.isfinite(r["img_s"])}
    best = max(full, key=full.get) if full else None
    tv = res.get("decode", {}).get("torchvision_gpu_img_s", float("nan"))
    train = {k: r for k, r in res.get("train", {}).get("rows", {}).items() if "img_s" in r}
    packio_feeds = {k: r for k, r in train.items() if k.startswith(("(c)", "(d)"))}
    wait = min(packio_feeds.items(), key=lambda kv: kv[1]["gpu_wait"]) if packio_feeds else None
    ratio = max(((k, r["naive_over_this"]) for k, r in packio_feeds.items() if r.get("naive_over_this")),
                key=lambda kv: kv[1], default=None)
    got = [("packio GPU decode + crop + flip + normalise", f">= {DALI_FLOOR:,} img/s (DALI's floor)",
            full[best] if best else None, lambda v: v >= DALI_FLOOR, "{:,.0f} img/s", best),
           ("packio GPU ÷ torchvision GPU pipeline", ">= 1.2", full[best] / tv if best and math.isfinite(tv) else None,
            lambda v: v >= 1.2, "{:.2f}", best),
           ("GPU waits for data, packio feed", "< 5 %", wait[1]["gpu_wait"] if wait else None,
            lambda v: v < 0.05, "{:.1%}", wait[0] if wait else None),
           ("epoch time naive ÷ packio", ">= 5", ratio[1] if ratio else None, lambda v: v >= 5, "{:.1f}",
            ratio[0] if ratio else None)]
    rows = [{"goal": g, "target": t, "got": v, "met": None if v is None else bool(ok(v)), "by": by}
            for g, t, v, ok, _, by in got]
    text = table(("goal", "target", "got", "met", "by"),
                 [(g, t, "not measured" if v is None else f.format(v), "-" if v is None else
                   ("yes" if ok(v) else "NO"), by or "") for g, t, v, ok, f, by in got], "## Goals")
    return rows, text


def profile(c: Ctx, res: dict[str, Any], out: Path) -> tuple[dict[str, Any], str]:
    """torch.profiler over 4 batches of packio's best full GPU pipeline: the kernels that take the time, and
    the GPU's busy share of the wall time (low: the host is the bottleneck). Trace: gpu-run-trace.json.gz."""
    import dataclasses

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as tprofile

    rows = res.get("decode", {}).get("rows", {})
    full = [k for k in rows if k.startswith("packio GPU") and "decode alone" not in k and "DataLoader" not in k]
    if not full:
        return {"status": "not run: no packio GPU pipeline was measured"}, "## 4. Profile\n\nnot run"
    name = max(full, key=lambda k: rows[k]["img_s"])
    small = dataclasses.replace(c, blobs=c.blobs[:4 * c.a.batch])
    pipe = pipelines(small)[name]()
    pipe.run()  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if c.dev.type == "cuda" else [])
    with tprofile(activities=acts) as prof:
        t0 = time.perf_counter()
        n = pipe.run()
        wall = time.perf_counter() - t0
    avg = prof.key_averages()
    dev_us = sum(e.self_device_time_total for e in avg if e.device_type == DeviceType.CUDA)
    key = "self_device_time_total" if c.dev.type == "cuda" else "self_cpu_time_total"
    top = avg.table(sort_by=key, row_limit=15)
    with gzip.open(out / "gpu-run-trace.json.gz", "wt") as f:
        tmp = out / ".trace.json"
        prof.export_chrome_trace(str(tmp))
        f.write(tmp.read_text())
        tmp.unlink()
    data = {"pipeline": name, "images": n, "img_s_profiled": n / wall, "gpu_kernel_share": dev_us / 1e6 / wall,
            "top": top}
    return data, (f"## 4. Profile: {name} ({n} images, {n / wall:.0f} img/s under the profiler; GPU kernel time "
                  f"{data['gpu_kernel_share']:.0%} of the wall time: low means the host is the bottleneck, over "
                  f"100 % means kernels overlapped on several streams)\n\n```\n{top}\n```")


def tests_text(t: dict[str, Any]) -> str:
    head = f"## 1. GPU tests: {t.get('status')}"
    if not t.get("tests"):
        return head + (f"\n\n```\n{t['tail']}\n```" if t.get("tail") else "")
    return (f"{head} ({t['counts']}, {t['seconds']} s)\n\n"
            + table(("test", "outcome"), [(k, cell(v)) for k, v in t["tests"].items()]))


def work_dir() -> str | None:
    """/dev/shm when it has room (the JPEGs then sit in memory, not on a disk), else the default temp dir."""
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 8 << 30 else None
    except OSError:
        return None


def setup(a: argparse.Namespace, rep: Report, work: Path) -> Ctx:
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rep.data["env"] = environment(dev)
    t0 = time.perf_counter()
    blobs = make_jpegs(a.images, a.jpeg_side)
    t1 = time.perf_counter()
    folder, csv_path, lmdb = write_data(blobs, work, a.workers or 1)
    sizes = [len(b) for b in blobs]
    rep.data["data"] = {"jpegs": len(blobs), "mean_kb": round(float(np.mean(sizes)) / 1e3, 1),
                        "made_s": round(t1 - t0, 1), "files_lmdb_s": round(time.perf_counter() - t1, 1),
                        "where": str(work), "shapes": f"{a.jpeg_side} px long side, 4:3, 3:4, 3:2; q90 4:2:0"}
    env = rep.data["env"]
    rep.md["head"] = (f"# Issue 40: the GPU run ({datetime.datetime.now().isoformat(timespec='seconds')})\n\n"
                      f"{env.get('gpu') or 'no GPU (dry run)'}, {env['cores']} cores; torch {env['torch']} "
                      f"(CUDA {env['cuda']}), torchvision {env['torchvision']}, nvImageCodec "
                      f"{env['nvidia.nvimgcodec']}; packio GPU backends: {env['packio_gpu_backends']}; packio CPU "
                      f"crop: {env['cpu_crop']}.\n{len(blobs)} JPEGs made on the spot ({rep.data['data']['shapes']}, "
                      f"mean {rep.data['data']['mean_kb']} KB) in {work}. DALI's published floor: "
                      f"{DALI_FLOOR:,} img/s (DALI itself cannot travel to this machine).")
    return Ctx(a, dev, blobs, folder, csv_path, lmdb)


def run_steps(a: argparse.Namespace, rep: Report, c: Ctx) -> None:
    """Steps 1-4, each within its budget; the report is saved after each."""
    budget = {name: secs for name, _, secs in PLAN}
    only = {s.strip() for s in a.steps_only.split(",") if s.strip()}
    res: dict[str, Any] = rep.data.setdefault("steps", {})
    for name in ("tests", "decode", "train"):
        if only and name not in only:
            continue
        print(f"== step {name} (budget {budget[name]} s)", flush=True)
        t0 = time.perf_counter()
        try:
            if name == "tests":
                files = [f for f in a.tests.split(",") if f.strip()]
                res["tests"] = run_tests(files, budget["tests"], Path(tempfile.mkdtemp(dir=c.folder.parent)))
                rep.md["tests"] = tests_text(res["tests"])
            elif name == "decode":
                res["decode"], rep.md["decode"] = measure_decode(c, budget["decode"])
            else:
                res["train"], rep.md["train"] = measure_train(c, budget["train"], res.get("decode", {}))
        except Exception as exc:  # noqa: BLE001 - one run on a lent machine: keep what the other steps measure
            res[name] = {"status": f"FAILED: {type(exc).__name__}: {exc}"}
            rep.md[name] = f"## {name}: FAILED: {cell(exc)}"
        rep.data.setdefault("timings", {})[name] = round(time.perf_counter() - t0, 1)
        rep.data["goals"], rep.md["goals"] = goals(res)
        rep.save()
    behind = [g for g in rep.data.get("goals", []) if g["met"] is False and "GPU" in g["goal"]]
    if "decode" in res and (a.profile or (behind and c.dev.type == "cuda" and (not only or "profile" in only))):
        t0 = time.perf_counter()
        try:
            res["profile"], rep.md["profile"] = profile(c, res, rep.out)
        except Exception as exc:  # noqa: BLE001 - the figures so far are kept
            res["profile"] = {"status": f"FAILED: {type(exc).__name__}: {exc}"}
            rep.md["profile"] = f"## 4. Profile: FAILED: {exc}"
        rep.data["timings"]["profile"] = round(time.perf_counter() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.plan:
        print(plan_text())
        return 0
    if a.fetch_wheels:
        return fetch_wheels(ROOT / ".whl")
    import torch

    if not torch.cuda.is_available() and not a.allow_cpu:
        print("gpu_run.py: no CUDA here; run it on the GPU machine (tools/README.md gives the device command), "
              "or pass --allow-cpu for the dry run", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rep = Report(Path(a.out))
    rep.data.update({"issue": 40, "argv": sys.argv[1:], "args": vars(a), "plan": PLAN,
                     "started": datetime.datetime.now().isoformat(timespec="seconds")})
    with tempfile.TemporaryDirectory(prefix="packio-gpu-run-", dir=work_dir()) as tmp:
        print("== setup", flush=True)
        c = setup(a, rep, Path(tmp))
        rep.data["timings"] = {"setup": round(time.perf_counter() - start, 1)}
        rep.save()
        run_steps(a, rep, c)
    rep.data["timings"]["total"] = round(time.perf_counter() - start, 1)
    rep.md["notes"] = (f"## Timings (s; the plan: {dict((n, s) for n, _, s in PLAN)})\n\n{rep.data['timings']}")
    rep.save()
    print(f"wrote {rep.out / 'gpu-run.json'} and {rep.out / 'gpu-run.md'} in {rep.data['timings']['total']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
