"""Batched GPU transforms, run on CPU tensors: pixels against torch's own resize,
boxes against packio.geometry and against the pixels, and no host sync per batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from conftest import jpeg
from packio import geometry
from packio.cuda import (GPUTransform, PackedBoxes, center_crops, center_window, normalize, resized_crop,
                         sample_crops)
from packio.cuda import boxes as bx
from packio.cuda.decode import cpu_decode
from packio.cuda.transforms import _groups, image_sizes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def images(sizes, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g).to(device) for h, w in sizes]


def reference(imgs, window, size, flip, antialias=True):
    out = []
    for k, im in enumerate(imgs):
        t, l, h, w = (int(v) for v in window[k])
        ref = F.interpolate(im[None, :, t:t + h, l:l + w].float(), size=size, mode="bilinear", antialias=antialias,
                            align_corners=False)[0]
        out.append(ref.flip(-1) if flip is not None and flip[k] else ref)
    return torch.stack(out)


@pytest.mark.parametrize("antialias", [True, False])
def test_resized_crop_equals_per_image_interpolate(antialias):
    sizes = [(40, 60), (50, 30), (33, 47), (61, 61)]
    imgs = images(sizes)
    g = torch.Generator().manual_seed(1)
    window = sample_crops(image_sizes(imgs), generator=g)
    flip = torch.tensor([False, True, True, False])
    for size in [(16, 20), (70, 90)]:  # down and up
        out = resized_crop(imgs, window, size, flip, antialias)
        assert out.shape == (4, 3, *size) and out.dtype == torch.float32
        torch.testing.assert_close(out, reference(imgs, window, size, flip, antialias), atol=2e-3, rtol=0)
    batch = torch.stack(images([(48, 64)] * 3, seed=2))  # one [B, C, H, W] tensor, channels_last memory too
    batch = batch.contiguous(memory_format=torch.channels_last)
    window = center_crops(image_sizes(batch), (24, 24), 0.875)
    torch.testing.assert_close(resized_crop(batch, window, (24, 24)), reference(batch, window, (24, 24), None),
                               atol=2e-3, rtol=0)


def test_resized_crop_groups_very_different_sizes():
    sizes = [(30, 40), (40, 30), (300, 20), (32, 41), (20, 300)]
    assert len(_groups(sizes)) > 1  # padding everything to 300x300 would waste too much
    imgs = images(sizes, seed=3)
    window = sample_crops(image_sizes(imgs), generator=torch.Generator().manual_seed(4))
    flip = torch.tensor([True, False, True, False, True])
    want = reference(imgs, window, (12, 12), flip)
    torch.testing.assert_close(resized_crop(imgs, window, (12, 12), flip), want, atol=2e-3, rtol=0)



def test_sample_crops_follow_the_rules():
    g = torch.Generator().manual_seed(0)
    hw = torch.stack([torch.randint(20, 400, (256,), generator=g), torch.randint(20, 400, (256,), generator=g)], 1)
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    w1 = sample_crops(hw, scale, ratio, torch.Generator().manual_seed(5))
    w2 = sample_crops(hw, scale, ratio, torch.Generator().manual_seed(5))
    assert torch.equal(w1, w2) and w1.dtype == torch.float32 and torch.equal(w1, w1.round())
    top, left, h, w = w1.unbind(1)
    H, W = hw[:, 0].float(), hw[:, 1].float()
    assert bool(((top >= 0) & (left >= 0) & (h >= 1) & (w >= 1) & (top + h <= H) & (left + w <= W)).all())
    frac = h * w / (H * W)
    assert float(frac.min()) >= 0.08 * 0.8 and float(frac.max()) <= 1.0
    assert len(set(map(tuple, w1.tolist()))) > 200  # draws differ per image
    # Impossible parameters: every image takes torchvision's fallback, the whole image clamped to the ratio.
    hw2 = torch.tensor([[100, 300], [300, 100], [100, 120]])
    fb = sample_crops(hw2, (1.0, 1.0), (1.0, 1.0), torch.Generator().manual_seed(0))
    assert fb.tolist() == [[0, 100, 100, 100], [100, 0, 100, 100], [0, 10, 100, 100]]
    fb = sample_crops(hw2[2:], (2.0, 2.0), (0.5, 2.0), torch.Generator().manual_seed(0))
    assert fb.tolist() == [[0, 0, 100, 120]]


def test_center_crops():
    hw = torch.tensor([[375, 500], [500, 375], [101, 30]])
    assert center_crops(hw[:2], (224, 224)).tolist() == [[0, 0, 375, 500], [0, 0, 500, 375]]
    assert center_crops(hw[:2], (224, 224), 0.875).tolist() == [[23, 86, 328, 328], [86, 23, 328, 328]]
    assert center_window(hw, (224, 40)).tolist() == [list(geometry.center_window(h, w, 224, 40)) for h, w in
                                                     hw.tolist()]


def random_boxes(rng, n, w, h):
    x0, y0 = rng.uniform(-20, w + 20, n), rng.uniform(-20, h + 20, n)
    b = np.stack([x0, y0, x0 + rng.uniform(0, w / 2, n), y0 + rng.uniform(0, h / 2, n)], 1).astype(np.float32)
    b[: n // 8, 2] = b[: n // 8, 0]  # some zero-area boxes
    return b


@pytest.mark.parametrize("min_visible", [0.0, 0.6])
def test_box_twin_equals_numpy_geometry(min_visible):
    rng = np.random.default_rng(0)
    sizes = [(int(rng.integers(20, 300)), int(rng.integers(20, 300))) for _ in range(40)]
    per_img = [random_boxes(rng, int(rng.integers(0, 30)), w, h) for h, w in sizes]
    labels = [rng.integers(0, 1000, len(b)) for b in per_img]
    # windows include edge-touching cases: boxes snapped onto a window edge
    windows = []
    for (h, w), b in zip(sizes, per_img):
        ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        t, l = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        if len(b) > 2:
            b[0, 2], b[1, 0] = l, l + cw  # touches the left edge from outside / the right edge from outside
        windows.append((t, l, ch, cw))
    p = PackedBoxes.from_lists([torch.from_numpy(b) for b in per_img], [torch.from_numpy(x) for x in labels])
    win = torch.tensor(windows, dtype=torch.float32)
    out_hw = (224, 160)
    flip = torch.from_numpy(rng.random(len(sizes)) < 0.5)
    q = bx.hflip(bx.resize(bx.crop(p, win, min_visible), win[:, 2:], out_hw), out_hw[1], flip)
    got_boxes, got_labels = q.per_image()
    dropped = 0
    for k, (b, lab, (t, l, ch, cw)) in enumerate(zip(per_img, labels, windows)):
        eb, el = geometry.crop(b, lab, t, l, ch, cw, min_visible)
        eb = geometry.resize(eb, (ch, cw), out_hw)
        if flip[k]:
            eb = geometry.hflip(eb, out_hw[1])
        np.testing.assert_array_equal(got_boxes[k].numpy(), eb)
        np.testing.assert_array_equal(got_labels[k].numpy(), el)
        dropped += len(b) - len(eb)
    assert dropped > 20  # the crops did drop boxes, in step with their labels
    kept = q.compact()
    assert bool((kept.boxes[:, 2] >= kept.boxes[:, 0]).all())


def box_images(device="cpu"):
    """24 dark images of random sizes, each with one bright box, and the boxes."""
    rng = np.random.default_rng(1)
    imgs, boxes = [], []
    for k in range(24):
        h, w = int(rng.integers(60, 200)), int(rng.integers(60, 200))
        x0, y0 = int(rng.integers(0, w - 10)), int(rng.integers(0, h - 10))
        x1, y1 = int(rng.integers(x0 + 8, w + 1)), int(rng.integers(y0 + 8, h + 1))
        img = torch.zeros(3, h, w, dtype=torch.uint8)
        img[:, y0:y1, x0:x1] = 255
        imgs.append(img.to(device))
        boxes.append(torch.tensor([[x0, y0, x1, y1]], dtype=torch.float32))
    return imgs, boxes


def box_transform():
    return GPUTransform(size=(64, 64), train=True, mean=(0, 0, 0), std=(1, 1, 1), crop_scale=(0.1, 1.0),
                        generator=torch.Generator().manual_seed(3))


def test_transform_boxes_match_the_pixels():
    """Draw a bright box on a dark image, transform, and look where the returned box says."""
    imgs, boxes = box_images()
    out = box_transform()({"image": imgs, "boxes": boxes, "box_labels": [torch.tensor([k]) for k in range(24)]})
    x, p = out["image"], out["boxes"]
    assert x.shape == (24, 3, 64, 64) and bool(out["flip"].any()) and not bool(out["flip"].all())
    kept = 0
    for k in range(24):
        bright = x[k].mean(0)
        if not p.keep[k]:
            assert float(bright.max()) < 0.02  # the crop missed the box: nothing of it is visible
            continue
        kept += 1
        x0, y0, x1, y1 = p.boxes[k].tolist()
        assert p.labels[k] == k
        sy, sx = 64 / out["crop"][k, 2].item(), 64 / out["crop"][k, 3].item()
        m = 1 + max(sx, sy)  # a resampling filter's reach, in output pixels
        inner = bright[int(np.ceil(y0 + m)):int(np.floor(y1 - m)), int(np.ceil(x0 + m)):int(np.floor(x1 - m))]
        if inner.numel():
            assert float(inner.min()) > 0.98
        outside = torch.ones(64, 64, dtype=torch.bool)
        outside[max(0, int(y0 - m)):int(np.ceil(y1 + m)), max(0, int(x0 - m)):int(np.ceil(x1 + m))] = False
        if outside.any():
            assert float(bright[outside].max()) < 0.02
    assert 4 <= kept < 24


@cuda
def test_transform_boxes_on_cuda_equal_the_cpu():
    """The same batch through GPUTransform on the GPU and on the CPU (the same host generator, so the same
    windows and flips): pixels, boxes, labels and keep agree."""
    labels = [torch.tensor([k]) for k in range(24)]
    want = box_transform()({"image": box_images()[0], "boxes": box_images()[1], "box_labels": labels})
    got = box_transform()({"image": box_images("cuda")[0], "boxes": box_images()[1], "box_labels": labels})
    assert got["image"].is_cuda and got["boxes"].boxes.is_cuda
    assert torch.equal(got["crop"].cpu(), want["crop"]) and torch.equal(got["flip"].cpu(), want["flip"])
    torch.testing.assert_close(got["image"].cpu(), want["image"], atol=1e-3, rtol=0)
    torch.testing.assert_close(got["boxes"].boxes.cpu(), want["boxes"].boxes, atol=1e-4, rtol=1e-5)
    for name in ("labels", "image", "keep"):
        assert torch.equal(getattr(got["boxes"], name).cpu(), getattr(want["boxes"], name)), name


def test_gpu_transform_decodes_bytes_and_evaluates():
    blobs = [jpeg(40, 50, 1), jpeg(30, 36, 2)]
    tf = GPUTransform(size=(16, 16), train=False, eval_crop=0.875, device="cpu")
    out = tf({"image": blobs, "label": torch.tensor([0, 1])})
    decoded = [cpu_decode(b) for b in blobs]
    want = tf({"image": decoded, "label": torch.tensor([0, 1])})
    assert torch.equal(out["image"], want["image"]) and not bool(out["flip"].any())
    win = center_crops(image_sizes(decoded), (16, 16), 0.875)
    ref = normalize(reference(decoded, win, (16, 16), None))
    torch.testing.assert_close(out["image"], ref, atol=1e-4, rtol=0)


def test_normalize_dtype_and_layout():
    x = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    n = normalize(x, mean=(0.5, 0.4, 0.3), std=(0.25, 0.2, 0.1), dtype=torch.bfloat16, channels_last=True)
    assert n.dtype == torch.bfloat16 and n.is_contiguous(memory_format=torch.channels_last)
    ref = (x.float() / 255 - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor([0.25, 0.2, 0.1]).view(
        1, 3, 1, 1)
    torch.testing.assert_close(n.float(), ref, atol=0.05, rtol=0.01)


# Calls that make the host wait for the device (or read device memory from the host).
SYNCING = {"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
           "__bool__", "__int__", "__float__", "__index__", "__array__"}


class SyncRecorder(TorchFunctionMode):
    """Records every torch call that would sync the host with the device on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in SYNCING:
            self.found.append(name)
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool
                for a in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.found.append(name + "[bool mask]")
        elif name == "repeat_interleave" and "output_size" not in kwargs and isinstance(
                args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
            self.found.append("repeat_interleave without output_size")
        elif name in ("tensor", "as_tensor") and kwargs.get("device") not in (None, "cpu", torch.device("cpu")):
            self.found.append(name + " onto the device")
        return func(*args, **kwargs)


def test_sync_recorder_catches_syncs():
    x = torch.arange(6.0)
    for bad in (lambda: x.sum().item(), lambda: x.tolist(), lambda: x[x > 2], lambda: bool(x[0] > 1),
                lambda: x.nonzero(), lambda: x.cpu(), lambda: torch.repeat_interleave(x.long(), x.long()),
                lambda: int(x[1]), lambda: x.numpy()):
        with SyncRecorder() as r:
            bad()
        assert r.found, "the recorder must see this sync"


@pytest.mark.parametrize("train", [True, False])
def test_transform_has_no_host_sync(train):
    imgs = images([(60, 80), (80, 60), (300, 40), (64, 82)], seed=5)  # two canvas groups
    boxes = [torch.tensor([[5.0, 5, 40, 30], [70, 50, 80, 60]]), torch.zeros(0, 4), torch.tensor([[0.0, 0, 40, 300]]),
             torch.tensor([[1.0, 2, 3, 4]])]
    packed = PackedBoxes.from_lists(boxes, [torch.arange(len(b)) for b in boxes])  # as the Prefetcher hands it
    tf = GPUTransform(size=(32, 32), train=train, eval_crop=0.875, generator=torch.Generator().manual_seed(0))
    tf({"image": imgs, "boxes": packed})  # first call: per-device constants
    for batch in ({"image": imgs, "boxes": packed, "label": torch.arange(4)},
                  {"image": torch.stack(images([(48, 48)] * 4)), "boxes": packed}):
        with SyncRecorder() as r:
            out = tf(batch)
        assert r.found == [], f"host syncs in the per-batch path: {r.found}"
        assert out["image"].shape == (4, 3, 32, 32) and isinstance(out["boxes"], PackedBoxes)


@cuda
def test_transform_on_cuda_has_no_sync_and_takes_a_cuda_generator():
    dev = torch.device("cuda")
    imgs = images([(60, 80), (80, 60), (300, 40), (64, 82)], seed=5, device=dev)
    boxes = [torch.tensor([[5.0, 5, 40, 30]]), torch.zeros(0, 4), torch.tensor([[0.0, 0, 40, 300]]),
             torch.tensor([[1.0, 2, 3, 4]])]
    packed = PackedBoxes.from_lists(boxes).to(dev)
    tf = GPUTransform(size=(32, 32), generator=torch.Generator(device=dev).manual_seed(0))
    tf({"image": imgs, "boxes": packed})
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = tf({"image": imgs, "boxes": packed})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_imgs = [im.cpu() for im in imgs]
    ref = reference(cpu_imgs, out["crop"].cpu(), (32, 32), out["flip"].cpu())
    got = out["image"].float().cpu()
    want = normalize(ref)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)
