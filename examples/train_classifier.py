"""Train a classifier from a packed dataset: packio reader → DataLoader → CUDA
prefetcher → GPU transforms → AMP training step.

    python examples/train_classifier.py data.lmdb --steps 100
    python examples/train_classifier.py data.lmdb --gpu-decode   # batched GPU JPEG decode

Uses ResNet-18 when torchvision is installed (and --model resnet18), else a small CNN.
"""

from __future__ import annotations

import argparse
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

    device = resolve(a.device)  # None: LOCAL_RANK's GPU under torchrun, else the current one, else the CPU
    # CPU decode: workers decode + resize a bit larger than the crop; GPU decode: workers only read bytes.
    ds = packio.open_dataset(a.data, decode=not a.gpu_decode, resize=None if a.gpu_decode else int(a.size * 1.15))
    classes = max(len(ds.classes), 2)
    loader = packio.DataLoader(ds, batch_size=a.batch_size, shuffle=True, num_workers=a.workers, drop_last=True,
                               pin_memory=device.type == "cuda", persistent_workers=a.workers > 0)
    amp_dtype = torch.bfloat16
    # Given encoded bytes, the transform decodes them first: one batched GPU decode (CPU only for
    # the images the GPU decoder rejects), then crop/flip/resize/normalise as a few batched kernels.
    transform = GPUTransform(size=(a.size, a.size), train=True, channels_last=a.channels_last, device=device)

    def gpu_side(batch: dict) -> dict:
        return transform(batch)

    model = build_model(a.model, classes).to(device)
    if a.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    step, t0 = 0, time.perf_counter()
    while step < a.steps:
        feed = Prefetcher(loader, device=device, transform=None if a.gpu_decode else transform)
        for batch in feed:
            if a.gpu_decode:
                batch = gpu_side(batch)
            labels = batch["label"].clamp(min=0) % classes
            with torch.autocast(device_type=device.type, dtype=amp_dtype):
                loss = loss_fn(model(batch["image"]), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            print(f"step {step} loss={loss.item():.4f}", flush=True)
            if step >= a.steps:
                break
    dt = time.perf_counter() - t0
    print(f"{step} steps in {dt:.1f} s: {step * a.batch_size / dt:.0f} img/s on {device}")


if __name__ == "__main__":
    main()
