"""Resuming says what it did: one INFO line on the 'packio' logger with the epoch, the
position, and the world size before and after."""

from __future__ import annotations

import logging

import packio


def test_load_state_dict_logs_epoch_position_and_world_sizes(gen_folder, tmp_path, caplog):
    src, _ = gen_folder
    packio.convert(src, tmp_path / "d.wds", progress=False)
    two = packio.open_dataset(tmp_path / "d.wds", iterable=True, decode=False, rank=0, world_size=2)
    loader = packio.DataLoader(two, batch_size=2)
    it = iter(loader)
    next(it), next(it)  # 2 batches of 2 on rank 0 of 2: 8 samples of the epoch taken by both ranks
    state = loader.state_dict()
    one = packio.DataLoader(packio.open_dataset(tmp_path / "d.wds", iterable=True, decode=False), batch_size=2)
    with caplog.at_level(logging.INFO, logger="packio"):
        one.load_state_dict(state)
    lines = [r.getMessage() for r in caplog.records if r.name == "packio"]
    assert lines == [f"resumed epoch 0 at sample {state['consumed']} of 14 (world size 2 before, 1 now)"], lines
    assert state["consumed"] == 8
