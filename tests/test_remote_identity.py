"""Objects served without ETag / Last-Modified: their content names their cache version,
and the cached copy must be that content (a server flipping between uploads never
leaves one upload's bytes cached under another's identity)."""

from __future__ import annotations

import http.server
import os
import io
import tarfile
import threading
from pathlib import Path
from typing import Iterator

import cv2
import numpy as np
import pytest
from servers import Quiet

import packio

FAST = dict(retries=2, timeout=2.0, retry_seconds=4.0)


class _Flipping(Quiet, http.server.BaseHTTPRequestHandler):
    """Serves ``server.files`` with a Content-Length and no validators; the ``server.flip_at``-th
    GET of an object gets ``server.other``'s bytes instead (an upload racing the open)."""

    def _serve(self, body: bool) -> None:
        s, name = self.server, self.path.lstrip("/")
        if name not in s.files:  # type: ignore[attr-defined]
            self.send_error(404)
            return
        if s.endless:  # type: ignore[attr-defined]
            self._endless(body)
            return
        data = s.files[name]  # type: ignore[attr-defined]
        if body:
            s.gets[name] = s.gets.get(name, 0) + 1  # type: ignore[attr-defined]
            if s.gets[name] == s.flip_at:  # type: ignore[attr-defined]
                data = s.other[name]  # type: ignore[attr-defined]
        part = self._head_of(data)
        if body:
            self.wfile.write(data[part])

    def _endless(self, body: bool) -> None:
        """No Content-Length, and a body without end (32 MiB, then the server gives up)."""
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            while body and self.server.sent < (32 << 20):  # type: ignore[attr-defined]
                self.wfile.write(b"\0" * (1 << 20))
                self.server.sent += 1 << 20  # type: ignore[attr-defined]
        except OSError:
            pass


@pytest.fixture
def flipping() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flipping)
    httpd.daemon_threads = True
    httpd.files, httpd.other, httpd.gets, httpd.flip_at = {}, {}, {}, 2  # type: ignore[attr-defined]
    httpd.endless, httpd.sent = False, 0  # type: ignore[attr-defined]
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"  # type: ignore[attr-defined]
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(10)


def _h5(tmp_path: Path, labels: str) -> bytes:
    (tmp_path / "img").mkdir(exist_ok=True)
    for i in range(4):
        cv2.imwrite(str(tmp_path / "img" / f"{i}.jpg"), np.full((16, 16, 3), i * 40, np.uint8))
    (tmp_path / "l.csv").write_text("filename,label\n" + "".join(
        f"{i}.jpg,{lab}\n" for i, lab in enumerate(labels.split())))
    packio.convert(tmp_path / "img", tmp_path / "x.h5", csv=tmp_path / "l.csv", progress=False, overwrite=True)
    return (tmp_path / "x.h5").read_bytes()


def _tar(labels: list[int]) -> bytes:
    ok, jpg = cv2.imencode(".jpg", np.full((8, 8, 3), 90, np.uint8))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, lab in enumerate(labels):
            for ext, data in (("jpg", jpg.tobytes()), ("cls", str(lab).encode())):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_whole_file_object_changing_during_the_fill_is_never_cached_as_the_other(flipping, tmp_path: Path) -> None:
    a, b = _h5(tmp_path, "cat dog cat dog"), _h5(tmp_path, "dog cat dog cat")
    assert len(a) == len(b)
    flipping.files["d.h5"], flipping.other["d.h5"] = a, b  # the open's second GET (the cache fill) gets b

    def names() -> str:
        ds = packio.open_dataset(f"{flipping.url}/d.h5", cache_dir=tmp_path / "c", **FAST)
        return " ".join(ds.classes[ds[i]["label"]] for i in range(len(ds)))

    assert names() == "cat dog cat dog"
    assert names() == "cat dog cat dog"  # the server serves a: so does the cache, later too


def test_foreign_shard_changing_during_the_fill_is_never_cached_as_the_other(flipping, tmp_path: Path) -> None:
    a, b = _tar([0, 1, 0, 1]), _tar([1, 0, 1, 0])
    assert len(a) == len(b)
    flipping.files["s-0.tar"], flipping.other["s-0.tar"] = a, b

    def labels() -> list[int]:
        ds = packio.open_dataset(f"{flipping.url}/s-{{0..0}}.tar", cache_dir=tmp_path / "c", **FAST)
        return [int(ds[i]["label"]) for i in range(len(ds))]

    assert labels() == [0, 1, 0, 1]
    assert labels() == [0, 1, 0, 1]


def test_whole_file_object_without_a_size_is_refused_undownloaded(flipping, tmp_path: Path) -> None:
    flipping.files["d.h5"], flipping.endless = b"", True
    with pytest.raises(packio.RemoteError, match="gives no size"):
        packio.open_dataset(f"{flipping.url}/d.h5", cache_dir=tmp_path / "c", **FAST)
    assert flipping.sent <= 4 << 20  # what the size probe read, not the endless body
    assert sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file()) < 1 << 20


def test_identity_downloads_of_killed_opens_are_removed(flipping, tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    cache = tmp_path / "c"
    cache.mkdir()
    left, live = cache / f".identity-{dead}-0123abcd", cache / f".identity-{os.getpid()}-4567cdef"
    left.write_bytes(b"\0" * 4096)  # what a kill -9 during the identity download leaves
    live.write_bytes(b"\0" * 16)  # another open, still running
    flipping.files["d.h5"] = _h5(tmp_path, "cat dog cat dog")
    packio.open_dataset(f"{flipping.url}/d.h5", cache_dir=cache, **FAST)
    assert not left.exists() and live.exists()
