"""Train a classifier from a packed dataset: packio reader → DataLoader → CUDA
prefetcher → GPU transforms → AMP training step.

    python examples/train_classifier.py data.lmdb --steps 100
    python examples/train_classifier.py data.lmdb --gpu-decode   # batched GPU JPEG decode

Uses ResNet-18 when torchvision is installed (and --model resnet18), else a small CNN.
Needs image labels (class sub-folders, or a CSV ``label`` column): it refuses a
dataset without any, and trains only on the labeled samples of a partly labeled one.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn

import packio
from packio.cuda import GPUTransform, Prefetcher
from packio.cuda.device import resolve


def small_cnn(classes: int) -> nn.Module:
    def block(i: int, o: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(i, o, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True))

    return nn.Sequential(block(3, 32), block(32, 64), block(64, 128), block(128, 256),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, classes))


def build_model(name: str, classes: int) -> nn.Module:
    if name == "resnet18":
        from torchvision.models import resnet18

        return resnet18(num_classes=classes)
    return small_cnn(classes)


def check_labels(ds: packio.PackedDataset, probe: int = 256) -> None:
    """Exit with a clear message when the dataset has no image labels (label -1 means none):
    a classifier trained on them would learn nothing (or, clamped to class 0, learn a lie)."""
    n = len(ds)
    idx = sorted({int(i) for i in torch.linspace(0, n - 1, min(n, probe)).round().tolist()}) if n else []
    labels = [ds.sample(i).label for i in idx]
    labeled = sum(lab >= 0 for lab in labels)
    if not ds.classes or not labeled:
        sys.exit(f"train_classifier: {ds.path}: none of the {len(idx)} samples looked at has an image label "
                 f"(classes listed: {ds.classes or 'none'}, which may name boxes only). Pack images with labels: "
                 f"class sub-folders (train/ants/x.jpg) or a CSV 'label' column.")
    bad = [lab for lab in labels if lab >= len(ds.classes)]
    if bad:
        sys.exit(f"train_classifier: {ds.path}: label {bad[0]} is outside the {len(ds.classes)} classes listed")
    if labeled < len(idx):
        print(f"note: {len(idx) - labeled} of {len(idx)} samples looked at are unlabeled; training skips them")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a packed dataset (any format)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device", default=None, help="cuda / cpu (default: this rank's GPU when present)")
    ap.add_argument("--model", default="cnn", choices=["cnn", "resnet18"])
    ap.add_argument("--gpu-decode", action="store_true",
                    help="hand JPEG bytes to the GPU decoder (nvImageCodec or torchvision) instead of decoding on CPU")
    ap.add_argument("--channels-last", action="store_true")
    a = ap.parse_args()

    # None: LOCAL_RANK's GPU under torchrun, else the current one; the CPU, said plainly, where there is none
    device = resolve(a.device or (None if torch.cuda.is_available() else "cpu"))
    # CPU decode: workers decode + resize a bit larger than the crop; GPU decode: workers only read bytes.
    ds = packio.open_dataset(a.data, decode=not a.gpu_decode, resize=None if a.gpu_decode else int(a.size * 1.15))
    check_labels(ds)
    classes = max(len(ds.classes), 2)
    loader = packio.DataLoader(ds, batch_size=a.batch_size, shuffle=True, num_workers=a.workers, drop_last=True,
                               pin_memory=device.type == "cuda", persistent_workers=a.workers > 0)
    amp_dtype = torch.bfloat16
    # Given encoded bytes (--gpu-decode), the transform decodes them first: one batched GPU decode (CPU
    # only for the images the GPU decoder rejects), then crop/flip/resize/normalise as a few batched
    # kernels; the Prefetcher runs it on its side stream, batches ahead of the training step.
    transform = GPUTransform(size=(a.size, a.size), train=True, channels_last=a.channels_last, device=device)

    model = build_model(a.model, classes).to(device)
    if a.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    step, used, unlabeled, t0 = 0, 0, 0, time.perf_counter()
    while step < a.steps:
        feed = Prefetcher(loader, device=device, transform=transform)
        steps_before = step
        for batch in feed:
            labels = batch["label"]
            keep = labels >= 0  # -1: no label; train only on the labeled samples
            unlabeled += int((~keep).sum())
            if not bool(keep.any()):
                continue
            labels, images = labels[keep], batch["image"][keep]
            used += len(labels)
            with torch.autocast(device_type=device.type, dtype=amp_dtype):
                loss = loss_fn(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            print(f"step {step} loss={loss.item():.4f}", flush=True)
            if step >= a.steps:
                break
        if step == steps_before:
            sys.exit("train_classifier: a whole epoch held no labeled sample; nothing to train on")
    dt = time.perf_counter() - t0
    print(f"{step} steps in {dt:.1f} s: {used / dt:.0f} labeled img/s on {device}; trained on {used} labeled "
          f"samples, skipped {unlabeled} unlabeled")


if __name__ == "__main__":
    main()
