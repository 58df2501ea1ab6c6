"""packio.tune measures the settings it is given and returns the fastest as DataLoader kwargs."""

from __future__ import annotations

import packio
from packio import tuning


def test_tune_returns_measured_best(gen_folder, tmp_path, monkeypatch, capsys):
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", resize=32)
    seen = []
    real = tuning._rate

    def fake_rate(dataset, batch_size, seconds, kw):
        seen.append(kw)
        real(dataset, batch_size, 0.05, kw)  # really runs the loader with these settings
        rate = {0: 10.0, 1: 30.0, 2: 20.0}[kw["num_workers"]] + kw.get("prefetch_factor", 0)
        return rate + dataset.threads / 10

    monkeypatch.setattr(tuning, "_rate", fake_rate)
    best = packio.tune(ds, batch_size=4, workers=[0, 1, 2], prefetch=(2, 4), threads=(0, 2))
    assert best == {"num_workers": 1, "prefetch_factor": 4, "persistent_workers": True, "threads": 2}
    assert ds.threads == 2
    assert {"num_workers": 0} in seen and len(seen) == 10
    assert "best:" in capsys.readouterr().out
    # and the real measurement gives a positive rate
    assert real(ds, 4, 0.1, {"num_workers": 0}) > 0


def test_default_plan_is_threads_vs_workers_vs_both(gen_folder, tmp_path, monkeypatch):
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", resize=32)
    monkeypatch.setattr(tuning.os, "cpu_count", lambda: 2)
    seen = []

    def fake_rate(dataset, batch_size, seconds, kw):
        seen.append({**kw, "threads": dataset.threads})
        return 100.0 if kw["num_workers"] == 0 and dataset.threads == 2 else 50.0

    monkeypatch.setattr(tuning, "_rate", fake_rate)
    best = packio.tune(ds, batch_size=4, verbose=False)
    assert best == {"num_workers": 0, "threads": 2} and ds.threads == 2
    pw = {"prefetch_factor": 2, "persistent_workers": True}
    assert seen == [{"num_workers": 0, "threads": 0}, {"num_workers": 0, "threads": 2},
                    {"num_workers": 2, **pw, "threads": 0}, {"num_workers": 1, **pw, "threads": 2}]
