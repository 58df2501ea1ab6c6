"""The local cache of remote files, shared by every worker and rank on a node.

Layout: ``ROOT/<scheme>/<host>/<path>/<version>/<file>``; ``version`` is a digest
of the dataset's manifest, so a re-uploaded dataset never mixes with an old one.
Each cache entry (one file, or a whole dataset for the formats cached whole) has
two lock files in ``<version>/.locks/``:

- ``*.pin``: held shared while a process uses the entry; eviction takes it
  exclusive without waiting, so it skips anything in use by any process.
- ``*.dl``: held exclusive while one process downloads the entry; the others wait
  for it and then find the file there: one download per entry per node.

Downloads go to a temporary name, are checked against the manifest's size and
xxh3-128, then renamed into place (atomic). ``limit`` evicts least recently used
entries (a use touches the file's mtime) before each download.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from packio.errors import RemoteError
from packio.manifest import file_digest
from packio.remote.store import Store

__all__ = ["Cache", "Pin", "default_cache_dir", "open_cached", "parse_size", "valid"]

log = logging.getLogger("packio")
MARK, WHOLE, COMPLETE, LOCKS = ".packio-cache", ".whole", ".complete", ".locks"
DATASET = ".dataset"  # lock name of a dataset cached whole
FileInfo = tuple[int | None, str | None]  # size, xxh3_128


def default_cache_dir() -> Path:
    """``$PACKIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/packio``, else ``~/.cache/packio``."""
    env = os.environ.get("PACKIO_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packio"


_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str | None) -> int | None:
    """Bytes from ``10_000_000``, ``"500MB"``, ``"10GiB"``...; ``None`` = no limit."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"cache limit must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read the size {value!r}; write e.g. 500MB, 20GB or 10GiB")
    return parse_size(int(float(m.group(1)) * _UNITS[m.group(2).upper()]))


def _safe(part: str) -> str:
    part = re.sub(r"[^A-Za-z0-9._-]", "_", part)
    return "_" if part in ("", ".", "..") else part


def _lock(path: Path, mode: int, timeout: float) -> int:
    """An fd holding ``flock(mode)`` on ``path`` (polled, so the wait is bounded)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline, pause = time.monotonic() + timeout, 0.002
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise RemoteError(f"{path}: waited {timeout:.0f} s for another process to release this cache "
                                  f"entry; is a download stuck? (remove the lock file if its process is gone)"
                                  ) from None
            time.sleep(pause)
            pause = min(0.05, pause * 2)


def _unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class Pin:
    """Keeps one cache entry from eviction (a shared lock) until released."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd, self.pid = path, fd, os.getpid()

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _unlock(fd)

    def forget(self) -> None:
        """After fork: drop the inherited descriptor (the parent's lock stays the parent's)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class Cache:
    def __init__(self, root: str | Path | None = None, limit: int | str | None = None,
                 lock_timeout: float = 900.0) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.limit = parse_size(limit)
        self.lock_timeout = lock_timeout
        self.downloads = 0  # files this process downloaded (statistics)
        self._warned = False

    def version_dir(self, url: str, version: str) -> Path:
        """``ROOT/scheme/host/path/version``: no user name, password or query string
        (signed URLs carry tokens there) ends up in a folder name."""
        from urllib.parse import urlsplit

        u = urlsplit(url)
        host = (u.hostname or "") + (f"_{u.port}" if u.port is not None else "")
        parts = [_safe(u.scheme), _safe(host)] + [_safe(p) for p in u.path.split("/") if p] + [_safe(version)]
        vdir = self.root.joinpath(*parts)
        try:
            vdir.mkdir(parents=True, exist_ok=True)
            (vdir / MARK).touch()
        except OSError as exc:
            raise RemoteError(f"{self.root}: cannot write the download cache there ({exc.strerror}); pass "
                              f"cache_dir= or set PACKIO_CACHE_DIR to a writable folder") from None
        return vdir

    def _lockfile(self, vdir: Path, rel: str, kind: str) -> Path:
        return vdir / LOCKS / f"{rel}.{kind}"

    def fetch(self, store: Store, rel: str, vdir: Path, info: FileInfo) -> Pin:
        """Pin ``vdir/rel``, downloading it first unless some process already did."""
        dest = vdir / rel
        pin = Pin(dest, _lock(self._lockfile(vdir, rel, "pin"), fcntl.LOCK_SH, self.lock_timeout))
        try:
            if not valid(dest, info[0]):
                dl = _lock(self._lockfile(vdir, rel, "dl"), fcntl.LOCK_EX, self.lock_timeout)
                try:
                    if not valid(dest, info[0]):  # nobody fetched it while we waited
                        _remove(dest)  # a planted link, a truncated or grown file: fetched again
                        self.evict(reserve=info[0] or 0)
                        self._download(store, rel, dest, info)
                finally:
                    _unlock(dl)
            os.utime(dest)  # LRU: last use
            return pin
        except BaseException:
            pin.release()
            raise

    def fetch_all(self, store: Store, files: dict[str, FileInfo], vdir: Path, manifest: bytes | None,
                  threads: int = 8) -> Pin:
        """Pin a whole dataset (one eviction unit), downloading what is missing; the
        local ``packio.json`` is written last, and ``.complete`` after it."""
        (vdir / WHOLE).touch()
        pin = Pin(vdir, _lock(self._lockfile(vdir, DATASET, "pin"), fcntl.LOCK_SH, self.lock_timeout))
        try:
            if not self._complete(vdir, files):
                dl = _lock(self._lockfile(vdir, DATASET, "dl"), fcntl.LOCK_EX, self.lock_timeout)
                try:
                    if not self._complete(vdir, files):
                        self._fill(store, files, vdir, manifest, threads)
                finally:
                    _unlock(dl)
            os.utime(vdir / COMPLETE)
            return pin
        except BaseException:
            pin.release()
            raise

    @staticmethod
    def _complete(vdir: Path, files: dict[str, FileInfo]) -> bool:
        """Filled, and every file still a regular file of its listed size (no links)."""
        return valid(vdir / COMPLETE, None) and all(valid(vdir / rel, info[0]) for rel, info in files.items())

    def _fill(self, store: Store, files: dict[str, FileInfo], vdir: Path, manifest: bytes | None,
              threads: int) -> None:
        total = sum(size or 0 for size, _ in files.values())
        if self.limit is not None and total > self.limit:
            raise RemoteError(f"{store}: this dataset is {total / 1e6:.1f} MB and is cached whole, more than "
                              f"the cache limit of {self.limit / 1e6:.1f} MB; raise cache_limit")
        self.evict(reserve=total)

        def one(item: tuple[str, FileInfo]) -> str:
            rel, info = item
            dest = vdir / rel
            if valid(dest, info[0]) and info[1] is not None and file_digest(dest) == info[1]:
                return ""  # left by an earlier, interrupted fill
            _remove(dest)
            try:
                self._download(store, rel, dest, info)
            except RemoteError as exc:  # every damaged object is named, not just the first
                return str(exc)
            return ""

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="packio-fetch") as pool:
            problems = [p for p in pool.map(one, files.items()) if p]
        if problems:
            raise RemoteError("\n".join(problems))
        if manifest is not None:
            _write_atomic(vdir / "packio.json", manifest)
        (vdir / COMPLETE).unlink(missing_ok=True)
        (vdir / COMPLETE).touch()

    def _download(self, store: Store, rel: str, dest: Path, info: FileInfo) -> None:
        """Download to a temporary name, verify size and checksum, rename into place."""
        size, digest = info
        dest.parent.mkdir(parents=True, exist_ok=True)
        for stale in dest.parent.glob(f".{dest.name}.part-*"):  # a killed download's leftovers (we hold the lock)
            stale.unlink(missing_ok=True)
        problem = ""
        for attempt in range(2):  # a second try tells a corrupted transfer from a corrupted object
            part = dest.with_name(f".{dest.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                store.get(rel, part, size)
                got = part.stat().st_size
                if size is not None and got != size:
                    problem = f"{got} bytes, the manifest says {size}"
                elif digest is not None and (actual := file_digest(part)) != digest:
                    problem = f"xxh3_128 {actual}, the manifest says {digest}"
                else:
                    os.replace(part, dest)
                    self.downloads += 1
                    return
            finally:
                part.unlink(missing_ok=True)
            log.warning("packio: %s: checksum mismatch (%s)%s", store.url_of(rel), problem,
                        "; downloading it again" if attempt == 0 else "")
        raise RemoteError(f"{store.url_of(rel)}: checksum mismatch ({problem}): the object is corrupt or was "
                          f"replaced after its manifest was written; re-upload the dataset "
                          f"(packio convert SRC URL --overwrite)")

    # -- eviction --------------------------------------------------------------------------

    def _units(self) -> Iterator[tuple[float, int, Path, list[Path], bool]]:
        """(last use, bytes, pin lock, files, whole) for every entry under the root."""
        for dirpath, dirnames, filenames in os.walk(self.root):
            if MARK not in filenames:
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                continue
            vdir = Path(dirpath)
            dirnames[:] = []
            files = [p for p in _data_files(vdir)]
            if (vdir / WHOLE).exists():
                try:
                    used = (vdir / (COMPLETE if (vdir / COMPLETE).exists() else WHOLE)).stat().st_mtime
                except OSError:
                    continue
                size = sum(_size(p) for p in files)
                if files:
                    yield used, size, self._lockfile(vdir, DATASET, "pin"), files, True
                continue
            for p in files:
                try:
                    st = p.stat()
                except OSError:
                    continue
                yield st.st_mtime, st.st_size, self._lockfile(vdir, p.relative_to(vdir).as_posix(), "pin"), [p], False

    def usage(self) -> int:
        """Bytes of cached entries under the root."""
        return sum(u[1] for u in self._units())

    def evict(self, reserve: int = 0) -> None:
        """Delete least recently used entries not in use until ``reserve`` more bytes fit the limit."""
        if self.limit is None:
            return
        units = sorted(self._units(), key=lambda u: u[0])
        total = sum(u[1] for u in units)
        target = max(0, self.limit - reserve)
        for _, size, lockfile, files, whole in units:
            if total <= target:
                return
            try:
                fd = os.open(lockfile, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # in use by some process: never evicted
                os.close(fd)
                continue
            try:
                if whole:
                    (lockfile.parent.parent / COMPLETE).unlink(missing_ok=True)
                for p in files:
                    p.unlink(missing_ok=True)
                total -= size
            finally:
                _unlock(fd)
        if total > target and not self._warned:
            self._warned = True
            log.warning("packio: the cache in %s holds %.1f MB in use, over its limit of %.1f MB; "
                        "the limit should hold at least the shards read at once plus prefetch",
                        self.root, total / 1e6, self.limit / 1e6)


def valid(path: Path, size: int | None) -> bool:
    """A regular file (not a link) of ``size`` bytes (any size when None)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)


def open_cached(path: Path, size: int | None) -> int | None:
    """A descriptor of a cached file, opened without following links; None unless it is
    a regular file of ``size`` bytes (then the caller fetches it again)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size):
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    return None


def _remove(path: Path) -> None:
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _data_files(vdir: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(vdir):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                yield Path(dirpath) / name


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
