"""GPU feed: API, fallbacks and errors on the CPU; CUDA paths run only where CUDA is."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from conftest import jpeg, photo
from packio import decode as cpu
from packio.cuda import GPUTransform, Prefetcher, center_crop, decode_batch, hflip, normalize, resize
from packio.cuda import device as devmod
from packio.errors import PackioError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_import_has_no_side_effects():
    code = "import sys, packio; assert 'torch' not in sys.modules and 'packio.cuda' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PackioError, match="no CUDA GPU.*device='cpu'"):
        Prefetcher([1], device="cuda")
    with pytest.raises(PackioError, match="no CUDA"):
        decode_batch([jpeg(8, 8, 0)], device="cuda")


def test_prefetcher_passthrough_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    devmod._warned.clear()
    batches = [{"image": torch.full((2, 3, 4, 4), k, dtype=torch.uint8), "label": torch.tensor([k, k]),
                "boxes": [torch.zeros(1, 4), torch.zeros(0, 4)], "key": ["a", "b"]} for k in range(3)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = list(Prefetcher(batches))
        out2 = list(Prefetcher(batches))
    assert sum("CUDA is not available" in str(x.message) for x in w) == 1  # said once
    assert [int(b["label"][0]) for b in out] == [0, 1, 2] and out2[2]["key"] == ["a", "b"]
    assert all(b["image"].device.type == "cpu" for b in out)
    tup = list(Prefetcher([(torch.ones(2), [torch.ones(1)])], device="cpu",
                          transform=lambda b: (b[0] * 2, b[1])))
    assert torch.equal(tup[0][0], torch.full((2,), 2.0)) and isinstance(tup[0], tuple)


def test_decode_batch_cpu_matches_cpu_decoder():
    blobs = [jpeg(30, 40, 1), jpeg(20, 24, 2)]
    out = decode_batch(blobs, device="cpu")
    for b, t in zip(blobs, out):
        assert t.shape == (3, *cpu.decode(b).shape[:2])
        np.testing.assert_array_equal(t.permute(1, 2, 0).numpy(), cpu.decode(b))


def test_gpu_decode_without_torchvision_names_the_extra(monkeypatch):
    import builtins

    from packio.cuda import decode as gdec

    real = builtins.__import__

    def no_tv(name, *a, **kw):
        if name.startswith("torchvision"):
            raise ImportError("No module named 'torchvision'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tv)
    with pytest.raises(PackioError, match=r"packio\[gpu\]"):
        gdec._torchvision_io()


def test_transforms_on_cpu():
    img = torch.from_numpy(photo(40, 60, 3)).permute(2, 0, 1).contiguous()
    batch = torch.stack([img, img])
    boxes = [torch.tensor([[10.0, 5.0, 30.0, 20.0]]), torch.zeros(0, 4)]
    x, b = resize(batch, (20, 30), boxes)
    assert x.shape == (2, 3, 20, 30) and torch.allclose(b[0], torch.tensor([[5.0, 2.5, 15.0, 10.0]]))
    c, cb = center_crop(batch, (20, 40), boxes)
    assert c.shape == (2, 3, 20, 40) and torch.allclose(cb[0], torch.tensor([[0.0, 0.0, 20.0, 10.0]]))
    f, fb, flipped = hflip(batch, boxes, p=1.0)
    assert flipped.all() and torch.equal(f[0], img.flip(-1))
    assert torch.allclose(fb[0], torch.tensor([[30.0, 5.0, 50.0, 20.0]]))
    n = normalize(batch, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), dtype=torch.bfloat16, channels_last=True)
    assert n.dtype == torch.bfloat16 and n.is_contiguous(memory_format=torch.channels_last)
    ref = (batch.float() / 255 - 0.5) / 0.25
    assert torch.allclose(n.float(), ref, atol=0.05)
    out = GPUTransform(size=(16, 16), train=True)({"image": [img, img[:, :30, :50]], "boxes": boxes,
                                                   "label": torch.tensor([0, 1])})
    assert out["image"].shape == (2, 3, 16, 16) and len(out["boxes"]) == 2


def test_training_example_runs_on_cpu(gen_folder, tmp_path):
    import packio

    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    r = subprocess.run([sys.executable, "examples/train_classifier.py", str(tmp_path / "d.lmdb"), "--steps", "4",
                        "--batch-size", "4", "--size", "32", "--workers", "0", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    losses = [float(line.split("loss=")[1].split()[0]) for line in r.stdout.splitlines() if "loss=" in line]
    assert len(losses) == 4 and all(np.isfinite(losses))


@cuda
def test_gpu_decode_matches_cpu_and_falls_back():
    from PIL import Image
    import io

    blobs = [jpeg(64, 80, k) for k in range(6)]
    buf = io.BytesIO()
    Image.fromarray(photo(32, 32, 9)).convert("CMYK").save(buf, format="JPEG")
    blobs.append(buf.getvalue())
    ok, png = __import__("cv2").imencode(".png", photo(16, 16, 1))
    blobs.append(png.tobytes())
    out = decode_batch(blobs, device="cuda")
    assert all(t.is_cuda and t.shape[0] == 3 for t in out)
    for b, t in zip(blobs[:6], out):
        diff = (t.cpu().permute(1, 2, 0).int() - torch.from_numpy(cpu.decode(b)).int()).abs().float().mean()
        assert diff < 2.0


@cuda
def test_prefetcher_on_cuda_overlaps_and_keeps_values():
    batches = [{"image": torch.full((4, 3, 8, 8), k, dtype=torch.uint8), "boxes": [torch.ones(k, 4)]}
               for k in range(5)]
    out = [b for b in Prefetcher(batches, device="cuda", transform=lambda b: {**b, "image": b["image"].float()})]
    assert all(b["image"].is_cuda and float(b["image"][0, 0, 0, 0]) == k for k, b in enumerate(out))
    assert [len(b["boxes"][0]) for b in out] == list(range(5))
