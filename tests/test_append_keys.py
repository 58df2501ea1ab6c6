"""What ``convert --append`` leaves for other tools and readers: keys checked from records
alone, member keys unique across parts (webdataset's ``__key__``), class names merged by
their text, ``info`` describing every part."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import packio
from packio.errors import PackioError
from packio.formats import get_format

from test_append import make


@pytest.mark.parametrize("fmt, opts", [("lmdb", {}), ("arrays", {"resize": packio.ResizeSpec(size=(8, 8))})])
def test_append_key_check_reads_no_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str,
                                          opts: dict[str, Any]) -> None:
    """The check that no new key is stored already reads keys only: with every way to a
    stored sample (its payload) refusing, appends still run and still catch a repeated key."""
    a, b, c = (make(tmp_path / t, ["x", "y"], 3, t) for t in "abc")
    ds = tmp_path / f"ds.{fmt}"
    packio.convert(a, ds, progress=False, workers=0, **opts)
    calls: Counter[str] = Counter()

    def refusing(name: str) -> Any:
        def read(self: Any, *args: Any, **kw: Any) -> Any:
            calls[name] += 1
            raise AssertionError(f"{name} read a stored sample")
        return read

    reader = get_format(fmt).reader
    for name in ("read", "read_many", "read_batch"):
        monkeypatch.setattr(reader, name, refusing(name))
    packio.convert(b, ds, append=True, progress=False, workers=0)  # a single-part dataset grown
    packio.convert(c, ds, append=True, progress=False, workers=0)  # a multi-part one
    with pytest.raises(PackioError, match=r"already holds a sample with key 'x/b0.png' \(#6\)"):
        packio.convert(b, ds, append=True, progress=False, workers=0)
    assert calls == Counter()
    monkeypatch.undo()
    r = packio.open_reader(ds)
    assert sorted(r.read(i).key for i in range(len(r))) == sorted(f"{c}/{t}{i}.png" for t in "abc" for c in "xy"
                                                                  for i in range(3))
