"""W3: training and evaluation recipes, packio's read-time geometry against the peers and the limits
(``python tools/w3.py COMMAND --help``).

    table   samples/s of the W3 rows (decode → random-resized crop 224 → flip → uint8 batches of 64)
            on original JPEGs and on JPEGs pre-resized to short side 256, and of evaluation (short side
            256 + center crop 224), every row a fresh process per round, × L3 / × its limit / × best peer
    decode  CPU µs per sample of the decode strategies for a crop window (full decode, DCT-scaled
            decode, libjpeg-turbo 3's crop-region decode when a libturbojpeg >= 3.0 is given), one thread

torchvision is not in packio's environment (and stays out of it): the "torchvision-style" row is
torchvision's default ImageNet recipe written out with its documented rule (PIL decode,
``RandomResizedCrop.get_params``'s window, PIL's bilinear resized crop, flip, PILToTensor) in a
torch DataLoader. FFCV runs under ``--ffcv-python`` (a Python with ffcv installed: the peers venv,
../shared/peers/README.md); without it its rows are left out. L3 (the issue's): decode + crop +
resize + flip of in-memory bytes in 2 processes, each image decoded whole; "L3 packio's decode" and
the other limits decode as packio does (DCT scaling; a crop region where libjpeg-turbo 3 is found).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fresh, interleaved, median, need, parser, subcommands, table  # noqa: E402

BATCH, SIZE, SHORT = 64, 224, 256
TRAIN = {"random_resized_crop": SIZE, "flip_p": 0.5}
EVAL = {"short_side": SHORT, "center_crop": SIZE}
# row name → (kind, data, extra config); data: "orig" or "256"
ROWS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "L3 full decode, 2 procs": ("limit", "orig", {"recipe": "train", "dct": False}),  # the L3
    "L3 packio's decode, 2 procs": ("limit", "orig", {"recipe": "train", "dct": True}),
    "packio nw=0": ("packio", "orig", {"recipe": "train", "nw": 0}),
    "packio nw=2": ("packio", "orig", {"recipe": "train", "nw": 2}),
    "torchvision-style nw=2": ("tv", "orig", {"nw": 2}),
    "ffcv RRC 2 threads": ("ffcv", "orig", {"decoder": "rrc"}),
    "L3 256, 2 procs": ("limit", "256", {"recipe": "train", "dct": True}),
    "packio 256 nw=0": ("packio", "256", {"recipe": "train", "nw": 0}),
    "packio 256 nw=2": ("packio", "256", {"recipe": "train", "nw": 2}),
    "ffcv 256 RRC 2 threads": ("ffcv", "256", {"decoder": "rrc"}),
    "eval limit, 2 procs": ("limit", "orig", {"recipe": "eval", "dct": True}),
    "packio eval nw=0": ("packio", "orig", {"recipe": "eval", "nw": 0}),
    "packio eval nw=2": ("packio", "orig", {"recipe": "eval", "nw": 2}),
    "ffcv eval center crop 2 threads": ("ffcv", "orig", {"decoder": "center"}),
}


def _recipe(name: str) -> dict[str, Any]:
    return dict(TRAIN if name == "train" else EVAL)


def _files(folder: str, n: int) -> list[str]:
    paths = sorted(str(p) for p in Path(folder).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    return paths[:n]


# ---------------------------------------------------------------- children (one row each)

def _cpu() -> float:
    """CPU seconds of this process and its live children (DataLoader or pool workers); nan without psutil."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a worker that just ended
            pass
    return total


def _loop(batches: Callable[[], Any], n: int, seconds: float) -> dict[str, float]:
    """Samples/s of taking batches (restarting the epoch) until ``n`` samples and ``seconds`` are
    done, and the CPU µs per sample all processes spent meanwhile (steadier on a busy machine)."""
    got, t0, c0 = 0, time.perf_counter(), _cpu()
    while got < n or time.perf_counter() - t0 < seconds:
        for b in batches():
            got += len(b[0]) if isinstance(b, (list, tuple)) else len(b["image"])
            if got >= n and time.perf_counter() - t0 >= seconds:
                break
    return {"rate": got / (time.perf_counter() - t0), "cpu_us": (_cpu() - c0) / got * 1e6}


def _warm(batches: Callable[[], Any], count: int = 3) -> None:
    for k, _ in enumerate(batches()):
        if k + 1 >= count:
            break


def _packio_row(cfg: dict[str, Any]) -> dict[str, float]:
    import packio

    ds = packio.open_dataset(cfg["path"], **_recipe(cfg["recipe"]))
    dl = packio.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=cfg["nw"],
                           persistent_workers=cfg["nw"] > 0)
    _warm(lambda: dl)
    return _loop(lambda: dl, cfg["n"], cfg["seconds"])


class TorchvisionStyle:
    """An image folder read the torchvision way: PIL decode, ``RandomResizedCrop(224)`` (its
    window rule: ``packio.geometry.random_resized_window`` is that rule, with a per-process
    ``random.Random`` for the draws, as torch's global RNG would be), PIL's bilinear resized
    crop (``F.resized_crop`` on PIL images), a flip with p=0.5, ``PILToTensor``."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.rng: Any = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import random

        import numpy as np
        import torch
        from PIL import Image

        from packio import geometry as geo

        if self.rng is None:
            self.rng = random.Random(os.getpid())
        with Image.open(self.paths[i]) as im:
            im = im.convert("RGB")
            u = [self.rng.random() for _ in range(4 * geo.ATTEMPTS)]
            top, left, h, w = geo.random_resized_window(im.height, im.width, u)
            im = im.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
        if self.rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1), 0


def _tv_row(cfg: dict[str, Any]) -> dict[str, float]:
    import torch

    dl = torch.utils.data.DataLoader(TorchvisionStyle(_files(cfg["folder"], cfg["n"])), batch_size=BATCH,
                                     shuffle=True, num_workers=cfg["nw"], persistent_workers=cfg["nw"] > 0)
    _warm(lambda: dl)
    return _loop(lambda: dl, cfg["n"], cfg["seconds"])


_BLOBS: list[bytes] = []  # a limit's in-memory bytes: set before its pool forks, so no worker is sent them


def _limit_part(start: int, recipe: dict[str, Any], dct: bool) -> int:
    """One process's share of a limit (every other image from ``start``): plan, decode the
    window, resize, flip, into one reused slot."""
    import numpy as np
    import simplejpeg

    from packio import decode as dec
    from packio import geometry as geo

    r, out = geo.Recipe(**recipe), np.empty((SIZE, SIZE, 3), np.uint8)
    for k in range(start, len(_BLOBS), 2):
        h, w = simplejpeg.decode_jpeg_header(_BLOBS[k])[:2]
        dec.decode_window(_BLOBS[k], geo.plan(r, h, w, 0, 0, k), out, dct=dct, region=dct)
    return len(range(start, len(_BLOBS), 2))


def _limit_row(cfg: dict[str, Any]) -> dict[str, float]:
    """In-memory bytes in 2 processes (forked after the bytes are read: only two numbers cross
    per pass), the same per-sample work with no reading or batching."""
    import cv2

    cv2.setNumThreads(1)  # as packio runs it
    _BLOBS[:] = [Path(p).read_bytes() for p in _files(cfg["folder"], cfg["n"])]
    recipe = _recipe(cfg["recipe"])
    with mp.get_context("fork").Pool(2) as pool:
        pool.starmap(_limit_part, [(i, recipe, cfg["dct"]) for i in range(2)])  # warm: imports, page faults
        got, t0, c0 = 0, time.perf_counter(), _cpu()
        while got < cfg["n"] or time.perf_counter() - t0 < cfg["seconds"]:
            got += sum(pool.starmap(_limit_part, [(i, recipe, cfg["dct"]) for i in range(2)]))
        return {"rate": got / (time.perf_counter() - t0), "cpu_us": (_cpu() - c0) / got * 1e6}


def _ffcv_row(cfg: dict[str, Any]) -> dict[str, float]:
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.decoders import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    if cfg["decoder"] == "rrc":
        image = [RandomResizedCropRGBImageDecoder((SIZE, SIZE)), RandomHorizontalFlip(), ToTensor(),
                 ToTorchImage(channels_last=False)]
    else:
        image = [CenterCropRGBImageDecoder((SIZE, SIZE), ratio=SIZE / SHORT), ToTensor(),
                 ToTorchImage(channels_last=False)]
    dl = Loader(cfg["path"], batch_size=BATCH, num_workers=2, order=OrderOption.RANDOM, os_cache=True,
                pipelines={"image": image, "label": [IntDecoder(), ToTensor()]})
    _warm(lambda: dl, 6)  # numba compiles the pipeline on first use
    return _loop(lambda: dl, cfg["n"], cfg["seconds"])


def _ffcv_pack(cfg: dict[str, Any]) -> dict[str, float]:
    """Write FFCV's .beton of the folder: JPEG q90 of the originals, or pre-resized to short side 256
    (cv2 INTER_AREA, as packio's --short-side), as the peers harness packs them."""
    import cv2
    import numpy as np
    import torch
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    paths, short = _files(cfg["folder"], cfg["n"]), cfg.get("short_side")

    class Src(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
            a = cv2.cvtColor(cv2.imread(paths[i], cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
            if short:
                h, w = a.shape[:2]
                s = short / min(h, w)
                a = cv2.resize(a, (max(1, round(w * s)), max(1, round(h * s))), interpolation=cv2.INTER_AREA)
            return a, 0

    tmp = cfg["path"] + ".tmp"
    DatasetWriter(tmp, {"image": RGBImageField(write_mode="jpg", max_resolution=None, jpeg_quality=90),
                        "label": IntField()}, num_workers=2).from_indexed_dataset(Src())
    os.replace(tmp, cfg["path"])
    return {"rate": 1.0}


def child(argv: list[str]) -> int:
    cfg = json.loads(argv[argv.index("--child") + 1])
    fn = {"packio": _packio_row, "tv": _tv_row, "limit": _limit_row, "ffcv": _ffcv_row,
          "ffcv-pack": _ffcv_pack}[cfg["kind"]]
    print(json.dumps(fn(cfg)))
    return 0


# ---------------------------------------------------------------- table

def _pack(a: Any) -> dict[str, str]:
    """The datasets the rows read, packed once under --work (kept between runs)."""
    import packio

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    paths = {"orig": str(work / "orig.lmdb"), "256": str(work / "pre256.lmdb"),
             "ffcv-orig": str(work / "orig.beton"), "ffcv-256": str(work / "pre256.beton")}
    src = work / "src"
    if not src.exists():  # the first --n images, as a folder of links packio packs
        src.mkdir()
        for k, f in enumerate(_files(a.data, a.n)):
            (src / f"{k:07d}.jpg").symlink_to(Path(f).resolve())
    if not Path(paths["orig"]).exists():
        packio.convert(str(src), paths["orig"], progress=False, follow_symlinks=True)
    if not Path(paths["256"]).exists():
        packio.convert(str(src), paths["256"], progress=False, follow_symlinks=True,
                       resize=packio.ResizeSpec(short_side=SHORT), encode="jpeg", quality=90)
    for key, short in (("ffcv-orig", None), ("ffcv-256", SHORT)):
        if a.ffcv_python and not Path(paths[key]).exists():
            got = fresh(__file__, {"kind": "ffcv-pack", "folder": str(src), "n": a.n, "path": paths[key],
                                   "short_side": short}, python=a.ffcv_python)
            if "error" in got:
                raise SystemExit(f"w3.py: packing FFCV's {key} failed: {got['error']}")
    return paths


def _case(a: Any, name: str, paths: dict[str, str], cpu: dict[str, list[float]]) -> Callable[[], float]:
    kind, data, extra = ROWS[name]
    cfg = {"kind": kind, "n": a.n, "seconds": a.seconds, **extra}
    if kind == "packio":
        cfg["path"] = paths[data]
    elif kind == "ffcv":
        cfg["path"] = paths["ffcv-" + data]
    else:  # in-memory limits and the torchvision-style folder read the bytes each dataset holds
        cfg["folder"] = str(Path(a.work) / ("src" if data == "orig" else "src256"))
    python = a.ffcv_python if kind == "ffcv" else None
    env = {"PACKIO_LIBTURBOJPEG": a.turbojpeg_lib} if a.turbojpeg_lib else None

    def run() -> float:
        got = fresh(__file__, cfg, env=env, python=python)
        if "error" in got:
            print(f"{name}: {got['error']}", file=sys.stderr)
        cpu.setdefault(name, []).append(float(got.get("cpu_us", "nan")))
        return float(got.get("rate", "nan"))

    return run


def _src256(a: Any, paths: dict[str, str]) -> None:
    """The pre-resized JPEGs as files (the 256 limit reads these bytes): written once from the packed set."""
    import packio

    out = Path(a.work) / "src256"
    if out.exists():
        return
    tmp = Path(a.work) / "src256.tmp"
    tmp.mkdir(exist_ok=True)
    reader = packio.open_reader(paths["256"])
    for i in range(len(reader)):
        (tmp / f"{i:07d}.jpg").write_bytes(bytes(reader.read(i).payload))
    tmp.rename(out)


def _limit_of(name: str) -> str:
    kind, data, extra = ROWS[name]
    if extra.get("recipe") == "eval" or extra.get("decoder") == "center":
        return "eval limit, 2 procs"
    return {"orig": "L3 full decode, 2 procs", "256": "L3 256, 2 procs"}[data]


def _ratios(names: list[str], got: dict[str, float], cpu: dict[str, float]) -> list[list[Any]]:
    """Rows with × their limit, × the best peer of the same data, and CPU µs per sample with
    the limit's CPU per sample ÷ the row's (the share of the row's CPU the bare work takes)."""
    def best(data: str) -> float:
        peers = [got[n] for n in names if ROWS[n][0] in ("tv", "ffcv") and ROWS[n][1] == data
                 and "eval" not in n and "center" not in n]
        return max((v for v in peers if math.isfinite(v)), default=float("nan"))

    def fmt(v: float, spec: str) -> str:
        return format(v, spec) if math.isfinite(v) else ""

    rows = []
    for n in names:
        kind, data, extra = ROWS[n]
        lim = got.get(_limit_of(n), float("nan"))
        peer = best(data) if extra.get("recipe", "train") == "train" and kind == "packio" else float("nan")
        mine, cpu_lim = cpu.get(n, float("nan")), cpu.get(_limit_of(n), float("nan"))
        share = cpu_lim / mine if mine > 0 else float("nan")  # 0: a run shorter than the CPU clock's tick
        rows.append([n, f"{got[n]:,.0f}", fmt(got[n] / lim, ".2f"), fmt(got[n] / peer, ".2f"), fmt(mine, ",.0f"),
                     fmt(share, ".2f")])
    return rows


def table_cmd(argv: list[str]) -> int:
    """The W3 rows, each a fresh process per round, interleaved rounds, medians.

        python tools/w3.py table --data ../shared/data/... --ffcv-python /tmp/peers-venv/bin/python
        python tools/w3.py table --rows "packio nw=0" "L3 full decode, 2 procs" --n 64 --rounds 1
    """
    ap = parser(table_cmd.__doc__)
    ap.add_argument("--data", help="a folder of JPEGs (class folders or flat); default: generated photos")
    ap.add_argument("--work", default="/tmp/packio-w3", help="where the packed sets are kept (/tmp/packio-w3)")
    ap.add_argument("--n", type=int, default=2000, help="images used, and samples timed per row (2000)")
    ap.add_argument("--seconds", type=float, default=3.0, help="minimum seconds timed per row (3)")
    ap.add_argument("--ffcv-python", help="a Python with ffcv installed (the peers venv); else FFCV rows are skipped")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), help="rows to run (default: all that can run)")
    ap.add_argument("--turbojpeg-lib", help="a libturbojpeg >= 3.0 packio's rows and \"L3 packio's decode\" use "
                                             "(PACKIO_LIBTURBOJPEG); the other limits decode whole images")
    a = ap.parse_args(argv)
    if a.data is None:
        from packio.bench.synth import make_photo_folder

        a.data = str(make_photo_folder(Path(a.work) / "generated", a.n)[0])
    need(_files(a.data, a.n), f"JPEG under {a.data}", "pass a folder of JPEGs to --data")
    names = [n for n in (a.rows or ROWS) if a.ffcv_python or ROWS[n][0] != "ffcv"]
    paths = _pack(a)
    _src256(a, paths)
    cpu: dict[str, list[float]] = {}
    got = {k: median(v) for k, v in interleaved({n: _case(a, n, paths, cpu) for n in names}, a.rounds).items()}
    lib = f"; libjpeg-turbo 3: {a.turbojpeg_lib}" if a.turbojpeg_lib else ""
    table(["row", "samples/s", "× limit", "× best peer", "CPU µs/sample", "limit CPU ÷ CPU"],
          _ratios(names, got, {k: median(v) for k, v in cpu.items()}),
          title=f"W3, {min(a.n, len(_files(a.data, a.n)))} images, batches of {BATCH}, medians of {a.rounds} rounds"
                + lib)
    return 0


# ---------------------------------------------------------------- decode strategies

class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


def crop_region_decoder(lib_path: str | None) -> Callable[..., Any] | None:
    """``fn(jpeg, plan, out)`` decoding only the plan's window with libjpeg-turbo 3's TurboJPEG API
    (``tj3SetCroppingRegion``: IDCT and colour conversion of the window's columns only, rows
    below it not read), then packio's resize and flip; None when no libturbojpeg >= 3.0 is found
    (Debian 12 ships 2.1.5). Measuring only: packio itself does not use it (see --help)."""
    path = lib_path or ctypes.util.find_library("turbojpeg")
    try:
        lib = ctypes.CDLL(path) if path else None
        lib.tj3SetCroppingRegion  # noqa: B018  (a 2.x library lacks the TurboJPEG 3 API)
    except (OSError, AttributeError):
        return None
    from packio import decode as dec

    lib.tj3Init.restype, lib.tj3Init.argtypes = ctypes.c_void_p, [ctypes.c_int]
    lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, _Region]
    lib.tj3Decompress8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_int]
    handle = lib.tj3Init(1)  # TJINIT_DECOMPRESS; one thread uses it
    mcu = {0: 8, 1: 16, 2: 16, 3: 8, 4: 8, 5: 32, 6: 8}  # iMCU width per TJSAMP_*

    def decode(data: bytes, p: Any, out: Any) -> Any:
        import numpy as np

        if lib.tj3DecompressHeader(handle, data, len(data)) != 0:
            raise ValueError("not a JPEG libturbojpeg reads")
        step = mcu.get(lib.tj3Get(handle, 4), 32)  # TJPARAM_SUBSAMP
        x = p.left // step * step  # the region's left edge on the iMCU grid
        buf = np.empty((p.height, p.left + p.width - x, 3), np.uint8)
        lib.tj3SetCroppingRegion(handle, _Region(x, p.top, buf.shape[1], p.height))
        if lib.tj3Decompress8(handle, data, len(data), buf.ctypes.data, 0, 0) != 0:  # TJPF_RGB
            raise ValueError("libturbojpeg could not decode the region")
        lib.tj3SetCroppingRegion(handle, _Region(0, 0, 0, 0))
        crop = p._replace(top=0, left=p.left - x, stored_h=p.height, stored_w=buf.shape[1])
        return dec.decode_window(buf, crop, out)

    return decode


def decode_cmd(argv: list[str]) -> int:
    """CPU µs per sample (this thread's CPU time) of each way to decode a crop window, on
    in-memory bytes: the same plans for every strategy, interleaved rounds, medians.

        python tools/w3.py decode --data DIR [--turbojpeg-lib /path/libturbojpeg.so.0]
    """
    import numpy as np
    import simplejpeg

    from packio import decode as dec
    from packio import geometry as geo

    ap = parser(decode_cmd.__doc__, rounds=5)
    ap.add_argument("--data", required=True, help="a folder of JPEGs")
    ap.add_argument("--n", type=int, default=400, help="images (400)")
    ap.add_argument("--turbojpeg-lib", help="a libturbojpeg >= 3.0 for the crop-region row (default: the system's)")
    a = ap.parse_args(argv)
    blobs = [Path(p).read_bytes() for p in _files(a.data, a.n)]
    need(blobs, f"JPEG under {a.data}", "pass a folder of JPEGs to --data")
    region = crop_region_decoder(a.turbojpeg_lib)
    out, rows = np.empty((SIZE, SIZE, 3), np.uint8), []
    for name in ("train", "eval"):
        r = geo.Recipe(**_recipe(name))
        plans = [geo.plan(r, *simplejpeg.decode_jpeg_header(b)[:2], 0, 0, i) for i, b in enumerate(blobs)]
        ways: dict[str, Callable[[bytes, Any], Any]] = {
            "full decode + crop + resize": lambda b, p: dec.decode_window(b, p, out, dct=False),
            "DCT-scaled decode (packio)": lambda b, p: dec.decode_window(b, p, out)}
        if region is not None:
            ways["crop-region decode (tj3)"] = lambda b, p: region(b, p, out)

        def timed(fn: Callable[[bytes, Any], Any]) -> Callable[[], float]:
            def run() -> float:
                t = time.thread_time()
                for b, p in zip(blobs, plans):
                    fn(b, p)
                return (time.thread_time() - t) / len(blobs) * 1e6
            return run

        cases = {k: timed(f) for k, f in ways.items()}
        cases["plan alone"] = lambda: _plan_us(r, plans)
        got = {k: median(v) for k, v in interleaved(cases, a.rounds, progress=False).items()}
        base = got["full decode + crop + resize"]
        rows += [[name, k, f"{v:,.0f}", f"{base / v:.2f}" if "plan" not in k else ""] for k, v in got.items()]
    table(["recipe", "strategy", "CPU µs/sample", "× full"], rows,
          title=f"crop-window decode, {len(blobs)} JPEGs, one thread"
                + ("" if region else " (no libturbojpeg >= 3.0 found: no crop-region row)"))
    return 0


def _plan_us(r: Any, plans: list[Any]) -> float:
    from packio import geometry as geo

    t = time.thread_time()
    for i, p in enumerate(plans):
        geo.plan(r, p.stored_h, p.stored_w, 0, 0, i)
    return (time.thread_time() - t) / len(plans) * 1e6


def main() -> int:
    if "--child" in sys.argv:
        return child(sys.argv)
    return subcommands({"table": table_cmd, "decode": decode_cmd}, __doc__)


if __name__ == "__main__":
    sys.exit(main())
