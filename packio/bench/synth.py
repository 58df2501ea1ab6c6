"""Generate realistic photo-like JPEG folders (+ CSV boxes) for demos and benchmarks."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

__all__ = ["photo", "make_photo_folder"]


def photo(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """Smooth gradients, a few blobs, edges and sensor noise: compresses like a photo."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.empty((h, w, 3), np.float32)
    for c in range(3):
        fx, fy = rng.uniform(0.002, 0.03, 2)
        img[..., c] = 110 + 70 * np.sin(x * fx + y * fy + rng.uniform(0, 6))
    for _ in range(6):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(15, 0.4 * min(h, w))
        mask = ((y - cy) ** 2 + (x - cx) ** 2) < r * r
        img[mask] = img[mask] * 0.4 + rng.uniform(0, 255, 3) * 0.6
    img += rng.normal(0, 9, img.shape)  # texture keeps the JPEG size realistic (~100 KB at q90, 500 px)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_photo_folder(root: Path, count: int = 5000, *, classes: int = 10, size=(400, 600), quality: int = 90,
                      seed: int = 0, with_csv: bool = True, noise: float = 12.0) -> tuple[Path, Path | None]:
    """``root/class_k/img_nnnnnn.jpg`` (sizes uniformly within ``size``) and a CSV of 1-3 boxes each."""
    import simplejpeg

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    side = size[1] + 32
    # A bank of smooth backgrounds and of noise, cropped at random offsets per image:
    # photo-like content at ~3 ms an image instead of ~30 ms for a fresh one.
    bank = [photo(side, side, rng).astype(np.int16) for _ in range(16)]
    grain = rng.normal(0, noise, (side, side, 3)).astype(np.int16)
    for i in range(count):
        c = i % classes
        h, w = (int(v) for v in rng.integers(size[0], size[1] + 1, 2))
        y0, x0 = (int(v) for v in rng.integers(0, 32, 2))
        img = bank[int(rng.integers(len(bank)))][y0:y0 + h, x0:x0 + w]
        ny, nx = (int(v) for v in rng.integers(0, side - max(h, w) + 1, 2))
        gain = rng.uniform(0.7, 1.3, 3).astype(np.float32)
        img = np.clip(img * gain + grain[ny:ny + h, nx:nx + w], 0, 255).astype(np.uint8)
        if rng.random() < 0.5:
            img = img[:, ::-1]
        img = np.ascontiguousarray(img)
        d = root / f"class_{c:02d}"
        d.mkdir(exist_ok=True)
        name = f"img_{i:06d}.jpg"
        (d / name).write_bytes(simplejpeg.encode_jpeg(img, quality=quality, colorsubsampling="420"))
        for _ in range(int(rng.integers(1, 4))):
            x0, y0 = rng.uniform(0, w * 0.6), rng.uniform(0, h * 0.6)
            rows.append([f"class_{c:02d}/{name}", w, h, f"obj{int(rng.integers(0, 3))}", round(x0, 1), round(y0, 1),
                         round(x0 + rng.uniform(10, w * 0.4), 1), round(y0 + rng.uniform(10, h * 0.4), 1)])
    csv_path = None
    if with_csv:
        csv_path = root.parent / f"{root.name}_boxes.csv"
        with open(csv_path, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["filename", "width", "height", "class", "xmin", "ymin", "xmax", "ymax"])
            wr.writerows(rows)
    return root, csv_path
