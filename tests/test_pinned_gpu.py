"""Pinned batches on a GPU: packio pins nothing itself (torch's pin-memory path and its
caching host allocator, which reuses a pinned block only after the copies recorded on it
have completed), so a batch copied with ``non_blocking=True`` while the GPU is still busy,
or through the Prefetcher's side stream to a slow consumer, arrives intact. Needs CUDA."""

from __future__ import annotations

import pytest
import torch

import packio

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STEPS = 200
SPIN = 2_000_000  # GPU cycles of busy work before each copy: the copy queues behind it


@pytest.fixture(params=["arrays", "lmdb"])
def dataset(request, gen_folder, tmp_path):
    src, csv = gen_folder
    if request.param == "arrays":
        path = tmp_path / "d.arrays"
        packio.convert(src, path, csv=csv, resize=packio.ResizeSpec(size=(24, 32)), progress=False)
        return path, {}
    path = tmp_path / "d.lmdb"
    packio.convert(src, path, csv=csv, progress=False)
    return path, {"resize": (24, 32)}


def _batches(path, kw, workers):
    ds = packio.open_dataset(path, **kw)
    extra = {"multiprocessing_context": "fork"} if workers else {}
    loader = packio.DataLoader(ds, batch_size=3, shuffle=True, pin_memory=True, num_workers=workers, **extra)
    n = 0
    while True:
        for b in loader:
            assert b["image"].is_pinned() and all(x.is_pinned() for x in b["boxes"])
            yield b
            n += 1
            if n == STEPS:
                return


def _check(path, kw, got):
    ref_ds = packio.open_dataset(path, **kw)
    ref = {i: ref_ds[i]["image"] for i in range(len(ref_ds))}
    for idx, images in got:
        host = images.cpu()
        for j, i in enumerate(idx):
            assert torch.equal(host[j], ref[i]), f"sample {i} changed on its way to the GPU"


@pytest.mark.parametrize("workers", [0, 2])
def test_non_blocking_copies_of_pinned_batches_arrive_intact(dataset, workers):
    path, kw = dataset
    got = []
    for b in _batches(path, kw, workers):
        torch.cuda._sleep(SPIN)  # the GPU is busy: the copy below is still pending when the loop goes on
        got.append((b["index"].tolist(), b["image"].cuda(non_blocking=True)))
    torch.cuda.synchronize()
    _check(path, kw, got)


def test_prefetcher_with_a_slow_consumer_hands_out_intact_batches(dataset):
    from packio.cuda import Prefetcher

    path, kw = dataset
    got = []
    for b in Prefetcher(_batches(path, kw, 2), device="cuda", pack_boxes=False):
        torch.cuda._sleep(SPIN)  # a slow step on the consumer's stream
        got.append((b["index"].tolist(), b["image"]))
    torch.cuda.synchronize()
    _check(path, kw, got)
