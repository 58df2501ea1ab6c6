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
entries (a use touches the file's mtime) before a download that needs room; the
cache's :class:`Index` (a journal at the root) says how full it is without a walk.

The bound under concurrency: a download reserves its bytes in the journal before it
starts, in the same critical section (the journal's lock, held alone) that checks the
room and evicts, so two downloaders never both take the last free bytes. An entry
whose file is missing is "in flight" while its ``*.dl`` lock is held: an eviction pass
keeps its reservation; once the lock is free (the download failed, or its process
died: the kernel drops a dead process's locks) the pass drops it and removes the
killed download's partial file. When eviction cannot make room (everything else is in
use or in flight) a download goes ahead over the limit, so the cache holds at most
``limit`` plus one in-flight object per downloader; the entry is trimmed back when
its last user releases it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from packio.errors import RemoteError
from packio.manifest import file_digest
from packio.remote.store import Store

__all__ = ["Cache", "Index", "Pin", "default_cache_dir", "open_cached", "parse_size", "valid"]

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

    def __init__(self, path: Path, fd: int, after: Callable[[], None] | None = None) -> None:
        self.path, self._fd, self.pid, self._after = path, fd, os.getpid(), after

    def release(self) -> None:
        """Unpin; then ``after()`` (the cache trims itself back to its limit)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _unlock(fd)
            if self._after is not None:
                self._after()

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
        self._index: Index | None = None

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

    def content_identity(self, store: Store, rel: str, size: int | None) -> str:
        """The digest of the object at ``rel`` (downloaded, at most ``size`` bytes, then
        removed). It names the object's cache version when the server gives neither ETag
        nor modification time: an unchanged object keeps its version, a replaced one (even
        of the same size) gets a new one, and nothing piles up per open."""
        tmp = self.root / f".identity-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for left in self.root.glob(".identity-*"):  # killed opens' downloads: no eviction pass sees them
                pid = left.name.split("-")[1]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    left.unlink(missing_ok=True)
            store.get(rel, tmp, size)
            return "xxh3:" + file_digest(tmp)
        except OSError as exc:
            raise RemoteError(f"{self.root}: cannot write the download cache there ({exc.strerror}); pass "
                              f"cache_dir= or set PACKIO_CACHE_DIR to a writable folder") from None
        finally:
            tmp.unlink(missing_ok=True)

    def _lockfile(self, vdir: Path, rel: str, kind: str) -> Path:
        return vdir / LOCKS / f"{rel}.{kind}"

    def fetch(self, store: Store, rel: str, vdir: Path, info: FileInfo) -> Pin:
        """Pin ``vdir/rel``, downloading it first unless some process already did."""
        dest = vdir / rel
        pin = Pin(dest, _lock(self._lockfile(vdir, rel, "pin"), fcntl.LOCK_SH, self.lock_timeout), self.trim)
        try:
            if not valid(dest, info[0]):
                dl = _lock(self._lockfile(vdir, rel, "dl"), fcntl.LOCK_EX, self.lock_timeout)
                try:
                    if not valid(dest, info[0]):  # nobody fetched it while we waited
                        _remove(dest)  # a planted link, a truncated or grown file: fetched again
                        self._reserved_download(store, rel, dest, info)
                finally:
                    _unlock(dl)
            os.utime(dest)  # LRU: last use
            return pin
        except BaseException:
            pin.release()
            raise

    def _reserved_download(self, store: Store, rel: str, dest: Path, info: FileInfo) -> None:
        """Reserve the entry's bytes, download it (caller holds its ``dl`` lock); a
        failed download gives its reservation back."""
        self.reserve(dest, info[0])
        try:
            self._download(store, rel, dest, info)
        except BaseException:
            self.index.drop(dest.relative_to(self.root).as_posix())
            raise
        if info[0] is None:
            self._note(dest, _size(dest))

    def fetch_all(self, store: Store, files: dict[str, FileInfo], vdir: Path, manifest: bytes | None,
                  threads: int = 8) -> Pin:
        """Pin a whole dataset (one eviction unit), downloading what is missing; the
        local ``packio.json`` is written last, and ``.complete`` after it."""
        (vdir / WHOLE).touch()
        pin = Pin(vdir, _lock(self._lockfile(vdir, DATASET, "pin"), fcntl.LOCK_SH, self.lock_timeout), self.trim)
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
            raise RemoteError(f"{store}: this dataset is {total / 1e6:.1f} MB ({total} bytes) and is cached whole, "
                              f"more than the cache limit of {self.limit / 1e6:.1f} MB ({self.limit} bytes); raise "
                              f"cache_limit")
        self.reserve(vdir, total, whole=True)

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
        raise RemoteError(f"{store.url_of(rel)}: checksum mismatch ({problem}): the object is corrupt, or was "
                          f"replaced after its manifest was written (or, for shards without one, after the "
                          f"dataset was opened): open the dataset again; if it persists, re-upload it "
                          f"(packio convert SRC URL --overwrite)")

    # -- eviction ----------------------------------------------------------------------------

    @property
    def index(self) -> "Index":
        """This process's view of the journal (a forked child makes its own: the parent's
        locks and thread state are not the child's)."""
        if self._index is None or self._index.pid != os.getpid():
            self._index = Index(self.root, self.lock_timeout, self._walk_entries, self._pending)
        return self._index

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _index=None)  # a worker reads the journal itself (not a parent's copy)

    def _note(self, entry: Path, size: int | None, whole: bool = False) -> None:
        """Record an entry in the index (no room check: see :meth:`reserve`)."""
        if size is not None:
            self.index.add(entry.relative_to(self.root).as_posix(), size, whole)

    def reserve(self, entry: Path, size: int | None, whole: bool = False) -> None:
        """Make room for ``size`` bytes at ``entry`` and record them, in one critical
        section: the room is checked, made and taken under the journal's lock held
        alone, so concurrent downloaders (threads or processes) never count the same
        free bytes. The caller holds the entry's ``dl`` lock until the file is in place
        (that is what keeps the reservation alive in an eviction pass)."""
        if self.limit is None or size is None:
            self._note(entry, size, whole)
            return
        rel, index = entry.relative_to(self.root).as_posix(), self.index
        index.ensure()
        with index.exclusive():
            index.refresh()
            self._make_room(size - index.entries.get(rel, (0, False))[0])
            index.add(rel, size, whole)
            total = index.total
        self._warn_over(total)

    def evict(self, reserve: int = 0) -> None:
        """Delete least recently used entries not in use until ``reserve`` more bytes fit
        the limit (a pass frees a tenth of the limit more than needed, so passes are rare
        when every download needs room)."""
        if self.limit is None:
            return
        index = self.index
        index.ensure()
        with index.exclusive():
            index.refresh()
            self._make_room(reserve)
            total = index.total
        self._warn_over(total + reserve)

    def trim(self) -> None:
        """Back to the limit when over it (after an entry is released: what a download
        that went over the limit left becomes evictable then). Costs a read of the
        journal's tail when under it; never raises (it runs when a reader lets go of a file)."""
        try:
            if self.limit is None or not self.index.refresh() or self.index.total <= self.limit:
                return
            with self.index.exclusive():
                self.index.refresh()
                self._make_room(0)
        except (OSError, RemoteError) as exc:
            log.debug("packio: could not trim the cache %s: %s", self.root, exc)

    def _make_room(self, need: int) -> None:
        """An eviction pass when ``need`` more bytes do not fit (caller holds the index alone)."""
        if self.limit is not None and self.index.total + need > self.limit:
            self._evict_pass(max(0, self.limit - max(0, need) - self.limit // 10))

    def _warn_over(self, total: int) -> None:
        if self.limit is not None and total > self.limit and not self._warned:
            self._warned = True
            log.warning("packio: the cache in %s holds %.1f MB in use or in flight, over its limit of %.1f MB; "
                        "the limit should hold at least the shards read at once plus prefetch",
                        self.root, total / 1e6, self.limit / 1e6)

    def _units(self) -> Iterator[tuple[float, int, Path, list[Path], bool]]:
        """(last use, bytes, pin lock, files, whole) for every entry under the root: a walk,
        for :meth:`usage` and to (re)build the index, never per download."""
        for dirpath, dirnames, filenames in os.walk(self.root):
            if MARK not in filenames:
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                continue
            vdir = Path(dirpath)
            dirnames[:] = []
            files = [p for p in _data_files(vdir)]
            if (vdir / WHOLE).exists():
                used = _last_use(vdir, True)
                if files and used is not None:
                    yield used, sum(_size(p) for p in files), self._lockfile(vdir, DATASET, "pin"), files, True
                continue
            for p in files:
                try:
                    st = p.stat()
                except OSError:
                    continue
                yield st.st_mtime, st.st_size, self._lockfile(vdir, p.relative_to(vdir).as_posix(), "pin"), [p], False

    def usage(self) -> int:
        """Bytes of cached entries under the root (a walk: the truth, not the index)."""
        return sum(u[1] for u in self._units())

    def _walk_entries(self) -> dict[str, tuple[int, bool]]:
        return {(lock.parent.parent if whole else files[0]).relative_to(self.root).as_posix(): (size, whole)
                for _, size, lock, files, whole in self._units()}

    def _pending(self, rel: str, whole: bool) -> bool:
        """The entry is not on disk yet, and a download of it is under way."""
        return _last_use(self.root / rel, whole) is None and self._in_flight(rel, whole)

    def _in_flight(self, rel: str, whole: bool) -> bool:
        """Whether some process is downloading the entry ``rel`` (its ``dl`` lock is held).
        When none is, a killed download's partial files of the entry are removed, under
        that lock."""
        path = self.root / rel
        vdir = path if whole else _vdir_of(path, self.root)
        if vdir is None or not _within(self.root, path):
            return False
        try:
            fd = os.open(self._lockfile(vdir, DATASET if whole else path.relative_to(vdir).as_posix(), "dl"),
                         os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False  # never locked: nobody downloads it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return True
        try:
            if not whole:
                for part in path.parent.glob(f".{path.name}.part-*"):
                    part.unlink(missing_ok=True)
            return False
        finally:
            _unlock(fd)

    def _evict_pass(self, goal: int) -> None:
        """Least recently used first, skipping entries in use, down to ``goal`` bytes if
        possible (caller holds the index exclusively). An entry whose file is missing is
        kept while it is in flight (a download holds its lock), else dropped. Each removal
        is journalled as it happens: a crash mid-pass leaves files and index agreeing but
        for one entry."""
        index = self.index
        units = []
        for rel, (size, whole) in list(index.entries.items()):
            path = self.root / rel
            inside = _within(self.root, path)
            used = _last_use(path, whole) if inside else None
            if used is not None:
                units.append((used, rel, whole))
            # looked at again once no download holds it: one may have ended in between (none can
            # start: we hold the index)
            elif not inside or (not self._in_flight(rel, whole) and _last_use(path, whole) is None):
                index.drop(rel)  # gone (evicted by a crashed pass, removed by hand, a failed or killed download)
        units.sort()
        for _, rel, whole in units:
            if index.total <= goal:
                return
            if self._remove_unit(self.root / rel, whole):
                index.drop(rel)

    def _remove_unit(self, path: Path, whole: bool) -> bool:
        """Delete one entry unless some process has it pinned; False when in use."""
        vdir = path if whole else _vdir_of(path, self.root)
        if vdir is None or not _within(self.root, path):
            return False  # never delete what lies outside the cache (a link, or an edited journal)
        lockfile = self._lockfile(vdir, DATASET if whole else path.relative_to(vdir).as_posix(), "pin")
        try:
            lockfile.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lockfile, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # in use by some process: never evicted
            os.close(fd)
            return False
        try:
            if whole:
                (vdir / COMPLETE).unlink(missing_ok=True)  # first: a half-deleted dataset is never trusted
                for p in list(_data_files(vdir)):
                    p.unlink(missing_ok=True)
            else:
                path.unlink(missing_ok=True)
            return True
        finally:
            _unlock(fd)


class Index:
    """Which entries the cache holds and their sizes: an append-only journal at the root
    (``+`` entry, bytes, whole / ``-`` entry, one JSON line each) that every process
    reads from where it last stopped, so knowing the cache's usage costs what was
    written since, not a walk. Appends hold its lock shared, rewrites exclusively;
    within a process a mutex orders threads the same way. An entry is recorded when its
    download starts (a reservation). The journal is a hint kept honest: an entry it
    lists that is gone and not in flight is dropped by the next eviction pass, and it is
    rebuilt from a walk (keeping the reservations still in flight) when it has grown to
    four times its entries (amortised: a walk per thousands of downloads), when it is
    missing, or unreadable."""

    NAME = ".packio-index"
    LINE = 1 << 16  # a longer "line" is not one of ours: skipped

    def __init__(self, root: Path, lock_timeout: float, walk: Callable[[], dict[str, tuple[int, bool]]],
                 pending: Callable[[str, bool], bool]) -> None:
        self.path, self.lockpath = root / self.NAME, root / f"{self.NAME}.lock"
        self.lock_timeout, self.walk = lock_timeout, walk  # walk(): every entry, from the file system
        self.pending = pending  # pending(entry, whole): not on disk yet, its download under way
        self.pid = os.getpid()
        self._mutex = threading.RLock()  # the threads of this process, one at a time
        self.entries: dict[str, tuple[int, bool]] = {}
        self.total, self.lines = 0, 0
        self._seen: tuple[int, int] | None = None  # (device, inode) of the journal read so far
        self._offset = 0
        self._held: int | None = None  # the exclusive lock's fd while held

    def _set(self, rel: str, value: tuple[int, bool] | None) -> None:
        old = self.entries.pop(rel, None)
        if old is not None:
            self.total -= old[0]
        if value is not None:
            self.entries[rel] = value
            self.total += value[0]

    def _apply(self, line: bytes) -> None:
        if not line:
            return
        self.lines += 1
        try:
            rec = json.loads(line)
        except ValueError:
            return  # a torn line (a crash mid-append): the walk at the next rebuild knows better
        if not (isinstance(rec, list) and len(rec) in (2, 4) and isinstance(rec[1], str) and _inside(rec[1])):
            return  # not ours, or naming something outside the cache: never trusted
        if len(rec) == 4 and rec[0] == "+" and isinstance(rec[2], int) and 0 <= rec[2] < 1 << 50:
            self._set(rec[1], (rec[2], bool(rec[3])))
        elif len(rec) == 2 and rec[0] == "-":
            self._set(rec[1], None)

    def refresh(self) -> bool:
        """Catch up with the journal (from its start when it was rewritten); False when there is none."""
        with self._mutex:
            return self._catch_up()

    def _catch_up(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            self._seen = None
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return False
            if (st.st_dev, st.st_ino) != self._seen or st.st_size < self._offset:
                self.entries, self.total, self.lines, self._offset = {}, 0, 0, 0
                self._seen = (st.st_dev, st.st_ino)
            os.lseek(fd, self._offset, os.SEEK_SET)
            rest = b""
            while chunk := os.read(fd, 1 << 20):
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()
                if len(rest) > self.LINE:
                    self._offset += len(rest)
                    rest = b""
                for line in lines:
                    self._offset += len(line) + 1
                    self._apply(line)
            return True  # an unfinished last line is read again next time
        finally:
            os.close(fd)

    def _fresh(self) -> bool:
        return self.refresh() and self.lines <= 4 * len(self.entries) + 1024

    def ensure(self) -> None:
        """Read the journal; build it from a walk when there is none, rebuild it when it
        has grown far past its entries."""
        if self._fresh():
            return
        with self.exclusive():
            if self._fresh():
                return  # another process did it meanwhile
            # reservations of downloads under way (not on disk yet), asked before the walk: a
            # download that ends meanwhile is then on disk; none can start, we hold the lock
            flying = {rel: v for rel, v in self.entries.items() if self.pending(rel, v[1])}
            entries = self.walk()
            for rel, (size, whole) in flying.items():
                if entries.get(rel, (0, whole))[0] < size:
                    entries[rel] = (size, whole)
            tmp = self.path.with_name(f"{self.NAME}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                tmp.write_bytes(b"".join(_record("+", rel, size, whole) for rel, (size, whole) in entries.items()))
                os.replace(tmp, self.path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                log.debug("packio: cannot write the cache index %s: %s", self.path, exc)
            self.refresh()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the journal's lock alone: one eviction pass, reservation or rebuild at a time
        (re-entrant in one thread; the other threads of the process wait for the mutex)."""
        with self._mutex:
            if self._held is not None:
                yield
                return
            self._held = _lock(self.lockpath, fcntl.LOCK_EX, self.lock_timeout)
            try:
                yield
            finally:
                fd, self._held = self._held, None
                _unlock(fd)

    def add(self, rel: str, size: int, whole: bool) -> None:
        self._write(_record("+", rel, size, whole))

    def drop(self, rel: str) -> None:
        self._write(_record("-", rel))

    def _write(self, line: bytes) -> None:
        """Append one record (one write: appends never interleave) and apply it here; a
        cache without a journal yet gets none (the first eviction builds it from a walk)."""
        with self._mutex:
            self._append(line)

    def _append(self, line: bytes) -> None:
        fd = _lock(self.lockpath, fcntl.LOCK_SH, self.lock_timeout) if self._held is None else None
        try:
            out = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(out, line)
            finally:
                os.close(out)
        except OSError:
            return
        finally:
            if fd is not None:
                _unlock(fd)
        if not self._fresh() and self._held is None:
            self.ensure()  # grown past its entries: rewritten (also where no eviction ever runs)


def _record(kind: str, rel: str, *rest: object) -> bytes:
    """One journal line; it starts with a newline too, so a line torn by a crash ends
    before the next record instead of swallowing it."""
    return b"\n" + json.dumps([kind, rel, *rest]).encode() + b"\n"


def _last_use(path: Path, whole: bool) -> float | None:
    """When an entry was last used (its mtime; a whole dataset's ``.complete``), None when gone."""
    for p in ((path / COMPLETE, path / WHOLE) if whole else (path,)):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            return st.st_mtime
    return None


def _inside(rel: str) -> bool:
    """A journal entry names a path below the cache root: relative, no ``.``/``..``/empty parts."""
    return bool(rel) and "\0" not in rel and all(p not in ("", ".", "..") for p in rel.split("/"))


def _within(root: Path, path: Path) -> bool:
    """``path``, links resolved, lies below ``root`` (resolved too)."""
    real = os.path.realpath(root)
    return os.path.commonpath([real, os.path.realpath(path)]) == real


def _vdir_of(path: Path, root: Path) -> Path | None:
    """The version folder (the one with the cache mark) holding a cached file."""
    for parent in path.parents:
        if parent == root or root not in parent.parents:
            return None
        if (parent / MARK).is_file():
            return parent
    return None


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
