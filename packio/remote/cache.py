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
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
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
        pin = Pin(dest, _lock(self._lockfile(vdir, rel, "pin"), fcntl.LOCK_SH, self.lock_timeout))
        try:
            if not valid(dest, info[0]):
                dl = _lock(self._lockfile(vdir, rel, "dl"), fcntl.LOCK_EX, self.lock_timeout)
                try:
                    if not valid(dest, info[0]):  # nobody fetched it while we waited
                        _remove(dest)  # a planted link, a truncated or grown file: fetched again
                        self.evict(reserve=info[0] or 0)
                        self._note(dest, info[0])
                        self._download(store, rel, dest, info)
                        if info[0] is None:
                            self._note(dest, _size(dest))
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
        self._note(vdir, total, whole=True)

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
        if self._index is None:
            self._index = Index(self.root, self.lock_timeout, self._walk_entries)
        return self._index

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _index=None)  # a worker reads the journal itself (not a parent's copy)

    def _note(self, entry: Path, size: int | None, whole: bool = False) -> None:
        """Record an entry in the index before it is written (a crash in between only
        over-counts, which the next eviction pass corrects)."""
        if size is not None:
            self.index.add(entry.relative_to(self.root).as_posix(), size, whole)

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

    def evict(self, reserve: int = 0) -> None:
        """Delete least recently used entries not in use until ``reserve`` more bytes fit
        the limit. The index says whether anything must go (no walk); a pass, under the
        index's lock, stats the indexed entries once and frees a tenth of the limit more
        than needed, so passes are rare when every download needs room."""
        if self.limit is None:
            return
        index, target = self.index, max(0, self.limit - reserve)
        index.ensure()
        if index.total <= target:
            return
        with index.exclusive():
            index.refresh()
            if index.total > target:
                self._evict_pass(max(0, target - self.limit // 10))
            total = index.total
        if total > target and not self._warned:
            self._warned = True
            log.warning("packio: the cache in %s holds %.1f MB in use, over its limit of %.1f MB; "
                        "the limit should hold at least the shards read at once plus prefetch",
                        self.root, total / 1e6, self.limit / 1e6)

    def _walk_entries(self) -> dict[str, tuple[int, bool]]:
        return {(lock.parent.parent if whole else files[0]).relative_to(self.root).as_posix(): (size, whole)
                for _, size, lock, files, whole in self._units()}

    def _evict_pass(self, goal: int) -> None:
        """Least recently used first, skipping entries in use, down to ``goal`` bytes if
        possible (caller holds the index exclusively). Each removal is journalled as it
        happens: a crash mid-pass leaves files and index agreeing but for one entry."""
        index = self.index
        units = []
        for rel, (size, whole) in list(index.entries.items()):
            used = _last_use(self.root / rel, whole) if _within(self.root, self.root / rel) else None
            if used is None:
                index.drop(rel)  # gone (evicted by a crashed pass, removed by hand, a failed download)
            else:
                units.append((used, rel, whole))
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
    written since, not a walk. Appends hold its lock shared, rewrites exclusively.
    The journal is a hint kept honest: an entry it lists that is gone is dropped by
    the next eviction pass, and it is rebuilt from a walk when it has grown to four
    times its entries (amortised: a walk per thousands of downloads), when it is
    missing, or unreadable."""

    NAME = ".packio-index"
    LINE = 1 << 16  # a longer "line" is not one of ours: skipped

    def __init__(self, root: Path, lock_timeout: float, walk: Callable[[], dict[str, tuple[int, bool]]]) -> None:
        self.path, self.lockpath = root / self.NAME, root / f"{self.NAME}.lock"
        self.lock_timeout, self.walk = lock_timeout, walk  # walk(): every entry, from the file system
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
            entries = self.walk()
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
        """Hold the journal's lock alone: one eviction pass or rebuild at a time."""
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
