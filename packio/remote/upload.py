"""``convert(src, "s3://bucket/ds.tar")``: pack into a local staging folder, then upload.

An upload never overwrites an object a reader may be reading: the files go under
``URL/v-VERSION/`` (``VERSION``: a digest of the new manifest), then the manifest at
``URL/packio.json`` is replaced (one object: atomic), and only then are the old
upload's objects deleted. A failed conversion leaves the old dataset as it was. A
lock object ``URL/.packio-lock`` (created only if absent, else a lease with an owner
and an expiry) makes a second conversion to the same URL fail at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from packio.errors import OutputBusyError, OutputExistsError, RemoteError, RemoteNotFoundError
from packio.manifest import MANIFEST_NAME
from packio.remote.reader import SINGLE_FILE, version
from packio.remote.store import Store

__all__ = ["convert_to_url", "clean_staging"]

log = logging.getLogger("packio")
LOCK, STAGING = ".packio-lock", "packio-upload-"
LEASE = 300.0  # seconds a lock lasts unless its owner renews it (a killed conversion's lock expires)


def clean_staging(root: str | Path | None = None) -> int:
    """Remove staging folders of conversions whose process is gone; how many."""
    n = 0
    for d in Path(root or tempfile.gettempdir()).glob(f"{STAGING}*-*"):
        pid = d.name[len(STAGING):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)) and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Lock:
    """The lock object of one output URL, renewed by a thread while held."""

    def __init__(self, store: Store, rel: str) -> None:
        self.store, self.rel, self.owner = store, rel, f"{os.getpid()}-{uuid.uuid4().hex}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="packio-lease", daemon=True)

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "expires": time.time() + LEASE}).encode()

    def acquire(self) -> None:
        for _ in range(2):
            if self.store.exists(self.rel) and not self._expired():  # for stores without If-None-Match
                raise self._busy()
            try:
                self.store.put_bytes(self._body(), self.rel, create=True)
            except RemoteNotFoundError:
                raise  # no bucket: nothing to be busy about
            except RemoteError:  # 412: there is one; take it over only once it has expired
                if not self._expired():
                    raise self._busy() from None
                self.store.delete(self.rel)
                continue
            held = json.loads(self.store.read(self.rel, 1 << 16))  # a store without If-None-Match: last writer
            if held.get("owner") != self.owner:
                raise self._busy()
            self._thread.start()
            return
        raise self._busy()

    def _expired(self) -> bool:
        try:
            held = json.loads(self.store.read(self.rel, 1 << 16))
            return float(held.get("expires", 0)) < time.time()
        except (RemoteError, ValueError, AttributeError):
            return False

    def _busy(self) -> OutputBusyError:
        return OutputBusyError(f"{self.store.url_of(self.rel)}: another conversion is writing to this URL; wait "
                               f"for it, or if none runs (one was killed), delete this object or wait "
                               f"{LEASE:.0f} s for its lease to expire")

    def _renew(self) -> None:
        while not self._stop.wait(LEASE / 3):
            try:
                self.store.put_bytes(self._body(), self.rel)
            except RemoteError as exc:
                log.warning("packio: could not renew the lock %s (%s)", self.store.url_of(self.rel), exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        _try_delete(self.store, self.rel)


def convert_to_url(convert: Callable[..., Any], src: str | Path, dst: str, *args: Any, overwrite: bool = False,
                   storage_options: dict[str, Any] | None = None, tmp_dir: str | Path | None = None,
                   **kwargs: Any) -> Any:
    """Run ``convert(src, LOCAL, **kwargs)`` into a staging folder (under ``tmp_dir``,
    default the system's) and upload the result to ``dst``; returns its Summary."""
    t0 = time.perf_counter()
    dst = dst.rstrip("/")
    parent, _, name = dst.rpartition("/")
    single = Path(name).suffix.lower() in SINGLE_FILE
    store = Store(parent if single else dst, storage_options)
    store.check_bucket()
    if tmp_dir is not None:
        Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    clean_staging(tmp_dir)
    lock = _Lock(store, f"{name}{LOCK}" if single else LOCK)
    lock.acquire()
    try:
        if store.exists(name if single else MANIFEST_NAME) and not overwrite:
            raise OutputExistsError(f"{store.url_of(name if single else '')} exists; pass --overwrite to replace "
                                    f"it, or choose another name")
        with tempfile.TemporaryDirectory(prefix=f"{STAGING}{os.getpid()}-", dir=tmp_dir) as tmp:
            local = Path(tmp) / name
            summary = convert(src, local, *args, **kwargs)
            if single:
                store.put(local, name)  # one object: it appears whole or not at all
            else:
                _upload(store, local)
    finally:
        lock.release()
    summary.output = store.url_of(name) if single else str(store)
    summary.seconds = time.perf_counter() - t0  # packing and uploading
    return summary


def _upload(store: Store, local: Path) -> None:
    """Files under ``v-VERSION/``, then the manifest (the switch), then the old objects go."""
    text = (local / MANIFEST_NAME).read_bytes()
    sub = f"v-{version(text)}"
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    rels = [r for r in files if r != MANIFEST_NAME] + [MANIFEST_NAME]
    try:
        with ThreadPoolExecutor(8, thread_name_prefix="packio-upload") as pool:
            list(pool.map(lambda r: store.put(local / r, f"{sub}/{r}"), rels[:-1]))
        store.put(local / MANIFEST_NAME, f"{sub}/{MANIFEST_NAME}")  # marks the upload complete
        old = set(store.listing(""))
        store.put_bytes(text, MANIFEST_NAME)  # the switch: now the new dataset opens
    except BaseException:
        for rel in _quiet_listing(store, sub):
            _try_delete(store, rel)  # nothing of a failed upload stays; the old dataset is untouched
        raise
    for rel in sorted(old):
        if not rel.startswith(f"{sub}/") and rel not in (MANIFEST_NAME, LOCK):
            _try_delete(store, rel)


def _quiet_listing(store: Store, rel: str) -> list[str]:
    try:
        return store.listing(rel)
    except RemoteError:
        return []


def _try_delete(store: Store, rel: str) -> None:
    try:
        store.delete(rel)
    except RemoteError as exc:
        log.warning("packio: could not delete %s (%s)", store.url_of(rel), exc)
