"""A decoded batch made in a DataLoader worker is made in shared memory, so sending it
to the main process passes its descriptor (no copy into a new segment on the way),
and it is still a fresh buffer per batch: batches kept from earlier in the epoch equal
a fresh per-sample read after every later batch has arrived."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch

import packio
import packio.read.batch
from conftest import jpeg

N, BATCH = 12, 4


@pytest.fixture(scope="module")
def lmdb_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wshm")
    (root / "images" / "a").mkdir(parents=True)
    for k in range(N):
        (root / "images" / "a" / f"{k:02d}.jpg").write_bytes(jpeg(20 + k, 30 + 2 * k, seed=k))
    packio.convert(root / "images", root / "d.lmdb", progress=False)
    return root / "d.lmdb"


def _collate_noting_shared(batch: packio.read.batch.Batch, packed: bool) -> tuple[dict, bool]:
    """packio.collate, plus whether the batch's pixels were in shared memory where they
    were made (in a worker: before torch sends them)."""
    return packio.collate(batch, packed=packed), batch.image.is_shared()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_batch_is_made_in_shared_memory(lmdb_path, context):
    ref = packio.open_dataset(lmdb_path, resize=16)
    want = {i: ref[i]["image"].clone() for i in range(N)}
    ds = packio.open_dataset(lmdb_path, resize=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator
        loader = packio.DataLoader(ds, batch_size=BATCH, num_workers=2, multiprocessing_context=context,
                                   pin_memory=True, collate_fn=functools.partial(_collate_noting_shared, packed=True))
        kept = [(packio.read.batch.unpack(b), shared) for b, shared in loader]
    assert len(kept) == N // BATCH
    assert all(shared for _, shared in kept), "a worker made its batch in private memory: torch copies it to send"
    seen = []
    for b, _ in kept:  # every batch kept until the epoch ended: none was written after it arrived
        for j, i in enumerate(b["index"].tolist()):
            assert torch.equal(b["image"][j], want[i]), f"sample {i} changed after later batches"
            seen.append(i)
    assert sorted(seen) == list(range(N))


def test_main_process_batch_is_plain_memory(lmdb_path):
    """No worker, nothing to send: the buffer is a plain one (no shared segment per batch)."""
    ds = packio.open_dataset(lmdb_path, resize=16)
    loader = packio.DataLoader(ds, batch_size=BATCH, collate_fn=functools.partial(_collate_noting_shared,
                                                                                  packed=False))
    assert [shared for _, shared in loader] == [False] * (N // BATCH)
