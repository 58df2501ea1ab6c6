"""Nothing lost, nothing half-written, nothing executed: integrity and untrusted input."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packio
from packio.errors import CorruptSampleError, FormatError, PackioError
from packio.formats import formats
from packio.manifest import Manifest
from packio.sample import ENCODINGS, sample_from_record
from conftest import sealed

SUFFIX = {name: spec.suffixes[0] for name, spec in formats().items()}
RESIZE = {"arrays": packio.ResizeSpec(size=(48, 64)), "bmp": packio.ResizeSpec(short_side=40)}


def _pack(gen_folder, tmp_path: Path, fmt: str) -> Path:
    src, csv = gen_folder
    return Path(packio.convert(src, tmp_path / f"ds{SUFFIX[fmt]}", csv=csv, resize=RESIZE.get(fmt),
                               progress=False).output)


def _flip_payload_byte(path: Path, payload: bytes) -> None:
    """Find the sample's payload inside the stored files and flip one byte of it. Every
    copy is flipped: LMDB can keep a stale copy of a value in a freed page (a transaction
    retried after the map grew), and flipping only that one would damage no sample."""
    probe = payload[len(payload) // 2: len(payload) // 2 + 48]
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    found = False
    for f in files:
        data = bytearray(f.read_bytes())
        at = data.find(probe)
        if at < 0:
            continue
        while at >= 0:
            data[at + 10] ^= 0xFF
            at = data.find(probe, at + 1)
        f.write_bytes(bytes(data))
        found = True
    assert found, "payload not found in the stored files"


@pytest.mark.parametrize("fmt", sorted(formats()))
def test_flipped_byte_is_detected(gen_folder, tmp_path, fmt):
    path = _pack(gen_folder, tmp_path, fmt)
    assert packio.verify(path).ok
    ds = packio.open_dataset(path, decode=False)
    victim = ds.sample(5)
    raw = victim.payload.tobytes() if isinstance(victim.payload, np.ndarray) else victim.payload
    ds.reader.close()  # HDF5 shares an open file's cache with later opens in the process
    _flip_payload_byte(path, raw)
    report = packio.verify(path)
    assert not report.ok
    assert len(report.bad_samples) == 1 and victim.key in report.bad_samples[0], report.text()
    fresh = packio.open_dataset(path, decode=False, verify=True)
    with pytest.raises(CorruptSampleError, match="checksum mismatch"):
        fresh[5]
    skipping = packio.open_dataset(path, decode=False, verify=True, on_error="skip")
    assert skipping[5] is None and skipping[4] is not None


def _corrupt_record(path: Path, i: int, blob: bytes) -> None:
    """Replace sample i's stored record with ``blob`` (LMDB)."""
    import lmdb

    env = lmdb.open(str(path), subdir=True)
    key = b"%010d" % i
    with env.begin(write=True) as txn:
        value = txn.get(key)
        n = int.from_bytes(value[:4], "little")
        txn.put(key, len(blob).to_bytes(4, "little") + blob + value[4 + n:])
    env.close()


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PACKIO_PWNED']}",))


def test_pickle_payload_in_record_is_inert(gen_folder, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PACKIO_PWNED", str(marker))
    path = _pack(gen_folder, tmp_path, "lmdb")
    _corrupt_record(path, 3, pickle.dumps(_Evil()))
    ds = packio.open_dataset(path)
    with pytest.raises(CorruptSampleError):
        ds[3]
    assert not marker.exists()
    assert not packio.verify(path).ok


def test_corrupt_sample_in_worker_raises_or_skips_never_hangs(gen_folder, tmp_path):
    path = _pack(gen_folder, tmp_path, "lmdb")
    _corrupt_record(path, 2, b"\xc1\xc1 not msgpack")
    dl = packio.DataLoader(packio.open_dataset(path, resize=16), batch_size=4, num_workers=2, timeout=60)
    with pytest.raises(CorruptSampleError, match="not valid msgpack"):
        list(dl)
    ds = packio.open_dataset(path, resize=16, on_error="skip")
    got = [i for b in packio.DataLoader(ds, batch_size=4, num_workers=2, timeout=60) for i in b["index"].tolist()]
    assert sorted(got) == [i for i in range(14) if i != 2]
    it = packio.open_dataset(path, iterable=True, resize=16, on_error="skip")
    got = [i for b in packio.DataLoader(it, batch_size=4, num_workers=2, timeout=60) for i in b["index"].tolist()]
    assert sorted(got) == [i for i in range(14) if i != 2]


def test_hdf5_record_with_pickle_is_rejected(gen_folder, tmp_path, monkeypatch):
    import h5py

    marker = tmp_path / "pwned"
    monkeypatch.setenv("PACKIO_PWNED", str(marker))
    path = _pack(gen_folder, tmp_path, "hdf5")
    with h5py.File(path, "r+") as f:
        off = f["record_offsets"][:]
        evil = np.frombuffer(pickle.dumps(_Evil()), np.uint8)
        n = min(len(evil), int(off[1] - off[0]))
        f["records"][off[0]:off[0] + n] = evil[:n]
    with pytest.raises(CorruptSampleError):
        packio.open_dataset(path)[0]
    assert not marker.exists()


def _tar_with(tmp_path: Path, name: str, link: bool = False) -> Path:
    import io

    d = tmp_path / "evil"
    d.mkdir()
    with tarfile.open(d / "shard-0.tar", "w") as tf:
        info = tarfile.TarInfo(name)
        if link:
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tf.addfile(info)
        else:
            data = b"\xff\xd8\xff" + b"x" * 10
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return d


@pytest.mark.parametrize("name,link", [("../../escape.jpg", False), ("/abs/path.jpg", False), ("a.jpg", True)])
def test_tar_traversal_and_links_refused(tmp_path, name, link):
    d = _tar_with(tmp_path, name, link)
    with pytest.raises(FormatError, match="refusing this tar"):
        packio.open_dataset(d)
    assert not (tmp_path.parent / "escape.jpg").exists()


@pytest.mark.parametrize("name", ["x.lmdb", "x.h5", "x.tar", "x.npy", "x.bmp"])
def test_random_bytes_are_clear_errors(tmp_path, name):
    rng = np.random.default_rng(0)
    p = tmp_path / name
    if name.endswith((".h5", ".tar")):
        p.write_bytes((b"\x89HDF\r\n\x1a\n" if name.endswith(".h5") else b"") + rng.bytes(4096))
    else:
        p.mkdir()
        (p / "packio.json").write_bytes(rng.bytes(300))
    with pytest.raises(PackioError):
        ds = packio.open_dataset(p)
        ds[0]


def test_truncated_shard_and_wrong_manifest(gen_folder, tmp_path):
    path = _pack(gen_folder, tmp_path, "tar")
    shard = next(path.glob("shard-*.tar"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    ds = packio.open_dataset(path, decode=False)
    with pytest.raises(CorruptSampleError, match="truncated"):
        for i in range(len(ds)):
            ds[i]
    m = json.loads((path / "packio.json").read_text())
    m["count"] = 99
    (path / "packio.json").write_text(json.dumps(sealed(m)))
    with pytest.raises(FormatError, match="does not match the manifest"):
        packio.open_dataset(path)
    (tmp_path / "l").mkdir()
    lm = _pack(gen_folder, tmp_path / "l", "lmdb")
    m = json.loads((lm / "packio.json").read_text())
    m["count"] = 3
    (lm / "packio.json").write_text(json.dumps(sealed(m)))
    with pytest.raises(FormatError, match="manifest says 3"):
        packio.open_dataset(lm)[0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=6),
                              max_leaves=20).map(json.dumps)))
def test_fuzz_manifest_parser(text):
    try:
        Manifest.from_json(text, "fuzz")
    except FormatError:
        pass


# Small trees (few leaves per field): the parser checks types and nesting, not bulk, and drawing
# big trees was most of this test's CPU (issue 28); the cases stay 400.
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8)
                     | st.binary(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
                     max_leaves=8)
_rec = st.fixed_dictionaries({}, optional={k: _json for k in (
    "key", "encoding", "label", "boxes", "box_labels", "width", "height", "meta", "checksum")})
# a plausible record with at most one field made junk (None too): reaches the checks past the first
_plausible = {"key": st.text(max_size=8), "encoding": st.sampled_from(ENCODINGS), "label": st.integers(-2, 9),
              "width": st.integers(-1, 40), "height": st.integers(-1, 40), "checksum": st.text(max_size=8),
              "meta": st.dictionaries(st.text(max_size=4), _json, max_size=3)}
_boxes = st.integers(0, 3).flatmap(lambda n: st.tuples(  # as many labels as boxes
    st.lists(st.lists(st.floats(-5, 50) | st.integers(-5, 50), min_size=4, max_size=4), min_size=n, max_size=n),
    st.lists(st.integers(-2, 9), min_size=n, max_size=n)))


@st.composite
def _near(draw) -> dict:
    rec = draw(st.fixed_dictionaries(_plausible))
    rec["boxes"], rec["box_labels"] = draw(_boxes)
    field = draw(st.sampled_from([None, *rec]))
    if field:
        rec[field] = draw(_json)
    return rec


@settings(max_examples=400, deadline=None)
@given(st.one_of(_rec, _near(), _json), st.binary(max_size=64))
def test_fuzz_record_parser(rec, payload):
    from packio.formats.base import decode_stored, unpack_record

    try:
        sample_from_record(rec, payload)
        decode_stored(rec, payload, "fuzz")
    except CorruptSampleError:
        pass
    try:
        unpack_record(msgpack.packb(rec, use_bin_type=True), "fuzz")
    except CorruptSampleError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_record_bytes(blob):
    from packio.formats.base import unpack_record

    try:
        rec = unpack_record(blob, "fuzz")
        sample_from_record(rec, b"")
    except CorruptSampleError:
        pass


KILL_SCRIPT = """
import sys, time, packio
from packio.formats import format_for_path
writer = format_for_path(sys.argv[2]).writer
add = writer.add
def slow_add(self, sample):  # a slow disk: widens the window the kill can land in
    if not getattr(writer, "started", False):
        writer.started = True
        print("writing", flush=True)  # the parent's kill lands after this, never while packio imports
    time.sleep(0.004)
    add(self, sample)
writer.add = slow_add
packio.convert(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), progress=False,
               shard_samples=40, resize=packio.ResizeSpec(size=(32, 32)) if sys.argv[2].endswith('.arrays') else None)
"""


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory) -> Path:
    from conftest import jpeg

    root = tmp_path_factory.mktemp("big") / "imgs"
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for k in range(120):
            (root / f"c{c}" / f"{k:04d}.jpg").write_bytes(jpeg(120, 160, seed=c * 1000 + k, quality=95))
    return root


def _tree_state(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.mark.parametrize("suffix", [".lmdb", ".h5", ".wds", ".arrays"])
def test_kill_at_random_points_leaves_nothing_half_written(big_folder, tmp_path, suffix):
    rng = np.random.default_rng(hash(suffix) % 1000)
    before = _tree_state(big_folder)
    dst = tmp_path / f"out{suffix}"
    outcomes = []
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(big_folder), str(dst), str(attempt % 2 * 2)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "writing"  # the first sample is being written
        time.sleep(float(rng.uniform(0.0, 1.5)))  # 360 samples at 4 ms: mostly mid-write, sometimes done
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if dst.exists():  # finished before the kill: must be complete and valid
            report = packio.verify(dst)
            assert report.ok and report.count == 360, report.text()
            outcomes.append("complete")
            import shutil

            shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
        else:
            outcomes.append("absent")
    assert "absent" in outcomes  # at least one kill landed mid-conversion
    assert _tree_state(big_folder) == before  # the input is never modified
    s = packio.convert(big_folder, dst, progress=False, resize=packio.ResizeSpec(size=(32, 32))
                       if suffix == ".arrays" else None)  # a rerun completes and cleans the leftovers
    assert s.packed == 360 and packio.verify(dst).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name]


# ---- integrity that holds ----------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(formats()))
def test_convert_skips_damaged_samples_instead_of_laundering(real_folder, tmp_path, fmt):
    path = _pack((real_folder, None), tmp_path, fmt)
    ds = packio.open_dataset(path, decode=False)
    victim = ds.sample(5)
    raw = victim.payload.tobytes() if isinstance(victim.payload, np.ndarray) else victim.payload
    ds.reader.close()
    _flip_payload_byte(path, raw)
    out = tmp_path / "resized.wds"  # a resize re-encodes: the damage would get a fresh checksum
    s = packio.convert(path, out, resize=packio.ResizeSpec(size=(24, 24)), progress=False)
    assert s.packed == 11 and dict(s.skipped) == {"corrupt sample in the source dataset": 1}
    assert any(victim.key in p and "checksum mismatch" in p for p in s.problems)
    copy = packio.open_dataset(out, decode=False)
    assert victim.key not in {copy.sample(i).key for i in range(len(copy))} and packio.verify(out).ok


def _edit_manifest(path: Path, edit) -> None:
    import h5py

    if path.is_dir():
        m = json.loads((path / "packio.json").read_text())
        edit(m)
        (path / "packio.json").write_text(json.dumps(m, indent=1))
    else:
        with h5py.File(path, "r+") as f:
            m = json.loads(f.attrs["packio_manifest"])
            edit(m)
            f.attrs["packio_manifest"] = json.dumps(m)


@pytest.mark.parametrize("fmt", sorted(formats()))
def test_verify_catches_manifest_edits(gen_folder, tmp_path, fmt):
    path = _pack(gen_folder, tmp_path, fmt)
    assert packio.verify(path).ok
    _edit_manifest(path, lambda m: m["classes"].reverse())  # swaps what every label means
    report = packio.verify(path)
    assert not report.ok and any("differs from its digest" in b for b in report.bad_files), report.text()
    _edit_manifest(path, lambda m: m["classes"].reverse())
    assert packio.verify(path).ok
    _edit_manifest(path, lambda m: m.pop("digest"))
    assert not packio.verify(path).ok


@pytest.mark.parametrize("name,fixed", [("labels", False), ("boxes", False), ("box_labels", False),
                                        ("records", False), ("record_offsets", False), ("box_offsets", False),
                                        ("offsets", False), ("labels", True), ("boxes", True)])
def test_verify_catches_hdf5_array_edits(gen_folder, tmp_path, name, fixed):
    import h5py

    src, csv = gen_folder
    path = Path(packio.convert(src, tmp_path / "d.h5", csv=csv, progress=False,
                               resize=packio.ResizeSpec(size=(32, 32)) if fixed else None).output)
    assert packio.verify(path).ok
    with h5py.File(path, "r+") as f:
        d = f[name]
        i = len(d) // 2
        v = d[i]
        d[i] = v + 1 if name != "records" else v ^ 0x01
    report = packio.verify(path)
    assert not report.ok and any(b.startswith(f"{name}: checksum differs") for b in report.bad_files), report.text()


def test_verify_reports_npy_header_bit_flips(gen_folder, tmp_path):
    path = _pack(gen_folder, tmp_path, "arrays")
    rng = np.random.default_rng(7)
    for npy in sorted(path.glob("*.npy")):
        good = npy.read_bytes()
        header = 10 + int.from_bytes(good[8:10], "little")
        for at in rng.choice(header, 8, replace=False):
            bad = bytearray(good)
            bad[at] ^= 1 << int(rng.integers(8))
            npy.write_bytes(bytes(bad))
            report = packio.verify(path)  # a report, never an exception
            assert not report.ok and any(b.startswith(f"{npy.name}: checksum differs") for b in report.bad_files)
        npy.write_bytes(good)
    assert packio.verify(path).ok


def test_records_over_the_readers_size_limit_are_skipped(tmp_path, monkeypatch):
    from conftest import jpeg
    from packio import limits

    root = tmp_path / "imgs"
    root.mkdir()
    for name in ("few.jpg", "many.jpg"):
        (root / name).write_bytes(jpeg(40, 40, len(name)))
    rows = ["filename,class,xmin,ymin,xmax,ymax"]
    rows += [f"few.jpg,c,{k}.1,1.3,{k + 5}.7,9.9" for k in range(4)]
    rows += [f"many.jpg,c,{k % 30}.1,{k // 30}.3,{k % 30 + 5}.7,{k // 30 + 5}.9" for k in range(40)]
    (tmp_path / "b.csv").write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(limits, "MAX_RECORD_BYTES", 2048)  # 40 boxes: about 1.6 KB in msgpack, 3.3 KB in JSON
    for out in ("o.lmdb", "o.wds"):  # one rule for every format: the record fits as msgpack and as JSON
        s = packio.convert(root, tmp_path / out, csv=tmp_path / "b.csv", progress=False)
        assert s.packed == 1 and dict(s.skipped) == {"record too large": 1}, s.text()
        few = packio.open_dataset(tmp_path / out)[0]
        assert few["key"] == "few.jpg" and len(few["boxes"]) == 4


def test_real_box_limit_round_trips_at_the_limit():
    from packio.formats.base import pack_record, unpack_record
    from packio.limits import MAX_BOXES

    assert len(unpack_record(pack_record({"box_labels": [0] * MAX_BOXES}), "x")["box_labels"]) == MAX_BOXES
    with pytest.raises(CorruptSampleError):
        unpack_record(pack_record({"box_labels": [0] * (MAX_BOXES + 1)}), "x")


def test_workers_get_the_packed_reader_once(tmp_path, monkeypatch):
    """Converting a packed dataset with workers: the tasks carry indices, not the reader
    (whose tar index grows with N: sent with every chunk, the bytes grew with N²)."""
    from multiprocessing import connection

    from conftest import jpeg

    root = tmp_path / "imgs" / "c"
    root.mkdir(parents=True)
    tiny = [jpeg(8, 8, k) for k in range(4)]
    n = 800
    for k in range(n):
        (root / f"{k:05d}.jpg").write_bytes(tiny[k % 4])
    packio.convert(tmp_path / "imgs", tmp_path / "src.wds", progress=False)
    sent = []
    real = connection.Connection._send_bytes
    monkeypatch.setattr(connection.Connection, "_send_bytes",
                        lambda self, buf: sent.append(len(buf)) or real(self, buf))
    s = packio.convert(tmp_path / "src.wds", tmp_path / "out.lmdb", workers=2, progress=False)
    assert s.packed == n
    # one chunk of 8 indices pickles to about 150 bytes; the reader alone is n * 40 bytes of index
    assert sum(sent) < 100 * n, f"{sum(sent)} bytes sent to the workers for {n} samples"
    a = packio.open_dataset(tmp_path / "src.wds", decode=False)
    b = packio.open_dataset(tmp_path / "out.lmdb", decode=False)
    assert [a.sample(i).payload for i in range(0, n, 97)] == [b.sample(i).payload for i in range(0, n, 97)]
