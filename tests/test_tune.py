"""packio.tune measures the settings it is given and returns the fastest as DataLoader kwargs."""

from __future__ import annotations

import packio
from packio import tuning
from packio.measure import Rate


def test_tune_returns_measured_best(gen_folder, tmp_path, monkeypatch, capsys):
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", resize=32)
    seen = []
    real = tuning.measure

    def fake_measure(dataset, batch_size, seconds, settings):
        kw = {k: v for k, v in settings.items() if k != "threads"}
        seen.append(kw)
        real(dataset, batch_size, 0.05, settings)  # really runs the loader with these settings
        rate = {0: 10.0, 1: 30.0, 2: 20.0}[kw["num_workers"]] + kw.get("prefetch_factor", 0)
        return Rate(samples_per_s=rate + dataset.threads / 10)

    monkeypatch.setattr(tuning, "measure", fake_measure)
    best = packio.tune(ds, batch_size=4, workers=[0, 1, 2], prefetch=(2, 4), threads=(0, 2))
    assert best == {"num_workers": 1, "prefetch_factor": 4, "persistent_workers": True, "threads": 2}
    assert ds.threads == 2
    assert {"num_workers": 0} in seen and len(seen) == 10
    assert "best:" in capsys.readouterr().out
    # and the real measurement gives a positive rate
    assert real(ds, 4, 0.1, {"num_workers": 0}).samples_per_s > 0


def test_default_plan_is_threads_vs_workers_vs_both(gen_folder, tmp_path, monkeypatch):
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", resize=32)
    monkeypatch.setattr(tuning.os, "cpu_count", lambda: 2)
    seen = []

    def fake_measure(dataset, batch_size, seconds, settings):
        seen.append(dict(settings))
        return Rate(samples_per_s=100.0 if settings["num_workers"] == 0 and settings["threads"] == 2 else 50.0)

    monkeypatch.setattr(tuning, "measure", fake_measure)
    best = packio.tune(ds, batch_size=4, verbose=False)
    assert best == {"num_workers": 0, "threads": 2} and ds.threads == 2
    pw = {"prefetch_factor": 2, "persistent_workers": True}
    assert seen == [{"num_workers": 0, "threads": 0}, {"num_workers": 0, "threads": 2},
                    {"num_workers": 2, **pw, "threads": 0}, {"num_workers": 1, **pw, "threads": 2}]


def test_tune_of_an_empty_dataset_is_a_clean_error(tmp_path, capsys):
    """``packio bench --tune`` on a dataset of 0 samples: one ``packio: error:`` line naming
    it, exit status 2 (it was torch's raw ``ValueError: num_samples=0``), as doctor, show and
    convert answer."""
    import pytest

    from packio.cli import main
    from packio.formats.base import WriteOptions
    from packio.formats.lmdb import LMDBWriter
    from packio.manifest import Manifest

    path = tmp_path / "empty.lmdb"
    writer = LMDBWriter(path, WriteOptions())
    writer.write_manifest(Manifest(format="lmdb", count=0, extra=writer.close()))
    for args in (["bench", "--tune", str(path)], ["doctor", str(path), "--seconds", "5"], ["show", str(path)]):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"packio: error: {path}") and "no samples" in err[0], err
    with pytest.raises(packio.PackioError, match="holds no samples; nothing to tune"):
        packio.tune(packio.open_dataset(path))


def test_tune_stays_in_its_budget_when_one_sample_takes_long(gen_folder, tmp_path, monkeypatch, capsys):
    """Issue 38: a sample that takes longer than half a trial (a huge image) cannot be timed
    in ``seconds``: tune reads it once and says so, where every trial waited for a whole
    first batch of such samples (``packio bench --tune`` ran far past trials × seconds)."""
    from packio import decode as dec

    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", resize=32)
    calls, real = [], dec.resize

    def slow(*a, **kw):  # each sample's resize stands for a huge image's decode
        calls.append(1)
        import time

        time.sleep(0.3)
        return real(*a, **kw)

    monkeypatch.setattr(dec, "resize", slow)
    best = packio.tune(ds, batch_size=64, seconds=0.2)
    assert len(calls) == 1 and best["num_workers"] == 0 and best["threads"] >= 1  # before: 4 trials x 14 samples
    assert "no setting can be timed" in capsys.readouterr().out
