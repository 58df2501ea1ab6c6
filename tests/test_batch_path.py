"""The whole-batch fast path of fixed-shape formats returns exactly what the
per-sample path returns, through packio's loader and through a plain torch one."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import packio
import packio.read.decoder


@pytest.mark.parametrize("suffix", [".arrays", ".h5"])
@pytest.mark.parametrize("workers", [0, 2])
def test_fast_batches_match_samples(gen_folder, tmp_path, suffix, workers):
    src, csv = gen_folder
    path = tmp_path / f"d{suffix}"
    packio.convert(src, path, csv=csv, resize=packio.ResizeSpec(size=(24, 32)), progress=False)
    ds = packio.open_dataset(path)
    ref = {i: ds[i] for i in range(len(ds))}  # one sample at a time
    kw = {"multiprocessing_context": "fork"} if workers else {}
    loaders = [packio.DataLoader(ds, batch_size=5, shuffle=True, num_workers=workers, **kw),
               torch.utils.data.DataLoader(packio.open_dataset(path), batch_size=5, num_workers=workers,
                                           collate_fn=packio.collate, **kw)]
    for loader in loaders:
        seen = []
        for b in loader:
            assert isinstance(b["image"], torch.Tensor) and b["image"].shape[1:] == (3, 24, 32)
            assert isinstance(b["boxes"], list) and len(b["boxes"]) == len(b["label"])
            for j, i in enumerate(b["index"].tolist()):
                r = ref[i]
                assert torch.equal(b["image"][j], r["image"])
                assert int(b["label"][j]) == r["label"] and b["key"][j] == r["key"]
                assert torch.equal(b["boxes"][j], r["boxes"]) and torch.equal(b["box_labels"][j], r["box_labels"])
                seen.append(i)
        assert sorted(seen) == list(range(len(ds)))
    assert any(len(r["boxes"]) for r in ref.values())
    np.testing.assert_array_equal(ref[0]["image"].permute(1, 2, 0).numpy(), ds.sample(0).payload)


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_decoded_batches_match_samples(gen_folder, tmp_path, threads, workers):
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", resize=(24, 32), threads=threads)
    ref = {i: ds[i] for i in range(len(ds))}
    kw = {"multiprocessing_context": "fork"} if workers else {}
    seen = []
    for b in packio.DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers, **kw):
        assert b["image"].shape[1:] == (3, 24, 32)
        for j, i in enumerate(b["index"].tolist()):
            assert torch.equal(b["image"][j], ref[i]["image"])
            assert torch.allclose(b["boxes"][j], ref[i]["boxes"]) and b["key"][j] == ref[i]["key"]
            assert int(b["label"][j]) == ref[i]["label"]
            seen.append(i)
    assert sorted(seen) == list(range(len(ds)))
    assert any(len(r["boxes"]) for r in ref.values())


@pytest.mark.parametrize("suffix, resize", [(".arrays", None), (".h5", None), (".lmdb", (24, 32))])
def test_one_read_batches_are_handed_on_without_a_copy(gen_folder, tmp_path, suffix, resize):
    """A batch read in one go (raw gather, or decode+resize into one buffer) is list-like: its
    per-sample items view one buffer, which packio.collate hands on instead of stacking."""
    src, csv = gen_folder
    spec = packio.ResizeSpec(size=(24, 32)) if suffix != ".lmdb" else None
    packio.convert(src, tmp_path / f"d{suffix}", csv=csv, resize=spec, progress=False)
    ds = packio.open_dataset(tmp_path / f"d{suffix}", resize=resize)
    items = ds.__getitems__([5, 2, 9, 0])
    batch = packio.collate(items)
    assert batch["image"].shape == (4, 3, 24, 32)
    assert batch["image"].untyped_storage().data_ptr() == items[0]["image"].untyped_storage().data_ptr()
    for j, i in enumerate([5, 2, 9, 0]):
        assert torch.equal(batch["image"][j], ds[i]["image"])
    swapped = packio.collate([items[1], items[0]])["image"]  # not slot after slot: stacked into a new tensor
    assert swapped.data_ptr() != items[0]["image"].data_ptr() and torch.equal(swapped[1], items[0]["image"])


@pytest.mark.parametrize("context, persistent", [("fork", False), ("spawn", True), ("forkserver", True)])
def test_held_batches_never_change_across_epochs(gen_folder, tmp_path, context, persistent):
    """Batches kept from the first epoch still hold their pixels after seven more, under
    every start method, with and without persistent workers."""
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", resize=(24, 32))
    ref = {i: ds[i]["image"] for i in range(len(ds))}
    loader = packio.DataLoader(ds, batch_size=2, shuffle=True, num_workers=2, multiprocessing_context=context,
                               persistent_workers=persistent)
    held, seen = [], []
    for epoch in range(8):
        for k, b in enumerate(loader):
            seen += b["index"].tolist()
            if epoch == 0 and k % 3 == 0:
                held.append((b["index"].tolist(), b["image"]))
            for j, i in enumerate(b["index"].tolist()):
                assert torch.equal(b["image"][j], ref[i])
    for idx, images in held:  # every kept batch, after all the later ones
        for j, i in enumerate(idx):
            assert torch.equal(images[j], ref[i])
    assert sorted(seen) == sorted(list(range(len(ds))) * 8)


def _one_size_folder(root, n: int = 8, hw: tuple[int, int] = (24, 32)):
    """A class folder of ``n`` JPEGs of one size (a dataset of pre-sized images)."""
    from conftest import jpeg

    (root / "a").mkdir(parents=True)
    for k in range(n):
        (root / "a" / f"i{k}.jpg").write_bytes(jpeg(*hw, seed=k))
    return root


@pytest.mark.parametrize("suffix, kw", [(".lmdb", {}), (".wds", {}), (".bmpdir", {"encode": "bmp"})])
@pytest.mark.parametrize("threads", [0, 2])
def test_unresized_one_size_batch_is_decoded_into_one_buffer(tmp_path, monkeypatch, suffix, kw, threads):
    """Images of one size, read without a resize: the batch's images are decoded straight into
    one buffer (no image per sample stacked afterwards), and equal ``ds[i]``, strides too."""
    packio.convert(_one_size_folder(tmp_path / "src"), tmp_path / f"d{suffix}", progress=False, **kw)
    ds = packio.open_dataset(tmp_path / f"d{suffix}", threads=threads)
    ref = {i: ds[i] for i in range(len(ds))}

    def no_stack(images):
        raise AssertionError("the batch's images were decoded one by one and stacked (a copy)")

    monkeypatch.setattr(packio.read.decoder, "stack_images", no_stack)
    order = [5, 2, 7, 0, 1]
    batch = ds.__getitems__(order)
    assert isinstance(batch.image, torch.Tensor) and batch.image.shape == (5, 3, 24, 32)
    for j, i in enumerate(order):
        got, want = batch[j]["image"], ref[i]["image"]
        assert torch.equal(got, want) and got.stride() == want.stride()
        assert batch[j]["key"] == ref[i]["key"]


@pytest.mark.parametrize("claim", [(24, 32), (0, 0), (4000, 4000)])
def test_records_that_misstate_the_size_still_give_the_images_pixels(tmp_path, monkeypatch, claim):
    """A JPEG is decoded into an array of the size its record gives (``ds[i]``) or into the
    batch's buffer: a record that misstates the size (larger, smaller, none) still yields the
    image's own pixels and shape, alone and in a batch, whichever sample comes first."""
    src = _one_size_folder(tmp_path / "src")  # 24 x 32, but for a smaller and a larger one
    from conftest import jpeg

    (src / "a" / "i3.jpg").write_bytes(jpeg(16, 20, seed=50))
    (src / "a" / "i6.jpg").write_bytes(jpeg(40, 44, seed=51))
    packio.convert(src, tmp_path / "d.lmdb", progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb")
    reader = ds.reader
    truth = {i: torch.from_numpy(packio.decode.decode(reader.read(i).payload)).permute(2, 0, 1)
             for i in range(len(ds))}
    assert {t.shape[1:] for t in truth.values()} == {(24, 32), (16, 20), (40, 44)}
    real = reader.read

    def misstated(i):
        s = real(i)
        s.height, s.width = claim
        return s

    monkeypatch.setattr(reader, "read", misstated)
    for i in range(len(ds)):
        assert torch.equal(ds[i]["image"], truth[i])
    for order in ([0, 3, 6, 1, 2], [3, 0, 1, 6], [6, 3, 0], [1, 2, 4, 5]):
        batch = ds.__getitems__(order)
        for j, i in enumerate(order):
            assert torch.equal(batch[j]["image"], truth[i]), (order, i)
    assert isinstance(ds.__getitems__([1, 2, 4, 5]).image, torch.Tensor)


def _sof_claims(data: bytes, h: int, w: int) -> bytes:
    """A JPEG whose frame header claims ``h`` x ``w`` over its own (small) scan: damaged."""
    b = bytearray(data)
    at = max(b.find(b"\xff\xc0"), b.find(b"\xff\xc2"))
    struct.pack_into(">HH", b, at + 5, h, w)
    return bytes(b)


def test_one_huge_header_does_not_size_every_row_of_the_batch(tmp_path, monkeypatch):
    """An unresized batch's buffer is shaped by its first image's header: a (damaged) first
    JPEG claiming up to the pixel limit (13000 x 13000) must not make the buffer n such images
    (n x 507 MB: a raw allocation error, or that much shared memory filled in a worker). The batch stays bounded by
    one image at the pixel limit; the damaged sample is skipped, the others are read."""
    packio.convert(_one_size_folder(tmp_path / "src", hw=(16, 16)), tmp_path / "d.lmdb", progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", on_error="skip")
    reader = ds.reader
    truth = {i: ds[i]["image"] for i in range(len(ds))}
    real = reader.read

    def hostile(i):
        s = real(i)
        if i == 0:
            s.payload = _sof_claims(bytes(s.payload), 5000, 5000)  # 8 x 5000 x 5000 > MAX_PIXELS
        return s

    made = []

    def spy(shape):
        made.append(shape)
        assert np.prod(shape) <= 3 * packio.limits.MAX_PIXELS, f"batch buffer of {shape}"
        return torch.empty(shape, dtype=torch.uint8)

    monkeypatch.setattr(reader, "read", hostile)
    monkeypatch.setattr(packio.read.decoder, "batch_buffer", spy)
    batch = ds.__getitems__(list(range(8)))
    assert batch.kept == [False] + [True] * 7
    for j in range(1, 8):
        assert torch.equal(batch[j]["image"], truth[j])


@pytest.mark.parametrize("resize", [None, (16, 16)])
def test_a_skipped_samples_row_of_the_batch_buffer_is_zeros(tmp_path, monkeypatch, resize):
    """A damaged sample skipped from a one-buffer batch leaves its row in ``Batch.image``
    (``kept`` marks it; collate drops it): that row holds zeros, never what the buffer's memory
    held before (a fresh buffer is uninitialised: another batch's pixels) or a partial decode."""
    packio.convert(_one_size_folder(tmp_path / "src", hw=(16, 16)), tmp_path / "d.lmdb", progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", on_error="skip", resize=resize)
    reader = ds.reader
    truth = {i: ds[i]["image"] for i in range(len(ds))}
    real = reader.read

    def damaged(i):
        s = real(i)
        if i in (3, 6):  # cut short: the strict decode refuses them (after writing part of their rows)
            s.payload = bytes(s.payload)[:len(s.payload) * 2 // 3]
        return s

    monkeypatch.setattr(reader, "read", damaged)
    monkeypatch.setattr(packio.read.decoder, "batch_buffer", lambda shape: torch.full(shape, 77, dtype=torch.uint8))
    batch = ds.__getitems__(list(range(8)))
    assert batch.kept == [True] * 3 + [False] + [True] * 2 + [False, True]
    assert isinstance(batch.image, torch.Tensor) and batch.image.shape == (8, 3, 16, 16)  # the buffer itself
    for j in range(8):
        want = truth[j] if batch.kept[j] else torch.zeros(3, 16, 16, dtype=torch.uint8)
        assert torch.equal(batch.image[j], want), j


_ROOM_CHILD = r"""
import resource, sys
import packio, torch
ds = packio.open_dataset(sys.argv[1])
reader = ds.reader
truth, real = ds[1]["image"], reader.read


def claims_the_limit(i):
    s = real(i)
    s.height, s.width = 13000, 13000  # 169 M pixels: under MAX_PIXELS, 484 MiB decoded
    return s


reader.read = claims_the_limit
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20),) * 2)
print("SAME" if torch.equal(ds[1]["image"], truth) else "DIFFERENT")
"""


def test_a_record_claiming_the_pixel_limit_reads_under_a_memory_limit(tmp_path):
    """``ds[i]`` decodes into an array of the size the record claims: a tiny JPEG whose record
    claims 13000 x 13000 must still be read (its own pixels) in a process with less room than
    that claim (before: numpy's MemoryError, where the image itself needs 768 bytes)."""
    packio.convert(_one_size_folder(tmp_path / "src", n=2, hw=(16, 16)), tmp_path / "d.lmdb", progress=False)
    proc = subprocess.run([sys.executable, "-c", _ROOM_CHILD, str(tmp_path / "d.lmdb")], capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.strip() == "SAME", proc.stderr[-1500:]


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_decode_into_an_out_of_another_dtype_gives_its_values(dtype):
    """``decode(out=...)`` with an ``out`` that is not uint8: simplejpeg would write the
    pixel bytes into its memory and ``out`` would come back as those bytes reinterpreted
    (floats made of pixel bytes); the values must be the image's, cast."""
    from conftest import jpeg

    from packio.decode import decode

    data = jpeg(16, 24, seed=3)
    want = decode(data)
    got = decode(data, out=np.zeros((16, 24, 3), dtype))
    assert got.shape == want.shape and np.array_equal(got.astype(np.int64), want.astype(np.int64))


def test_decode_into_out_keeps_max_pixels(monkeypatch):
    """``decode(max_pixels=X, out=...)``: an ``out`` larger than ``X`` allows does not lift the
    limit; a JPEG whose header is over it is refused before it is decoded (before: decoded
    into ``out``, the limit ignored). The default limit (packio.limits.MAX_PIXELS) holds too;
    an ``out`` within the limit is the bound, as before."""
    from conftest import jpeg

    import packio.limits
    from packio.decode import decode

    data = jpeg(16, 24, seed=3)
    want = decode(data)
    for out in (np.zeros((16, 24, 3), np.uint8), np.zeros((40, 40, 3), np.uint8)):
        with pytest.raises(ValueError, match="over packio's limit of 100"):
            decode(data, max_pixels=100, out=out)
        assert not out.any()  # nothing was decoded into it
    assert np.array_equal(decode(data, max_pixels=16 * 24, out=np.zeros((16, 24, 3), np.uint8)), want)
    monkeypatch.setattr(packio.limits, "MAX_PIXELS", 100)
    with pytest.raises(ValueError, match="over packio's limit of 100"):
        decode(data, out=np.zeros((16, 24, 3), np.uint8))


@pytest.mark.parametrize("context", [None, "fork", "spawn"])
def test_decoded_pixels_start_16_bytes_past_a_32_byte_boundary(tmp_path, context):
    """Images are decoded into memory at 16 mod 32: libjpeg-turbo writes 32-byte-aligned output
    with non-temporal stores, which made a 64 px decode cost up to twice as much (torch's
    64-aligned batch buffers always, numpy's arrays half the time). ``ds[i]`` and every row of
    a batch, made in this process or in a DataLoader worker (shared memory), for sizes whose
    rows keep one alignment; and the pixels are still the image's."""
    packio.convert(_one_size_folder(tmp_path / "src", n=12, hw=(16, 32)), tmp_path / "d.lmdb", progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb")
    truth = {i: torch.from_numpy(packio.decode.decode(ds.sample(i).payload)).permute(2, 0, 1)
             for i in range(len(ds))}
    for i in range(len(ds)):
        img = ds[i]["image"]
        assert img.data_ptr() % 32 == 16 and torch.equal(img, truth[i])
    kw = {"num_workers": 2, "multiprocessing_context": context} if context else {}
    seen = []
    for b in packio.DataLoader(ds, batch_size=5, **kw):
        for j, i in enumerate(b["index"].tolist()):
            assert b["image"][j].data_ptr() % 32 == 16, (context, i)
            assert torch.equal(b["image"][j], truth[i])
            seen.append(i)
    assert sorted(seen) == list(range(len(ds)))


def _decoding_threads(ds, monkeypatch) -> set[str]:
    """Names of the threads that decoded one batch of ``ds``."""
    import threading
    import time

    from packio import decode as dec

    names: set[str] = set()
    real = dec.resize

    def resize(*a, **kw):
        names.add(threading.current_thread().name)
        time.sleep(0.02)  # long enough for every pool thread to take a sample
        return real(*a, **kw)

    monkeypatch.setattr(dec, "resize", resize)
    ds.__getitems__(list(range(len(ds))))
    return names


def test_default_threads_follow_torch(gen_folder_once, tmp_path, monkeypatch):
    """By default a batch is decoded on as many threads as torch's own CPU ops use (the
    training process's cores; 1 in a DataLoader worker, where torch sets 1); explicit
    ``threads`` wins, and a transform keeps one thread (its random draws stay in sample order)."""
    src, csv = gen_folder_once
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        ds = packio.open_dataset(tmp_path / "d.lmdb", resize=16)
        names = _decoding_threads(ds, monkeypatch)
        assert len(names) == 3 and sum(n.startswith("packio-decode") for n in names) == 2
        import threading

        assert sum(t.name.startswith("packio-decode") for t in threading.enumerate()) >= 2  # the process's pool
        torch.set_num_threads(1)  # as in a DataLoader worker
        assert _decoding_threads(ds, monkeypatch) == {"MainThread"}
        torch.set_num_threads(3)
        assert _decoding_threads(packio.open_dataset(tmp_path / "d.lmdb", resize=16, threads=0), monkeypatch) \
            == {"MainThread"}
        seq = packio.open_dataset(tmp_path / "d.lmdb", resize=16, transform=lambda x: x)
        assert _decoding_threads(seq, monkeypatch) == {"MainThread"}
        assert packio.open_dataset(tmp_path / "d.lmdb", resize=16, transform=lambda x: x, threads=2).threads == 2
    finally:
        torch.set_num_threads(before)


_AFTER_MAIN_CHILD = """
import atexit, sys, threading, time
import packio, torch
torch.set_num_threads(2)
ds = packio.open_dataset(sys.argv[1], resize=16)
atexit.register(lambda: print("ATEXIT", len(ds.__getitems__(list(range(len(ds))))), flush=True))


def train():
    while threading.main_thread().is_alive():  # until the main thread has ended: the interpreter is exiting
        time.sleep(0.01)
    print("THREAD", len(ds.__getitems__(list(range(len(ds))))), flush=True)


threading.Thread(target=train).start()
"""


def test_batches_read_while_the_interpreter_exits(gen_folder_once, tmp_path):
    """A training loop in a (non-daemon) thread that runs on after the main thread ended,
    and an atexit handler, read batches: the decode threads can start no more work then
    (concurrent.futures refuses it), so the calling thread decodes the batch itself
    (before: RuntimeError "cannot schedule new futures after interpreter shutdown")."""
    src, csv = gen_folder_once
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    n = len(packio.open_dataset(tmp_path / "d.lmdb"))
    proc = subprocess.run([sys.executable, "-c", _AFTER_MAIN_CHILD, str(tmp_path / "d.lmdb")], capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.split() == ["THREAD", str(n), "ATEXIT", str(n)], proc.stderr[-1500:]


_INTERRUPT_CHILD = """
import atexit, itertools, os, signal, sys, threading, time
import packio, torch
from packio import decode as dec
torch.set_num_threads(2)
ds = packio.open_dataset(sys.argv[1], resize=16)
real, calls, number = dec.resize, [], itertools.count(1)


def slow(*a, **kw):
    calls.append(time.monotonic())
    if next(number) == 6:  # each call its own number (two threads could both read len(calls) == 7)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, mid-batch
    time.sleep(0.05)
    return real(*a, **kw)


def held_start(self, start=threading.Thread.start):
    start(self)  # the helper thread runs; this (main) thread is held, as a loaded machine may, until the Ctrl-C
    threading.Event().wait(60)


dec.resize = slow
if sys.argv[2] == "held":
    threading.Thread.start = held_start
atexit.register(lambda: print("EXIT", len(calls)))  # after the decode helpers were joined
try:
    ds.__getitems__([i % len(ds) for i in range(200)])
except KeyboardInterrupt:
    print("INTERRUPTED", len(calls))
"""


@pytest.mark.parametrize("held", ["", "held"])
def test_ctrl_c_mid_batch_stops_the_decode_threads(gen_folder_once, tmp_path, held):
    """Ctrl-C while a batch is decoded on the default threads: the other threads take no
    further sample, so the interrupt surfaces at once (before: the pool thread decoded
    the rest of the batch alone first, 190 of 200 samples here, twice the batch's time).
    ``held``: the Ctrl-C comes while the main thread is still starting the helper thread
    (before: the helper decoded the whole batch alone, and the executor, which never
    registered that thread, left it waiting for work: the process never exited)."""
    src, csv = gen_folder_once
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT_CHILD, str(tmp_path / "d.lmdb"), held],
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout.split()
    assert out[:1] == ["INTERRUPTED"] and out[2:3] == ["EXIT"], proc.stderr[-1500:]
    assert int(out[1]) <= 9 and int(out[3]) <= 9  # the 6 started before the interrupt, and what was in flight then


def test_every_dataset_shares_the_processs_decode_threads(gen_folder_once, tmp_path):
    """Decode threads are one pool per process, whatever the number of datasets (a mix of
    many sources, train and validation sets): not a pool of its own per dataset."""
    import threading

    src, csv = gen_folder_once
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    sets = [packio.open_dataset(tmp_path / "d.lmdb", resize=16, threads=3) for _ in range(8)]
    for ds in sets:
        ds.__getitems__([0, 1, 2, 3])
    assert sum(t.name.startswith("packio-decode") for t in threading.enumerate()) <= 2 + 2  # +2: a pool being replaced


_NESTED_CHILD = """
import sys
import packio
inner = packio.open_dataset(sys.argv[1], resize=8, threads=2)
outer = packio.open_dataset(sys.argv[1], resize=16, threads=2,
                            transform=lambda im: (inner.__getitems__([0, 1, 2]), im)[1])
print(len(outer.__getitems__(list(range(6)))), flush=True)
"""


def test_a_batch_read_inside_a_decode_thread_does_not_wait_on_itself(gen_folder_once, tmp_path):
    """A transform that reads a batch of another threaded dataset runs on a decode thread;
    that inner batch's helper may be queued behind the very thread waiting for it. It is
    cancelled (nothing is left for it to do), not waited for: no deadlock."""
    src, csv = gen_folder_once
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    try:
        proc = subprocess.run([sys.executable, "-c", _NESTED_CHILD, str(tmp_path / "d.lmdb")], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a nested batch waited on its own decode thread")
    assert proc.returncode == 0 and proc.stdout.split() == ["6"], proc.stderr[-1500:]
