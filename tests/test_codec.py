"""One record codec: msgpack everywhere, the same record as JSON in tar's .json member,
both bounded when read from a stranger's file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packio.errors import CorruptSampleError
from packio.formats.base import MAX_RECORD_BYTES, pack_record, unpack_record
from packio.sample import Sample, sample_from_record


def test_same_record_both_encodings():
    s = Sample(key="a/b c.jpg", payload=b"xyz", encoding="jpeg", label=3,
               boxes=np.array([[1.5, 2, 30, 40.25]], np.float32), box_labels=np.array([2]), width=50, height=60,
               meta={"exif_orientation": 6})
    rec = s.record()
    for text in (False, True):
        back = unpack_record(pack_record(rec, text=text), "#0", text=text)
        assert back == rec
        got = sample_from_record(back, b"xyz")
        assert (got.key, got.label, got.width, got.height, got.meta) == ("a/b c.jpg", 3, 50, 60, s.meta)
        np.testing.assert_array_equal(got.boxes, s.boxes)
    assert json.loads(pack_record(rec, text=True)) == rec  # plain JSON for WebDataset's decoders


@pytest.mark.parametrize("text", [False, True])
def test_hostile_records_are_corrupt_samples(text):
    bad = [b"\xc1" if not text else b"{not json", b"[" * 200_000 + b"]" * 200_000,
           b" " * (MAX_RECORD_BYTES + 1)]
    if not text:
        bad[1] = b"\xdd\xff\xff\xff\xff"  # an array claiming 4 billion elements
    for data in bad:
        with pytest.raises(CorruptSampleError, match="#7"):
            unpack_record(data, "#7", text=text)


def test_columns_round_trip_across_drains_and_refuse_damage():
    from packio.errors import FormatError
    from packio.formats.columns import ColumnBuffer, Columns

    buf = ColumnBuffer()
    boxes = [np.zeros((0, 4), np.float32), np.arange(8, dtype=np.float32).reshape(2, 4),
             np.full((1, 4), 7, np.float32)]
    parts = []
    for k, b in enumerate(boxes):
        buf.add(Sample(key=str(k), payload=b"", encoding="jpeg", label=k - 1, boxes=b,
                       box_labels=np.arange(len(b)) + 10 * k))
        if k != 1:  # drain after samples 0 and 2: offsets must continue across drains (HDF5 flushes)
            parts.append(buf.drain())
    cols = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    cols["box_offsets"] = np.concatenate([[0], cols["box_offsets"]])
    c = Columns.checked(cols, 3, "x")
    labels, flat, flat_labels, counts = c.take(np.array([2, 0, 1]))
    assert labels.tolist() == [1, -1, 0]
    cuts = np.cumsum(counts)[:-1]
    for g, want in zip(np.split(flat, cuts), [boxes[2], boxes[0], boxes[1]]):
        np.testing.assert_array_equal(g.reshape(-1, 4), np.asarray(want, np.float32).reshape(-1, 4))
    assert [b.tolist() for b in np.split(flat_labels, cuts)] == [[20], [], [10, 11]]
    for name, bad in (("box_offsets", np.array([0, 2, 1, 3])), ("box_offsets", np.array([0, 0, 2, 4])),
                      ("labels", np.zeros(3, np.int32)), ("boxes", np.zeros((3, 3), np.float32))):
        with pytest.raises(FormatError, match="x: label/box columns"):
            Columns.checked({**cols, name: bad}, 3, "x")
