"""``convert(src, "s3://bucket/ds.tar")``: pack into a local temporary folder and
upload. Tar shards go up while the conversion runs (a shard is complete once the
writer has started the next one); everything else after it; the manifest last,
so a killed conversion leaves nothing that opens as a dataset.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from packio.errors import OutputExistsError, PackioError, RemoteError
from packio.manifest import DIGEST, MANIFEST_NAME, file_digest
from packio.remote.reader import SINGLE_FILE
from packio.remote.store import Store

__all__ = ["convert_to_url"]

log = logging.getLogger("packio")


class _ShardUploader(threading.Thread):
    """Watches the converter's temporary output and uploads each finished shard."""

    def __init__(self, store: Store, local: Path, poll: float = 0.2) -> None:
        super().__init__(name="packio-upload", daemon=True)
        self.store, self.local, self.poll = store, local, poll
        self.done: dict[str, str] = {}  # relpath -> xxh3_128 of what was uploaded
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def _finished(self) -> list[Path]:
        from packio.converter import TMP_MARK

        for tmp in self.local.parent.glob(f".{self.local.name}{TMP_MARK}*"):
            try:
                shards = sorted((p for p in tmp.glob("*.tar") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
            except OSError:  # renamed into place meanwhile
                return []
            return [s for s in shards[:-1] if s.name not in self.done]  # the newest one may still grow
        return []

    def run(self) -> None:
        try:
            while not self._halt.wait(self.poll):
                for shard in self._finished():
                    try:
                        digest = file_digest(shard)
                        self.store.put(shard, shard.name)
                    except (OSError, RemoteError):
                        if shard.exists():
                            raise
                        break  # the finished output was renamed into place: the final pass takes over
                    self.done[shard.name] = digest
        except BaseException as exc:  # reported by finish(); the final pass uploads what is left
            self.error = exc

    def finish(self) -> dict[str, str]:
        self._halt.set()
        self.join()
        if self.error is not None:
            log.warning("packio: uploading shards during the conversion failed (%s); uploading them now",
                        self.error)
        return self.done


def convert_to_url(convert: Callable[..., Any], src: str | Path, dst: str, *, overwrite: bool = False,
                   storage_options: dict[str, Any] | None = None, tmp_dir: str | Path | None = None,
                   **kwargs: Any) -> Any:
    """Run ``convert(src, LOCAL, **kwargs)`` into a temporary folder (under ``tmp_dir``,
    default the system's) and upload the result to ``dst``; returns its Summary.

    With ``overwrite`` the old dataset's manifest is deleted first: it stops opening
    before any of its objects is replaced, and its files that the new dataset lacks
    are deleted at the end."""
    t0 = time.perf_counter()
    dst = dst.rstrip("/")
    parent, _, name = dst.rpartition("/")
    single = Path(name).suffix.lower() in SINGLE_FILE
    store = Store(parent if single else dst, storage_options)
    marker = name if single else MANIFEST_NAME
    old: set[str] = set()
    if store.exists(marker):
        if not overwrite:
            raise OutputExistsError(f"{dst} exists; pass --overwrite to replace it, or choose another name")
        if not single:
            old = _old_files(store)
            store.delete(MANIFEST_NAME)
    with tempfile.TemporaryDirectory(prefix="packio-upload-", dir=tmp_dir) as tmp:
        local = Path(tmp) / name
        uploader = None if single else _ShardUploader(store, local)
        if uploader is not None:
            uploader.start()
        try:
            summary = convert(src, local, **kwargs)
        except BaseException:
            for rel in uploader.finish() if uploader is not None else {}:
                _try_delete(store, rel)  # nothing of a failed conversion stays behind
            raise
        if single:
            store.put(local, name)  # one object: it appears whole or not at all
        else:
            files = _manifest_files(local)
            done = uploader.finish() if uploader is not None else {}
            for rel, meta in files.items():
                if done.get(rel) != meta.get(DIGEST):
                    store.put(local / rel, rel)
            store.put(local / MANIFEST_NAME, MANIFEST_NAME)  # last: now it opens
            for rel in sorted(old - set(files)):
                _try_delete(store, rel)
    summary.output = dst
    summary.seconds = time.perf_counter() - t0  # packing and uploading
    return summary


def _try_delete(store: Store, rel: str) -> None:
    try:
        store.delete(rel)
    except RemoteError as exc:
        log.warning("packio: could not delete %s (%s)", store.url_of(rel), exc)


def _manifest_files(local: Path) -> dict[str, dict[str, Any]]:
    from packio.manifest import Manifest

    return Manifest.from_json((local / MANIFEST_NAME).read_bytes(), str(local / MANIFEST_NAME)).files


def _old_files(store: Store) -> set[str]:
    """Files of the dataset being replaced (from its manifest)."""
    from packio.manifest import Manifest

    try:
        m = Manifest.from_json(store.cat(MANIFEST_NAME), store.url_of(MANIFEST_NAME))
    except PackioError:
        return set()
    return {rel for rel in m.files if isinstance(rel, str)}
