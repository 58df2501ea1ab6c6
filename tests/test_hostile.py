"""Hostile inputs, each small: every one ends in a clear packio error or a counted skip,
in bounded time and memory, never a hang, a crash or a blow-up.

The risky cases run in one child process with an address-space limit (RLIMIT_AS) and
a timeout; the child reports, per case, the exception (or result), the time taken and
the growth of its resident memory. A case that blew up would show as MemoryError (the
limit) or as a message other than the specific one asserted here.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest

import packio
from conftest import SHARED, jpeg, photo, run_child_cases, sealed
from packio import limits

AS_LIMIT = 3 << 30  # the child's address space: far below any of the blow-ups
MAX_GROWTH_MB = 400  # resident memory a case may add in the child

CHILD = r"""
import json, resource, sys, time, traceback
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]),) * 2)
import numpy as np
import packio
import packio.read.datasets  # torch: imported before the cases, so its memory is not counted in theirs
from packio.errors import PackioError


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024


def act(case):
    kind, path, kw = case["action"], case["path"], case.get("kw", {})
    if "resize" in kw:
        kw["resize"] = packio.ResizeSpec(**kw["resize"])
    if kind == "read":  # every sample, through the map-style dataset
        ds = packio.open_dataset(path, **kw)
        return [None if x is None else x["key"] for x in (ds[i] for i in range(len(ds)))]
    if kind == "verify":
        return packio.verify(path).ok
    if kind == "reader_batch":  # the whole-batch path of fixed-shape formats
        from packio.formats import open_reader
        r = open_reader(path)
        return r.read_batch(list(range(len(r)))).keys
    if kind == "convert":
        s = packio.convert(path, case["dst"], progress=False, **kw)
        return {"packed": s.packed, "skipped": dict(s.skipped)}
    if kind == "truncate_under_reader":
        ds = packio.open_dataset(path, decode=False)
        ds[0]
        with open(case["victim"], "r+b") as f:
            f.truncate(case["keep"])
        return [ds[i]["key"] for i in range(len(ds))]
    raise ValueError(kind)


for case in json.load(open(sys.argv[1])):
    print("START", case["name"], flush=True)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident size
    except OSError:
        pass
    before, t0 = status("VmRSS:"), time.process_time()  # CPU time: the work done, whatever else the machine runs
    out = {"name": case["name"]}
    try:
        out["value"] = act(case)
    except BaseException as exc:
        out.update(error=type(exc).__name__, packio=isinstance(exc, PackioError), msg=str(exc)[:600],
                   tb=traceback.format_exc()[-1500:])
    out.update(cpu_s=time.process_time() - t0, growth_mb=status("VmHWM:") - before)
    print("RESULT", json.dumps(out, default=str), flush=True)
"""


def run_cases(cases: list[dict], tmp: Path, timeout: float = 300) -> dict[str, dict]:
    """Run the cases in one limited child; a crash or hang leaves the rest unreported."""
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    results, started, how = run_child_cases(CHILD, [str(spec), str(AS_LIMIT)], timeout)
    for case in cases:
        if case["name"] not in results:
            crashed = started == case["name"]
            results[case["name"]] = {"name": case["name"], "error": "CHILD " + ("crashed" if crashed else "never ran"),
                                     "msg": how, "packio": False}
    return results


def expect(r: dict, error: str, pattern: str) -> None:
    """A packio error of this class and message, in bounded work (CPU time) and memory."""
    import re

    assert r.get("error") == error and r.get("packio"), r
    assert re.search(pattern, r["msg"]), r
    assert r["cpu_s"] < 60 and r["growth_mb"] < MAX_GROWTH_MB, r


def bounded(r: dict) -> None:
    assert "error" not in r, r
    assert r["cpu_s"] < 60 and r["growth_mb"] < MAX_GROWTH_MB, r


# ---------------------------------------------------------------- fixtures: small real datasets


def _real_jpegs(n: int) -> list[bytes]:
    """n JPEGs from the real photo set (generated ones when it is absent)."""
    root = SHARED / "hymenoptera" / "hymenoptera_data" / "train" / "ants"
    files = sorted(root.glob("*.jpg"))[:n] if root.is_dir() else []
    out = [f.read_bytes() for f in files if f.stat().st_size < 150_000]
    return out + [jpeg(60 + 5 * k, 80, seed=k) for k in range(n - len(out))]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Small datasets of every format, each then damaged in one way; plus hostile sources."""
    import cv2

    base = tmp_path_factory.mktemp("hostile")
    src = base / "src"
    for k, data in enumerate(_real_jpegs(6)):
        (src / ("ants" if k % 2 else "bees")).mkdir(parents=True, exist_ok=True)
        (src / ("ants" if k % 2 else "bees") / f"{k}.jpg").write_bytes(data)
    ok, png = cv2.imencode(".png", photo(30, 40, 5))
    (src / "bees" / "p.png").write_bytes(png.tobytes())

    def pack(name: str, **kw) -> Path:
        return Path(packio.convert(src, base / name, progress=False, **kw).output)

    fixed = {"resize": packio.ResizeSpec(size=(32, 48))}
    cases: list[dict] = []

    def case(name: str, action: str, path: Path, **extra) -> None:
        cases.append({"name": name, "action": action, "path": str(path), **extra})

    # FIFOs in place of data files: refused without blocking (ds[0] and verify)
    for fmt, suffix, victim, kw in (("bmp", ".bmpdir", "images/000000/0000000000.bmp", {"resize": packio.ResizeSpec(short_side=32)}),
                                    ("tar", ".wds", "shard-000000.tar", {}), ("lmdb", ".lmdb", "data.mdb", {}),
                                    ("arrays", ".arrays", "images.npy", fixed), ("bmprec", ".bmpdir", "records.bin",
                                                                                 {"resize": packio.ResizeSpec(short_side=32)})):
        p = pack(f"fifo_{fmt}{suffix}", **kw)
        (p / victim).unlink()
        os.mkfifo(p / victim)
        case(f"fifo_{fmt}_read", "read", p, kw={"decode": False})
        case(f"fifo_{fmt}_verify", "verify", p)

    # truncated under an open reader (LMDB and arrays read through memory maps: SIGBUS)
    for fmt, suffix, victim, kw in (("lmdb", ".lmdb", "data.mdb", {}), ("arrays", ".arrays", "images.npy", fixed)):
        p = pack(f"trunc_{fmt}{suffix}", **kw)
        case(f"truncated_under_reader_{fmt}", "truncate_under_reader", p, victim=str(p / victim), keep=8192)

    # crafted LMDB pages: a node claiming a 2 GB value; meta pages claiming pages past the file
    p = pack("node.lmdb")
    data = bytearray((p / "data.mdb").read_bytes())
    at = data.find(b"0000000003")
    assert struct.unpack_from("<H", data, at - 2)[0] == 10  # mn_ksize: this is the leaf node
    data[at - 8:at - 4] = struct.pack("<HH", 0xFFFF, 0x7FFF)  # mn_lo, mn_hi: the value's size
    (p / "data.mdb").write_bytes(bytes(data))
    case("lmdb_node_size", "read", p, kw={"decode": False})
    p = pack("meta.lmdb")
    data = bytearray((p / "data.mdb").read_bytes())
    psize = 4096
    for page in (0, psize):  # MDB_meta.mm_last_pg: page header 16 + magic/version/address/mapsize 24 + 2 dbs of 48
        assert struct.unpack_from("<Q", data, page + 136)[0] < len(data) // psize
        data[page + 136:page + 144] = struct.pack("<Q", 10_000)  # pages up to 40 MB, in a file of kilobytes
    (p / "data.mdb").write_bytes(bytes(data))
    case("lmdb_meta_last_page", "read", p, kw={"decode": False})

    # a manifest count of 10**12, in every format
    for fmt, suffix, kw in (("lmdb", ".lmdb", {}), ("tar", ".wds", {}), ("bmp", ".bmpdir", {"resize": packio.ResizeSpec(short_side=32)}),
                            ("arrays", ".arrays", fixed)):
        p = pack(f"count_{fmt}{suffix}", **kw)
        m = json.loads((p / "packio.json").read_text())
        m["count"] = 10**12
        (p / "packio.json").write_text(json.dumps(sealed(m)))
        case(f"count_{fmt}", "read", p)
    import h5py

    p = pack("count.h5")
    with h5py.File(p, "r+") as f:
        m = json.loads(f.attrs["packio_manifest"])
        m["count"] = 10**12
        f.attrs["packio_manifest"] = json.dumps(sealed(m))
    case("count_hdf5", "read", p)

    # lying .npy headers: labels claiming 10**12 rows; records index claiming more than its file
    p = pack("npy_labels.arrays", **fixed)
    n = json.loads((p / "packio.json").read_text())["count"]
    _npy_shape(p / "labels.npy", f"({n},)", "(1000000000000,)")
    case("npy_labels_header", "reader_batch", p)
    case("npy_labels_header_dataset", "read", p, kw={"decode": False})
    p = pack("npy_idx.bmpdir", resize=packio.ResizeSpec(short_side=32))
    _npy_shape(p / "records.idx.npy", f"({n + 1},)", f"({n + 2},)")
    m = json.loads((p / "packio.json").read_text())
    m["count"] = n + 1
    (p / "packio.json").write_text(json.dumps(sealed(m)))
    case("npy_idx_header", "read", p)

    # tar index sizes of 2**40, and an offset past the shard's end
    p = pack("index40.wds")
    idx = np.load(p / "index.npy")
    idx[2, 2] = 1 << 40
    np.save(p / "index.npy", idx)
    case("tar_index_2_40", "read", p, kw={"decode": False})
    p = pack("index_off.wds")
    idx = np.load(p / "index.npy")
    idx[2, 1] = 1 << 30
    np.save(p / "index.npy", idx)
    case("tar_index_offset", "read", p, kw={"decode": False, "on_error": "skip"})

    # foreign shards: a GNU sparse member claiming 1 GiB; a 10 KB shard whose .cls says 10**12
    if shutil.which("tar"):
        d = base / "sparse_src"
        d.mkdir()
        with open(d / "0.jpg", "wb") as f:
            f.write(jpeg(20, 20, 1))
            f.truncate(1 << 30)
        (base / "sparse").mkdir()
        subprocess.run(["tar", "-S", "-cf", str(base / "sparse" / "shard-0.tar"), "0.jpg"], cwd=d, check=True)
        (d / "0.jpg").unlink()
        case("tar_gnu_sparse", "read", base / "sparse")
    (base / "cls").mkdir()
    with tarfile.open(base / "cls" / "shard-0.tar", "w") as tf:
        for name, blob in (("0.jpg", jpeg(20, 20, 1)), ("0.cls", b"1000000000000")):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tf.addfile(info, io.BytesIO(blob))
    case("tar_cls_1e12", "read", base / "cls")

    # HDF5 declared shapes: datasets claiming 2**40 bytes in a file of kilobytes
    for name, dtype in (("records", "u1"), ("images_bytes", "u1"), ("record_offsets", "i8")):
        p = pack(f"shape_{name}.h5")
        with h5py.File(p, "r+") as f:
            del f[name]
            f.create_dataset(name, shape=(1 << 40,), dtype=dtype, chunks=(1 << 16,))
        case(f"hdf5_shape_{name}", "read", p)
    p = pack("shape_images.h5", **fixed)
    with h5py.File(p, "r+") as f:
        n = len(f["images"])
        del f["images"]
        f.create_dataset("images", shape=(n, 40000, 40000, 3), dtype="u1", chunks=(1, 64, 64, 3))
    case("hdf5_shape_images", "read", p)

    # image bombs stored in a dataset: a PNG that is 5.4 GB decoded, a JPEG claiming 65000²
    bombs = base / "bombs_src" / "x"
    bombs.mkdir(parents=True)
    (bombs / "png.png").write_bytes(_png(30_000, 60_000))
    (bombs / "jpg.jpg").write_bytes(_jpeg_claiming(65_000, 65_000))
    p = Path(packio.convert(bombs.parent, base / "bombs.lmdb", max_pixels=1 << 33, progress=False).output)
    case("bomb_samples_read", "read", p)
    case("bomb_samples_skip", "read", p, kw={"on_error": "skip"})

    # deeply nested JSON: a manifest; a tar record (also with on_error="skip")
    p = pack("deep_manifest.lmdb")
    m = json.loads((p / "packio.json").read_text())
    text = json.dumps(sealed(m))
    (p / "packio.json").write_text(text[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    case("deep_json_manifest", "read", p)
    p = pack("deep_record.wds")
    idx = np.load(p / "index.npy")
    shard = p / "shard-000000.tar"
    raw = bytearray(shard.read_bytes())
    off, size = int(idx[1, 3]), int(idx[1, 4])
    raw[off:off + size] = (b"[" * (size // 2) + b"]" * (size - size // 2))
    shard.write_bytes(bytes(raw))
    case("deep_json_record", "read", p, kw={"decode": False})
    case("deep_json_record_skip", "read", p, kw={"decode": False, "on_error": "skip"})

    # an HDF5 signature on an 8 GiB sparse file: opening reads 8 bytes, not the file
    with open(base / "sparse.h5", "wb") as f:
        f.write(b"\x89HDF\r\n\x1a\n")
        f.truncate(8 << 30)
    case("hdf5_signature_only", "read", base / "sparse.h5")

    # pack time: a 1 x 1,000,000 PNG resized; a 30000 x 20 JPEG with --short-side; an 8 GiB
    # sparse .jpg; 1,100 nested folders; CSV boxes overflowing float32
    for name, files, kw in (
            ("wide_png", {"w.png": cv2.imencode(".png", np.zeros((1, 1_000_000, 3), np.uint8))[1].tobytes()},
             {"resize": {"short_side": 224}}),
            ("tall_jpeg", {"t.jpg": cv2.imencode(".jpg", np.zeros((30_000, 20, 3), np.uint8))[1].tobytes()},
             {"resize": {"short_side": 224}})):
        d = base / name
        d.mkdir()
        for fn, blob in files.items():
            (d / fn).write_bytes(blob)
        (d / "ok.jpg").write_bytes(jpeg(300, 400, 2))
        case(f"pack_{name}", "convert", d, dst=str(base / f"{name}.lmdb"), kw=kw)
    d = base / "sparse_jpg"
    d.mkdir()
    with open(d / "big.jpg", "wb") as f:
        f.write(jpeg(20, 20, 1))
        f.truncate(8 << 30)
    (d / "ok.jpg").write_bytes(jpeg(20, 20, 2))
    case("pack_sparse_8gib_jpg", "convert", d, dst=str(base / "sparse_jpg.lmdb"))
    # relative to folder descriptors: the full paths are past what os.makedirs handles
    _deep_folder(base / "nested", "d", 1100)
    case("pack_nested_1100", "convert", base / "nested", dst=str(base / "nested.lmdb"))
    _deep_folder(base / "long", "d" * 250, 20)  # a path of 5,000 bytes: past PATH_MAX, cannot be listed
    (base / "long" / "ok.jpg").write_bytes(jpeg(20, 20, 4))
    case("pack_path_over_4096", "convert", base / "long", dst=str(base / "long.lmdb"))
    d = base / "csv_src"
    d.mkdir()
    (d / "a.jpg").write_bytes(jpeg(40, 40, 1))
    (base / "boxes.csv").write_text("filename,class,xmin,ymin,xmax,ymax\na.jpg,c,1,2,3,4\na.jpg,c,1,2,1e39,4e39\n")
    case("pack_csv_float32", "convert", d, dst=str(base / "csv.lmdb"), kw={"csv": str(base / "boxes.csv")})

    results = run_cases(cases, base)
    yield {"results": results, "base": base}
    # 1,100 nested folders: pytest's recursive cleanup would hit Python's recursion limit
    subprocess.run(["rm", "-rf", str(base / "nested"), str(base / "long")], check=False)


def _deep_folder(root: Path, name: str, depth: int) -> None:
    """``root/name/name/.../x.jpg``, ``depth`` folders deep, made through folder descriptors."""
    root.mkdir()
    deep = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=deep)
        nxt = os.open(name, os.O_RDONLY, dir_fd=deep)
        os.close(deep)
        deep = nxt
    fd = os.open("x.jpg", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=deep)
    os.write(fd, jpeg(20, 20, 3))
    os.close(fd)
    os.close(deep)


def _npy_shape(path: Path, old: str, new: str) -> None:
    """Rewrite the shape in a .npy header, keeping the header's length (its padding shrinks)."""
    raw = path.read_bytes()
    end = raw.index(b"\n") + 1
    header = raw[:end].decode("latin1")
    assert f"'shape': {old}" in header
    header = header.replace(f"'shape': {old}", f"'shape': {new}").replace(" " * (len(new) - len(old)) + "\n", "\n")
    assert len(header) == end
    path.write_bytes(header.encode("latin1") + raw[end:])


def _png(w: int, h: int) -> bytes:
    """A PNG whose IHDR says w x h (valid CRCs), with a small IDAT."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 4096)) + chunk(b"IEND", b""))


def _jpeg_claiming(w: int, h: int) -> bytes:
    data = bytearray(jpeg(16, 16, 1))
    i = 2
    while i < len(data):
        marker, seg = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC1, 0xC2):
            data[i + 5:i + 9] = h.to_bytes(2, "big") + w.to_bytes(2, "big")
            return bytes(data)
        i += 2 + seg
    raise AssertionError("no SOF marker")


# ---------------------------------------------------------------- the cases


@pytest.mark.parametrize("fmt", ["bmp", "tar", "lmdb", "arrays", "bmprec"])
def test_fifo_in_place_of_a_data_file_is_refused_without_blocking(world, fmt):
    r = world["results"]
    read, ver = r[f"fifo_{fmt}_read"], r[f"fifo_{fmt}_verify"]
    assert read.get("packio") and "not a regular file" in read["msg"], read
    bounded(ver) if "error" not in ver else expect(ver, ver["error"], "not a regular file")
    if "error" not in ver:
        assert ver["value"] is False  # verify reports the damage


@pytest.mark.parametrize("fmt", ["lmdb", "arrays"])
def test_truncated_under_an_open_reader_is_an_error_not_sigbus(world, fmt):
    expect(world["results"][f"truncated_under_reader_{fmt}"], "FormatError", "truncated")


def test_crafted_lmdb_pages(world):
    r = world["results"]
    # packio's own node check, or LMDB's when the value sits inside the leaf page (small generated JPEGs)
    expect(r["lmdb_node_size"], "CorruptSampleError", "outside the file's pages|MDB_")
    expect(r["lmdb_meta_last_page"], "FormatError", "truncated|needs")


def test_one_damaged_lmdb_node_spoils_only_its_sample(tmp_path):
    """LMDB marks its transaction bad after reporting a damaged page: the reader must start a
    fresh one, or every later sample reads as corrupt (and on_error="skip" drops good ones)."""
    import cv2

    src = tmp_path / "src"
    for k in range(6):
        (src / ("ants" if k % 2 else "bees")).mkdir(parents=True, exist_ok=True)
        (src / ("ants" if k % 2 else "bees") / f"{k}.jpg").write_bytes(jpeg(60 + 5 * k, 80, seed=k))
    (src / "bees" / "p.png").write_bytes(cv2.imencode(".png", photo(30, 40, 5))[1].tobytes())
    p = Path(packio.convert(src, tmp_path / "node.lmdb", progress=False).output)
    data = bytearray((p / "data.mdb").read_bytes())
    at = data.find(b"0000000003")
    data[at - 8:at - 4] = struct.pack("<HH", 0xFFFF, 0x7FFF)  # the value's size: 2 GB
    (p / "data.mdb").write_bytes(bytes(data))
    ds = packio.open_dataset(p, decode=False)
    with pytest.raises(packio.CorruptSampleError, match="MDB_CORRUPTED"):  # LMDB's own check, this layout
        ds[3]
    assert [ds[i]["index"] for i in (4, 5, 6, 0)] == [4, 5, 6, 0]
    skipping = packio.open_dataset(p, decode=False, on_error="skip")
    assert [skipping[i] is None for i in range(len(skipping))] == [False, False, False, True, False, False, False]


@pytest.mark.parametrize("fmt", ["lmdb", "tar", "bmp", "arrays", "hdf5"])
def test_manifest_count_of_10_12(world, fmt):
    expect(world["results"][f"count_{fmt}"], "FormatError", "1000000000000|does not match the manifest")


def test_lying_npy_headers(world):
    r = world["results"]
    expect(r["npy_labels_header"], "FormatError", r"labels\.npy.*does not match")
    bounded(r["npy_labels_header_dataset"])  # the per-sample path reads the records instead
    assert len(r["npy_labels_header_dataset"]["value"]) == 7
    expect(r["npy_idx_header"], "FormatError", r"records\.idx\.npy.*claims")


def test_tar_index_sizes_and_offsets(world):
    r = world["results"]
    expect(r["tar_index_2_40"], "FormatError", r"index\.npy: row 2 .*over packio's limits")
    got = r["tar_index_offset"]
    bounded(got)
    assert got["value"][2] is None and sum(v is None for v in got["value"]) == 1  # skipped, the others read


def test_foreign_shards(world):
    r = world["results"]
    if "tar_gnu_sparse" in r:
        expect(r["tar_gnu_sparse"], "FormatError", "GNU sparse")
    expect(r["tar_cls_1e12"], "FormatError", r"label 1000000000000, outside")


@pytest.mark.parametrize("name", ["records", "images_bytes", "record_offsets", "images"])
def test_hdf5_declared_shapes(world, name):
    expect(world["results"][f"hdf5_shape_{name}"], "FormatError", f"'{name}' is .* expected")


def test_image_bombs_inside_a_dataset(world):
    r = world["results"]
    expect(r["bomb_samples_read"], "CorruptSampleError", r"over packio's limit of 178956970")
    got = r["bomb_samples_skip"]
    bounded(got)
    assert got["value"] == [None, None]


def test_deeply_nested_json(world):
    r = world["results"]
    expect(r["deep_json_manifest"], "FormatError", r"nested \d+ deep")
    expect(r["deep_json_record"], "CorruptSampleError", "nested")
    got = r["deep_json_record_skip"]
    bounded(got)
    assert [v is None for v in got["value"]].count(True) == 1 and got["value"][1] is None


def test_hdf5_open_reads_only_the_signature(world):
    expect(world["results"]["hdf5_signature_only"], "FormatError", "cannot open as HDF5")


def test_pack_time_blowups_are_skipped_and_counted(world):
    r = world["results"]
    for name, reason in (("wide_png", "resize target too large"), ("tall_jpeg", "resize target too large"),
                         ("sparse_8gib_jpg", "file too large")):
        got = r[f"pack_{name}"]
        bounded(got)
        assert got["value"] == {"packed": 1, "skipped": {reason: 1}}, got
    got = r["pack_csv_float32"]
    bounded(got)
    assert got["value"] == {"packed": 1, "skipped": {"negative or non-finite box": 1}}, got
    got = r["pack_nested_1100"]
    bounded(got)
    assert got["value"] == {"packed": 1, "skipped": {}}, got
    got = r["pack_path_over_4096"]  # counted, not silently dropped
    bounded(got)
    assert got["value"] == {"packed": 1, "skipped": {"path longer than 4095 bytes": 1}}, got
    ds = packio.open_dataset(world["base"] / "nested.lmdb")
    assert ds[0]["key"] == "d/" * 1100 + "x.jpg"


# ---------------------------------------------------------------- in-process cases (cheap, no blow-up risk)


@pytest.mark.parametrize("field,value,why", [
    ("label", 2**63, "label"), ("label", -7, "label"), ("width", -5, "size"), ("height", 2**40, "size"),
    ("label", "3", "'label' is not an integer"), ("boxes", [[0, 0, 1e39, 1]], "float32"),
    ("box_labels", [2**63], "box_labels"), ("boxes", "nope", "lists")])
def test_hostile_record_values(gen_folder, tmp_path, field, value, why):
    import msgpack
    from test_integrity import _corrupt_record

    src, csv = gen_folder
    path = Path(packio.convert(src, tmp_path / "r.lmdb", csv=csv, progress=False).output)
    ds = packio.open_dataset(path, decode=False)
    rec = ds.sample(2).record()
    ds.reader.close()
    rec[field] = value
    if field == "box_labels":
        rec["boxes"] = [[0, 0, 1, 1]]
    if field == "boxes" and isinstance(value, list):
        rec["box_labels"] = [0] * len(value)
    _corrupt_record(path, 2, msgpack.packb(rec, use_bin_type=True))
    with pytest.raises(packio.CorruptSampleError, match=why):
        packio.open_dataset(path)[2]
    skipping = packio.open_dataset(path, on_error="skip")
    got = [i for b in packio.DataLoader(skipping, batch_size=4) for i in b["index"].tolist()]
    assert got == [i for i in range(len(skipping)) if i != 2]
    assert not packio.verify(path).ok


def test_writer_keeps_the_readers_record_limits(tmp_path, monkeypatch):
    from packio.sample import unstorable

    root = tmp_path / "imgs"
    root.mkdir()
    (root / "a.jpg").write_bytes(jpeg(40, 40, 1))
    (root / "b.jpg").write_bytes(jpeg(40, 40, 2))
    rows = "".join(f"a.jpg,c,1,1,{k + 2},{k + 2}\n" for k in range(5))
    (tmp_path / "b.csv").write_text("filename,class,xmin,ymin,xmax,ymax\n" + rows + "b.jpg,c,1,1,2,2\n")
    many = packio.Sample(key="k", payload=jpeg(8, 8, 1), encoding="jpeg", boxes=np.zeros((2**20 + 1, 4), np.float32),
                         box_labels=np.zeros(2**20 + 1, np.int64))
    assert unstorable(many)[0] == "too many boxes"
    monkeypatch.setattr(limits, "MAX_BOXES", 4)  # the same check end to end, on a small CSV
    for suffix in (".lmdb", ".wds", ".h5"):
        s = packio.convert(root, tmp_path / f"o{suffix}", csv=tmp_path / "b.csv", progress=False)
        assert s.packed == 1 and dict(s.skipped) == {"too many boxes": 1}, s.text()
        ds = packio.open_dataset(tmp_path / f"o{suffix}")
        assert [ds[i]["key"] for i in range(len(ds))] == ["b.jpg"]


def test_packing_leaves_pil_limits_alone(tmp_path):
    from PIL import Image

    root = tmp_path / "imgs"
    root.mkdir()
    Image.fromarray(photo(30, 40, 1)).save(root / "a.png")
    Image.fromarray(photo(30, 40, 2)).save(root / "b.webp")
    before = Image.MAX_IMAGE_PIXELS
    s = packio.convert(root, tmp_path / "o.lmdb", progress=False)
    assert s.packed == 2 and Image.MAX_IMAGE_PIXELS == before is not None


def test_read_resize_target_is_bounded(gen_folder, tmp_path):
    src, _ = gen_folder
    packio.convert(src, tmp_path / "o.lmdb", progress=False)
    with pytest.raises(ValueError, match="over packio's limit"):
        packio.open_dataset(tmp_path / "o.lmdb", resize=(100_000, 100_000))


# ---------------------------------------------------------------- damaged JPEGs: decode integrity


def _entropy_garbage(data: bytes, seed: int = 0) -> bytes:
    """The same JPEG with its entropy-coded data replaced by random bytes (no markers)."""
    sos = data.find(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")
    body = np.random.default_rng(seed).integers(0, 255, len(data) - 2 - start, dtype=np.uint8).tobytes()
    return data[:start] + body.replace(b"\xff", b"\x00") + data[-2:]


def _truncated_with_eoi(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3] + b"\xff\xd9"


@pytest.fixture
def damaged_folder(tmp_path) -> Path:
    root = tmp_path / "d" / "c"
    root.mkdir(parents=True)
    good = _real_jpegs(3)
    (root / "good.jpg").write_bytes(good[0])
    (root / "garbage.jpg").write_bytes(_entropy_garbage(good[1]))
    (root / "cut.jpg").write_bytes(_truncated_with_eoi(good[2]))
    return root.parent


@pytest.mark.parametrize("resize", [None, packio.ResizeSpec(short_side=48)])
def test_check_decode_skips_damaged_jpegs(damaged_folder, tmp_path, resize):
    s = packio.convert(damaged_folder, tmp_path / "o.wds", check="decode", resize=resize, progress=False)
    assert s.packed == 1 and dict(s.skipped) == {"corrupt image data": 2}, s.text()
    assert any("garbage.jpg" in p and "Corrupt JPEG data" in p for p in s.problems)
    assert packio.open_dataset(tmp_path / "o.wds")[0]["key"] == "c/good.jpg"


def test_default_check_skips_damaged_jpegs_it_decodes_anyway(damaged_folder, tmp_path):
    s = packio.convert(damaged_folder, tmp_path / "r.lmdb", resize=packio.ResizeSpec(short_side=48), progress=False)
    assert s.packed == 1 and dict(s.skipped) == {"corrupt image data": 2}, s.text()  # not laundered
    s = packio.convert(damaged_folder, tmp_path / "h.lmdb", resize=packio.ResizeSpec(short_side=48),
                       check="header", progress=False)
    assert s.packed == 3  # lenient: re-encoded with made-up pixels


def test_damaged_jpegs_stored_as_found_fail_reads(damaged_folder, tmp_path):
    """Read-time decode is strict by default (no made-up grey pixels), with or without verify."""
    s = packio.convert(damaged_folder, tmp_path / "o.lmdb", progress=False)  # stored as found: header checks pass
    assert s.packed == 3
    keys = {packio.open_dataset(tmp_path / "o.lmdb", decode=False)[i]["key"]: i for i in range(3)}
    for kw in ({}, {"verify": True}, {"resize": 32}):
        ds = packio.open_dataset(tmp_path / "o.lmdb", **kw)
        for name in ("c/garbage.jpg", "c/cut.jpg"):
            with pytest.raises(packio.CorruptSampleError, match="corrupt JPEG data"):
                ds[keys[name]]
        assert ds[keys["c/good.jpg"]]["image"].shape[0] == 3
        skipping = packio.open_dataset(tmp_path / "o.lmdb", on_error="skip", **kw)
        assert [skipping[i] is None for i in range(3)].count(True) == 2
        batch = packio.collate(skipping.__getitems__([0, 1, 2]))
        assert len(batch["key"]) == 1 and batch["key"][0] == "c/good.jpg"


# ---------------------------------------------------------------- disk full


DISK_FULL = """
import sys, resource, signal
if sys.argv[3] == "fsize":  # writes past 3 MB fail with EFBIG: the same failure paths as ENOSPC
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))
from packio.cli import main
sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--quiet"]))
"""


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("how", ["tmpfs-3m", "tmpfs-20m", "fsize"])
@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_disk_full_is_a_clean_error_with_nothing_left(tmp_path, suffix, how):
    """20 MB: HDF5 fails while releasing a dataset (it segfaulted at exit); 3 MB: in the first writes."""
    src = SHARED / "hymenoptera"
    if not src.is_dir():
        src = tmp_path / "src"
        src.mkdir()
        for k in range(260):  # ~113 KB each: ~29 MB, more than the 20 MB tmpfs holds
            (src / f"{k}.jpg").write_bytes(jpeg(400, 500, k, quality=97))
    out = tmp_path / "out"
    if how.startswith("tmpfs"):
        if not _tmpfs(out, how.split("-")[1]):
            pytest.skip("cannot mount a small tmpfs here (needs root)")
    else:
        out.mkdir()
    try:
        proc = subprocess.run([sys.executable, "-c", DISK_FULL, str(src), str(out / f"o{suffix}"), how],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])  # not 139 (segfault), not 1 (traceback)
        assert "Traceback" not in proc.stderr and "partial output was removed" in proc.stderr, proc.stderr[-2000:]
        if how.startswith("tmpfs"):
            assert "free some disk space" in proc.stderr, proc.stderr[-2000:]
        assert list(out.iterdir()) == []  # no temporaries left
    finally:
        if how.startswith("tmpfs"):
            subprocess.run(["umount", str(out)], check=False)


def test_hdf5_cut_under_an_open_reader_is_an_error_not_zeros(gen_folder, tmp_path):
    """HDF5 reads past the end of its file as zeros; the reader checks the size instead."""
    src, _ = gen_folder
    path = Path(packio.convert(src, tmp_path / "o.h5", progress=False).output)
    ds = packio.open_dataset(path, decode=False)
    ds[0]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3)
    with pytest.raises(packio.FormatError, match="truncated while open"):
        ds.sample(len(ds) - 1)


def test_check_decode_from_the_command_line(damaged_folder, tmp_path, capsys):
    from packio.cli import main

    assert main(["convert", str(damaged_folder), str(tmp_path / "o.lmdb"), "--check", "decode"]) == 0
    out = capsys.readouterr()
    assert "packed 1 samples" in out.out and "2  corrupt image data" in out.out, out
    assert packio.open_dataset(tmp_path / "o.lmdb").reader.manifest.image["check"] == "decode"


def test_disk_full_at_the_lmdb_open_is_a_clean_error(tmp_path):
    """A disk too full for LMDB's first pages: lmdb.open itself fails (was a raw lmdb.Error)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jpg").write_bytes(jpeg(16, 16, 1))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", DISK_FULL.replace("3 << 20", "3000"), str(src),
                           str(out / "o.lmdb"), "fsize"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "partial output was removed" in proc.stderr, proc.stderr[-2000:]
    assert list(out.iterdir()) == []
