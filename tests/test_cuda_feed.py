"""GPU feed: decode dispatch, prefetcher stream protocol, device resolution and
errors, on the CPU (fakes for the GPU side); CUDA paths run only where CUDA is."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, jpeg, photo
from packio import decode as cpu
from packio.cuda import BatchDecoder, PackedBoxes, Prefetcher, decode_batch
from packio.cuda import backends, prefetch
from packio.cuda import device as devmod
from packio.cuda.decode import gpu_decodable, jpeg_header
from packio.errors import PackioError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cmyk_jpeg(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(photo(h, w, seed)).convert("CMYK").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def pil_jpeg(h: int, w: int, seed: int, **kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(photo(h, w, seed)).save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


def png(h: int, w: int, seed: int) -> bytes:
    import cv2

    return cv2.imencode(".png", photo(h, w, seed))[1].tobytes()


def cpu_ref(blob: bytes) -> torch.Tensor:
    return torch.from_numpy(cpu.decode(blob)).permute(2, 0, 1)


def test_import_has_no_side_effects():
    code = "import sys, packio; assert 'torch' not in sys.modules and 'packio.cuda' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PackioError, match="no CUDA GPU.*device='cpu'"):
        Prefetcher([1], device="cuda")
    with pytest.raises(PackioError, match="no CUDA"):
        decode_batch([jpeg(8, 8, 0)], device="cuda")


def test_device_none_is_this_ranks_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert devmod.resolve(None) == torch.device("cuda", 2)
    assert devmod.resolve("cuda") == torch.device("cuda", 2)
    assert devmod.resolve("cuda:1") == torch.device("cuda", 1)  # explicit index wins
    monkeypatch.setenv("LOCAL_RANK", "5")  # one visible GPU per rank: its index is the current device
    assert devmod.resolve(None) == torch.device("cuda", 0)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # torch.cuda.set_device(3)
    assert devmod.resolve(None) == torch.device("cuda", 3)


def test_prefetcher_passthrough_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    devmod._warned.clear()
    batches = [{"image": torch.full((2, 3, 4, 4), k, dtype=torch.uint8), "label": torch.tensor([k, k]),
                "boxes": [torch.tensor([[1.0, 2, 3, 4]]), torch.zeros(0, 4)],
                "box_labels": [torch.tensor([7]), torch.zeros(0, dtype=torch.int64)], "key": ["a", "b"]}
               for k in range(3)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = list(Prefetcher(batches))
        out2 = list(Prefetcher(batches))
    assert sum("CUDA is not available" in str(x.message) for x in w) == 1  # said once
    assert [int(b["label"][0]) for b in out] == [0, 1, 2] and out2[2]["key"] == ["a", "b"]
    assert all(b["image"].device.type == "cpu" for b in out)
    p = out[1]["boxes"]  # packed, labels travel inside, in step
    assert isinstance(p, PackedBoxes) and "box_labels" not in out[1]
    assert p.image.tolist() == [0] and p.labels.tolist() == [7] and p.boxes.tolist() == [[1, 2, 3, 4]]
    assert isinstance(next(iter(Prefetcher(batches, pack_boxes=False)))["boxes"], list)
    tup = list(Prefetcher([(torch.ones(2), [torch.ones(1)])], device="cpu",
                          transform=lambda b: (b[0] * 2, b[1])))
    assert torch.equal(tup[0][0], torch.full((2,), 2.0)) and isinstance(tup[0], tuple)


class FakeOps:
    """Stands in for CUDA streams: 'device' tensors are CPU clones it remembers, and
    every stream operation is logged in order, with the loader's pulls."""

    def __init__(self, log: list) -> None:
        self.log, self.side, self.dev, self.pinned_ids, self.keep = log, "side", set(), set(), []
        self.stream = "main"
        self.events = 0

    def current(self):
        return self.stream

    @contextlib.contextmanager
    def use(self, s):
        before, self.stream = self.stream, s
        try:
            yield
        finally:
            self.stream = before

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        self.dev.add(t.untyped_storage().data_ptr())  # views of it are on the 'device' too
        self.keep.append(t)
        return t

    def on_device(self, t):
        return t.untyped_storage().data_ptr() in self.dev

    def pinned(self, t):
        return id(t) in self.pinned_ids

    def pin(self, t):
        self.log.append(("pin", tuple(t.shape)))
        out = t.clone()
        self.pinned_ids.add(id(out))
        self.keep.append(out)
        return out

    def staging(self, n):
        return self.pin(torch.empty(n, dtype=torch.uint8))

    def copy(self, t):
        assert self.stream == "side", "copies run on the side stream"
        assert self.pinned(t), "only pinned memory is copied (non_blocking)"
        self.log.append(("copy", t.numel() * t.element_size()))
        return self.mark(t.clone())

    def record(self, t, s):
        self.log.append(("record", id(t), s))

    def event(self, s):
        self.events += 1
        self.log.append(("event", self.events, s))
        return self.events

    def wait_event(self, s, e):
        self.log.append(("wait_event", s, e))

    def wait_stream(self, s, other):
        self.log.append(("wait_stream", s, other))


def _fake_prefetcher(monkeypatch, loader, log, **kw) -> tuple[Prefetcher, FakeOps]:
    ops = FakeOps(log)
    pf = Prefetcher(loader, device="cpu", **kw)
    pf.device = torch.device("cuda", 0)
    monkeypatch.setattr(prefetch, "CudaOps", lambda dev: ops)
    return pf, ops


def test_prefetcher_ring_events_and_record_stream(monkeypatch):
    log: list = []
    n, depth = 6, 2

    def loader():
        for k in range(n):
            log.append(("pull", k))
            yield {"image": torch.full((2, 3, 4, 4), k, dtype=torch.uint8), "label": torch.tensor([k, -k]),
                   "boxes": [torch.rand(k % 3, 4), torch.rand(1, 4)],
                   "box_labels": [torch.arange(k % 3), torch.tensor([9])], "key": ["a", "b"]}

    def tf(b):  # runs on the side stream: its outputs must be recorded too
        return {**b, "image": ops.mark(b["image"].float() * 2)}

    pf, ops = _fake_prefetcher(monkeypatch, loader(), log, transform=tf, depth=depth)
    got = []
    for k, batch in enumerate(pf):
        pulls = sum(1 for e in log if e[0] == "pull")
        assert pulls == min(k + depth + 1, n)  # the ring holds `depth` batches beyond this one
        # the consumer's stream waited on this batch's event before it was handed out
        waits = [e for e in log if e[0] == "wait_event"]
        assert waits[-1][1] == "main"
        handed = [t for t in prefetch._tensors(batch)]
        recorded = {e[1] for e in log if e[0] == "record" and e[2] == "main"}
        assert all(id(t) in recorded for t in handed), "every tensor handed out is record_stream-ed"
        assert len(handed) == 6  # image, label, packed boxes (4 tensors)
        got.append(batch)
    assert len(got) == n
    for k, b in enumerate(got):
        assert torch.equal(b["image"], torch.full((2, 3, 4, 4), 2.0 * k))
        assert b["label"].tolist() == [k, -k] and b["key"] == ["a", "b"]
        assert b["boxes"].labels.tolist() == list(range(k % 3)) + [9]
        assert b["boxes"].image.tolist() == [0] * (k % 3) + [1]
    # per batch: one copy for all the small tensors (image is small here too), no per-box copies
    assert sum(1 for e in log if e[0] == "copy") == n
    assert not any(e[0] == "wait_stream" for e in log)  # host-only batches never wait on the consumer


def test_prefetcher_waits_for_gpu_side_producer(monkeypatch):
    log: list = []
    ops_holder: list[FakeOps] = []

    def loader():
        for k in range(3):
            ops = ops_holder[0]
            # produced on the consumer's stream (e.g. decoded on the GPU): already on the device
            yield {"image": ops.mark(torch.full((1, 3, 2, 2), k, dtype=torch.uint8)), "label": torch.tensor([k])}

    pf, ops = _fake_prefetcher(monkeypatch, loader(), log)
    ops_holder.append(ops)
    images = []
    for b in pf:
        images.append(b["image"])
    order = [e[0] for e in log]
    for k, img in enumerate(images):
        assert float(img[0, 0, 0, 0]) == k
    # each batch: the side stream waits for the consumer's stream before any copy for it,
    # and the producer's tensor is recorded on the side stream that reads it
    ws = [i for i, e in enumerate(log) if e[0] == "wait_stream"]
    assert len(ws) == 3 and all(log[i][1:] == ("side", "main") for i in ws)
    for i in ws:
        nxt = order.index("copy", i)
        assert log[i + 1][0] == "record" and log[i + 1][2] == "side" and nxt > i
    assert {id(t) for t in images} <= {e[1] for e in log if e[0] == "record" and e[2] == "main"}


def test_prefetcher_copies_large_pinned_tensors_directly(monkeypatch):
    log: list = []
    big = torch.arange(2 * prefetch.SMALL // 8 + 8, dtype=torch.int64)
    pf, ops = _fake_prefetcher(monkeypatch, [{"image": big, "label": torch.tensor([1, 2])}], log)
    out = list(pf)[0]
    assert torch.equal(out["image"], big) and out["label"].tolist() == [1, 2]
    copies = [e[1] for e in log if e[0] == "copy"]
    assert sorted(copies) == [16, big.numel() * 8]  # the large pageable one pinned then copied alone
    assert ("pin", tuple(big.shape)) in log


def test_to_device_staging_keeps_dtypes_and_shapes(monkeypatch):
    log: list = []
    ops = FakeOps(log)
    batch = {"a": torch.tensor([True, False, True]), "b": torch.arange(5, dtype=torch.int16).view(5, 1),
             "c": [torch.rand(3, 4).t(), torch.zeros(0, 4)], "d": torch.tensor(3.5, dtype=torch.float64)}
    with ops.use("side"):
        out = prefetch.to_device(batch, ops)
    assert sum(1 for e in log if e[0] == "copy") == 1
    for x, y in zip(prefetch._tensors(batch), prefetch._tensors(out)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) and ops.on_device(y)


def test_jpeg_header_screening():
    assert jpeg_header(jpeg(30, 40, 1))[1:] == (8, 30, 40, 3)
    assert jpeg_header(jpeg(30, 40, 1)).sof == 0xC0
    prog = pil_jpeg(30, 40, 2, progressive=True)
    assert jpeg_header(prog).sof == 0xC2 and gpu_decodable(prog)
    assert jpeg_header(cmyk_jpeg(20, 20, 3)).components == 4 and not gpu_decodable(cmyk_jpeg(20, 20, 3))
    assert not gpu_decodable(png(10, 10, 1)) and jpeg_header(png(10, 10, 1)) is None
    good = jpeg(16, 16, 4)
    assert all(jpeg_header(good[:k]) is None for k in range(0, 40))  # truncated before the frame header


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 30))
def test_jpeg_header_fuzz(junk, cut):
    good = jpeg(8, 8, 0)
    for data in (b"\xff\xd8" + junk, good[:cut] + junk, b"\xff\xd8\xff\xc0" + junk):
        h = jpeg_header(data)  # never raises, never reads past the end
        assert h is None or isinstance(h.components, int)


class RejectingBackend:
    """A GPU backend double: decodes on the CPU but rejects images of odd width, and
    remembers each call's batch."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def decode(self, blobs, device):
        self.calls.append(len(blobs))
        out = []
        for b in blobs:
            img = cpu_ref(bytes(b)).contiguous()
            out.append(None if img.shape[-1] % 2 else img.to(device))
        return out


def test_batch_decoder_falls_back_per_image_only():
    blobs = [jpeg(20, 30 + k, k) for k in range(6)]  # widths 30..35: three odd ones rejected
    blobs += [cmyk_jpeg(16, 24, 7), png(12, 14, 8), pil_jpeg(18, 22, 9, progressive=True)]
    be = RejectingBackend()
    dec = BatchDecoder("cpu", be)
    out = dec(blobs)
    assert be.calls == [7]  # one batched call with every GPU-decodable image (not the CMYK, not the PNG)
    assert dec.gpu_decoded == 4 and dec.cpu_decoded == 5
    for b, t in zip(blobs, out):
        assert t.dtype == torch.uint8 and t.shape[0] == 3
        assert torch.equal(t, cpu_ref(b))  # pixel for pixel, fallbacks included


def test_batch_decoder_names_the_undecodable_sample():
    with pytest.raises(PackioError, match="'k2'.*cannot be decoded"):
        BatchDecoder("cpu", RejectingBackend())([jpeg(8, 8, 0), jpeg(8, 8, 1), b"\xff\xd8junk"], keys=["k0", "k1", "k2"])


class AllOrNothingTV:
    """torchvision.io double: decode_jpeg fails the whole list when one image is bad."""

    class ImageReadMode:
        RGB = "RGB"

    def __init__(self, bad: set[int]) -> None:
        self.bad, self.calls = bad, 0

    def decode_jpeg(self, tensors, mode, device):
        self.calls += 1
        imgs = []
        for t in tensors:
            if len(t) in self.bad:
                raise RuntimeError("nvjpeg: unsupported")
            imgs.append(cpu_ref(t.numpy().tobytes()))
        return imgs


def test_torchvision_backend_isolates_bad_images():
    blobs = [jpeg(16, 16 + k, k) for k in range(32)]
    bad = {len(blobs[5]), len(blobs[20])}
    tv = AllOrNothingTV(bad)
    out = backends.TorchvisionBackend(module=tv).decode(blobs, torch.device("cpu"))
    assert [i for i, t in enumerate(out) if t is None] == [i for i, b in enumerate(blobs) if len(b) in bad]
    assert tv.calls <= 1 + 2 * 2 * 5  # O(k log n), not one call per image
    assert all(torch.equal(t, cpu_ref(b)) for b, t in zip(blobs, out) if t is not None)


def test_missing_backend_names_its_extra(monkeypatch):
    monkeypatch.setattr(backends, "available", lambda name: False)
    assert backends.get_backend("auto") is None and backends.get_backend("cpu") is None
    with pytest.raises(PackioError, match="unknown decode backend"):
        backends.get_backend("nvjpeg")
    real = __import__("builtins").__import__

    def blocked(name, *a, **kw):
        if name.startswith(("torchvision", "nvidia")):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr("builtins.__import__", blocked)
    with pytest.raises(PackioError, match=r"packio\[gpu\]"):
        backends.get_backend("torchvision")
    with pytest.raises(PackioError, match=r"packio\[nvimgcodec\]"):
        backends.get_backend("nvimgcodec")


@pytest.mark.skipif(not backends.available("nvimgcodec"), reason="nvImageCodec not installed")
def test_nvimgcodec_backend_matches_cpu_decoder():
    # Without a GPU this runs nvImageCodec's CPU decoder through the same adapter code.
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    blobs = [jpeg(21, 35, 1), pil_jpeg(18, 22, 2, progressive=True), b"\xff\xd8\xff\xdbjunk"]
    out = backends.NvImageCodecBackend().decode(blobs, dev)
    assert out[2] is None
    for b, t in zip(blobs[:2], out[:2]):
        diff = (t.cpu().int() - cpu_ref(b).int()).abs().float()
        assert t.shape == cpu_ref(b).shape and diff.mean() < 1.5


def test_decode_batch_cpu_matches_cpu_decoder():
    blobs = [jpeg(30, 40, 1), jpeg(20, 24, 2), png(9, 11, 3)]
    out = decode_batch(blobs, device="cpu")
    for b, t in zip(blobs, out):
        assert torch.equal(t, cpu_ref(b))


def test_training_example_runs_on_cpu(gen_folder, tmp_path):
    import packio

    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    r = subprocess.run([sys.executable, "examples/train_classifier.py", str(tmp_path / "d.lmdb"), "--steps", "4",
                        "--batch-size", "4", "--size", "32", "--workers", "0", "--device", "cpu", "--gpu-decode"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    losses = [float(line.split("loss=")[1].split()[0]) for line in r.stdout.splitlines() if "loss=" in line]
    assert len(losses) == 4 and all(np.isfinite(losses))


@cuda
def test_gpu_decode_matches_cpu_and_falls_back():
    blobs = [jpeg(64, 80, k) for k in range(6)] + [cmyk_jpeg(32, 32, 9), png(16, 16, 1)]
    dec = BatchDecoder("cuda")
    out = dec(blobs)
    assert all(t.is_cuda and t.shape[0] == 3 for t in out)
    assert dec.cpu_decoded >= 2
    for b, t in zip(blobs, out):
        diff = (t.cpu().int() - cpu_ref(b).int()).abs().float().mean()
        assert diff < 2.0


@cuda
def test_prefetcher_on_cuda_keeps_values_and_boxes():
    batches = [{"image": torch.full((4, 3, 8, 8), k, dtype=torch.uint8),
                "boxes": [torch.ones(k, 4), torch.zeros(1, 4)], "label": torch.arange(4)} for k in range(5)]
    out = list(Prefetcher(batches, device="cuda", transform=lambda b: {**b, "image": b["image"].float()}))
    assert all(b["image"].is_cuda and float(b["image"][0, 0, 0, 0]) == k for k, b in enumerate(out))
    assert [len(b["boxes"].boxes) for b in out] == [k + 1 for k in range(5)]
