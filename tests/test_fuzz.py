"""Fuzz every file of a small dataset of every format: bit flips, truncations, header
fields (binary integers, tar size fields, .npy shapes, JSON numbers).

Each mutated dataset is opened and read in a child process under an address-space
limit and a timeout. Allowed outcomes: a packio error, or the original data. Data that
differs from the original is allowed only where ``packio.verify`` reports the dataset
as damaged (a flipped label in a record, say, is only caught by the file checksums).
Anything else (another exception, a crash, a hang, a blow-up) fails the test and
names the case, which replays deterministically from its seed.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

import packio
from conftest import jpeg, photo, run_child_cases

AS_LIMIT = 3 << 30
PER_FILE = {"flip": 5, "truncate": 3, "int": 4, "field": 4}  # mutations of each kind, per file
FORMATS = {"lmdb": {}, "h5": {}, "h5fixed": {"resize": (24, 32)}, "wds": {}, "bmpdir": {"short_side": 20},
           "arrays": {"resize": (24, 32)}}

CHILD = r"""
import json, os, re, resource, shutil, sys, time
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]),) * 2)
from pathlib import Path
import numpy as np
import packio
from packio import decode as dec
from packio.errors import PackioError
from packio.formats import open_reader
from packio.sample import checksum

spec = json.load(open(sys.argv[1]))
scratch = Path(spec["scratch"])


def snapshot(path):
    # what a reader hands out: per sample (key, label, boxes, box labels, payload), and
    # the whole-batch path of fixed-shape formats
    r = open_reader(path)
    out = []
    for i in range(len(r)):
        s = r.read(i)
        if s.checksum and checksum(s.payload) != s.checksum:  # verify=True readers raise here
            raise packio.CorruptSampleError(s.key, "checksum mismatch")
        if not isinstance(s.payload, np.ndarray):
            dec.decode(s.payload, strict=True)  # verify=True readers decode strictly
        payload = s.payload.tobytes() if isinstance(s.payload, np.ndarray) else bytes(s.payload)
        out.append([s.key, int(s.label), np.asarray(s.boxes).tolist(), np.asarray(s.box_labels).tolist(),
                    payload.hex()])
    batch = r.read_batch(list(range(len(r)))) if len(r) else None
    if batch is not None and batch.pixels is not None:
        out.append(["batch", batch.keys, batch.labels.tolist(), batch.boxes.tolist(), batch.counts.tolist(),
                    batch.box_labels.tolist(), batch.pixels.tobytes().hex()])
    r.close()
    return out


def lenient(path):
    # the default read path: no checksum, lenient decode; only errors are checked
    r = open_reader(path)
    for i in range(len(r)):
        try:
            s = r.read(i)
        except PackioError:
            continue
        if not isinstance(s.payload, np.ndarray):
            try:
                dec.decode(s.payload)
            except ValueError:  # what the datasets turn into CorruptSampleError
                pass
    r.close()


def mutate(path, m):
    rng = np.random.default_rng(m["seed"])
    data = bytearray(path.read_bytes())
    n = len(data)
    kind = m["kind"]
    if kind == "flip" and n:
        for _ in range(int(rng.integers(1, 9))):
            data[int(rng.integers(n))] ^= 1 << int(rng.integers(8))
    elif kind == "truncate":
        data = data[: int(rng.integers(0, max(n, 1)))]
    elif kind == "int" and n >= 8:
        width = int(rng.choice([2, 4, 8]))
        at = int(rng.integers(0, min(n, 8192) - width + 1))
        value = int(rng.choice([0, 1, 2**15, 2**31 - 1, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]))
        data[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    elif kind == "field":
        text = bytes(data)
        big = [b"1000000000000", b"0", b"-1", b"9223372036854775807", b"4294967296", b"3"]
        pick = big[int(rng.integers(len(big)))]
        if path.suffix == ".npy" and text.startswith(b"\x93NUMPY"):  # a number in the header's shape
            end = text.index(b"\n")
            nums = [mm for mm in re.finditer(rb"\d+", text[:end]) if text.rfind(b"shape", 0, mm.start()) >= 0]
        elif path.name == "packio.json":
            nums = list(re.finditer(rb"-?\d+", text))
        elif path.suffix == ".tar":  # the octal size field (offset 124, 12 bytes) of one member header
            heads = [h for h in range(0, n - 512, 512) if text[h + 257:h + 262] == b"ustar"]
            if heads:
                h = heads[int(rng.integers(len(heads)))]
                octal = b"%011o\0" % (int(pick) % 8**11) if pick != b"-1" else b"77777777777\0"
                data[h + 124:h + 136] = octal
            nums = []
        else:  # binary: little-endian 8-byte integers at aligned places
            nums = []
            if n >= 8:
                at = int(rng.integers(0, min(n, 8192) // 8)) * 8
                data[at:at + 8] = (int(pick) % 2**64).to_bytes(8, "little")
        if nums:
            mm = nums[int(rng.integers(len(nums)))]
            data[mm.start():mm.end()] = pick
    path.write_bytes(bytes(data))


originals = {}
for fmt, pristine in spec["datasets"].items():
    originals[fmt] = json.loads(json.dumps(snapshot(pristine)))

for case in spec["cases"]:
    print("START", case["name"], flush=True)
    t0 = time.process_time()  # CPU time, all threads: the work a case costs, whatever else the machine runs
    pristine = Path(spec["datasets"][case["format"]])
    work = scratch / ("w" + pristine.suffix)
    if work.is_dir():
        shutil.rmtree(work)
    elif work.exists():
        work.unlink()
    (shutil.copytree if pristine.is_dir() else shutil.copy)(pristine, work)
    mutate(work / case["file"] if case["file"] else work, case)
    out = {"name": case["name"]}
    try:
        got = json.loads(json.dumps(snapshot(work)))
        out["outcome"] = "same" if got == originals[case["format"]] else "different"
    except PackioError as exc:
        out["outcome"] = "packio error"
        out["msg"] = str(exc)[:200]
    except Exception as exc:
        out["outcome"] = "OTHER " + type(exc).__name__
        out["msg"] = str(exc)[:300]
    if out["outcome"] in ("same", "different", "packio error"):
        try:
            lenient(work)
        except PackioError:
            pass
        except Exception as exc:
            out["outcome"] = "OTHER (lenient read) " + type(exc).__name__
            out["msg"] = str(exc)[:300]
    try:
        out["verify_ok"] = packio.verify(work).ok
    except PackioError:
        out["verify_ok"] = False
    except Exception as exc:
        out["outcome"] = "OTHER (verify) " + type(exc).__name__
        out["msg"] = str(exc)[:300]
    out["cpu_s"] = time.process_time() - t0
    print("RESULT", json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """Tiny datasets of every format (3 JPEGs and a PNG, with boxes), packed once."""
    import cv2

    base = tmp_path_factory.mktemp("fuzz")
    src = base / "src"
    for k in range(3):
        (src / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"c{k % 2}" / f"{k}.jpg").write_bytes(jpeg(24 + 4 * k, 32, seed=k))
    (src / "c1" / "p.png").write_bytes(cv2.imencode(".png", photo(20, 28, 9))[1].tobytes())
    (base / "b.csv").write_text("filename,class,xmin,ymin,xmax,ymax\n0.jpg,x,1,2,10,12\n0.jpg,y,3,3,5,6\n"
                                "p.png,x,0,0,4,4\n")
    out = {}
    for name, opt in FORMATS.items():
        resize = None
        if "resize" in opt:
            resize = packio.ResizeSpec(size=opt["resize"])
        elif "short_side" in opt:
            resize = packio.ResizeSpec(short_side=opt["short_side"])
        suffix = ".h5" if name.startswith("h5") else "." + name
        out[name] = Path(packio.convert(src, base / f"{name}{suffix}", csv=base / "b.csv", resize=resize,
                                        progress=False).output)
    return out


def _cases(pristine: dict[str, Path]) -> list[dict]:
    cases = []
    for fmt, path in sorted(pristine.items()):
        files = [""] if path.is_file() else sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                                                   if p.is_file() and p.name != "lock.mdb")
        for f in files:
            for kind, n in PER_FILE.items():
                extra = 3 if fmt.startswith("h5") else 1  # one file holds all of HDF5's structures
                for k in range(n * extra):
                    name = f"{fmt}:{f or '(file)'}:{kind}:{k}"
                    cases.append({"name": name, "format": fmt, "file": f, "kind": kind,
                                  "seed": zlib.crc32(name.encode())})
    return cases


def test_fuzz_every_file_of_every_format(pristine, tmp_path):
    cases = _cases(pristine)
    spec = tmp_path / "spec.json"
    (tmp_path / "scratch").mkdir()
    spec.write_text(json.dumps({"datasets": {k: str(v) for k, v in pristine.items()}, "cases": cases,
                                "scratch": str(tmp_path / "scratch")}))
    results, started, how = run_child_cases(CHILD, [str(spec), str(AS_LIMIT)], timeout=240)
    assert len(results) == len(cases), f"stopped during case {started!r}: {how}"
    bad = [r for r in results.values() if r["outcome"].startswith("OTHER") or r["cpu_s"] > 10
           or (r["outcome"] == "different" and r["verify_ok"])]
    assert not bad, "\n".join(json.dumps(r) for r in bad[:20])
    outcomes = {}
    for r in results.values():
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    print(len(cases), "cases:", outcomes)
    assert outcomes.get("packio error", 0) > len(cases) // 4, outcomes  # the mutations do bite
