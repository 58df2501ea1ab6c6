"""``convert(src, "s3://bucket/ds.tar")``: pack into a local staging folder, then upload.

An upload never overwrites an object a reader may be reading: the files go under
``URL/v-VERSION/`` (``VERSION``: a digest of the new manifest), then the manifest at
``URL/packio.json`` is replaced (one object: atomic), and only then are the old
upload's objects deleted. A failed conversion leaves the old dataset as it was.

A lock object ``URL/.packio-lock`` (created only if absent) makes a second conversion to
the same URL fail at once. It names its holder (host, pid, process start time): a lock
whose holder is a dead process of this machine (SIGKILL, a crash) is taken over at once,
with one log line; any other is a lease of ``LEASE`` seconds, renewed while its
conversion runs and judged by the store's clock (the lock object's modification time
against a probe's), so hosts with skewed clocks never cut a live lease short. A
conversion whose lock was taken meanwhile stops before the switch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from packio.errors import OutputBusyError, OutputExistsError, RemoteAccessError, RemoteError, RemoteNotFoundError
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


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _machine() -> str:
    """This host as a lock names it: host name, boot id and pid namespace, so a pid is
    only ever looked up where it means the same process (not after a reboot, not from
    another container with the same host name)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}|{_read_text('/proc/sys/kernel/random/boot_id')}|{ns}"


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``): with the pid it
    names one process, not a later one given the same pid. None when unknown or no
    process (a zombie is none: killed, not yet reaped)."""
    stat_line = _read_text(f"/proc/{pid}/stat")
    fields = stat_line.rpartition(")")[2].split()  # after the command name, which may hold spaces
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _gone(holder: dict[str, Any]) -> bool:
    """The lock's holder is a process of this machine that no longer runs (its pid is
    free, or now another process's: a different start time)."""
    pid, start = holder.get("pid"), holder.get("start")
    if holder.get("machine") != _machine() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        return _started(pid) is None or (isinstance(start, str) and _started(pid) != start)
    return not _alive(pid)


def _epoch(value: Any) -> float | None:
    """Seconds since the epoch from what a store's ``info`` gives as a modification time."""
    from datetime import datetime, timezone

    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return _epoch(datetime.fromisoformat(value.replace("Z", "+00:00")))
        except ValueError:
            return None
    return None


def _modified(store: Store, rel: str) -> float | None:
    info = store.info(rel)
    return next((t for k in ("LastModified", "last_modified", "mtime", "updated", "created")
                 if (t := _epoch(info.get(k))) is not None), None)


class _Lock:
    """The lock object of one output URL, renewed by a thread while held. It names its
    holder (host, pid, process start time): a holder that is a dead process of this
    machine is known at once; any other keeps its lease, judged by the store's clock."""

    def __init__(self, store: Store, rel: str) -> None:
        self.store, self.rel, self.owner = store, rel, uuid.uuid4().hex
        self.lost = False
        self._since = time.strftime("%Y-%m-%d %H:%M:%S %z")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="packio-lease", daemon=True)

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "machine": _machine(),
                           "pid": os.getpid(), "start": _started(os.getpid()), "since": self._since,
                           "expires": time.time() + LEASE}).encode()

    def holder(self) -> dict[str, Any] | None:
        """What the lock object says (``{}`` when it is not one of ours); None when there is none."""
        try:
            held = json.loads(self.store.read(self.rel, 1 << 16))
        except RemoteNotFoundError:
            return None
        except ValueError:
            return {}
        return held if isinstance(held, dict) else {}

    def acquire(self) -> None:
        for _ in range(3):
            held = self.holder()
            if held is not None:  # first, for stores that ignore "create only"
                if not self._stale(held):
                    raise self._busy(held)
                self.store.delete(self.rel)
            try:
                self.store.put_bytes(self._body(), self.rel, create=True)
            except (RemoteNotFoundError, RemoteAccessError):
                raise
            except RemoteError:  # 412: another one was made meanwhile; look at it
                if self.holder() is None:
                    raise
                continue
            held = self.holder()  # a store without If-None-Match: the last writer holds it
            if held is None or held.get("owner") != self.owner:
                raise self._busy(held or {})
            self._thread.start()
            return
        raise self._busy(self.holder() or {})
    def _stale(self, held: dict[str, Any]) -> bool:
        """The holder is a dead process of this machine (taken over at once), or its lease
        ran out: not renewed for ``LEASE`` seconds by the store's clock (no client's clock
        is trusted: hosts' clocks differ), else by the expiry it wrote. Logs one line."""
        who = _who(held)
        if _gone(held):
            log.warning("packio: %s: taking over the lock of a conversion that is gone (%s)",
                        self.store.url_of(self.rel), who)
            return True
        if held.get("machine") == _machine() and isinstance(held.get("pid"), int):
            return False  # alive here: it holds the lock however long it has not renewed it
        age = self._age()
        if age is None:  # a store without modification times: the writer's clock
            expires = held.get("expires")
            expired = isinstance(expires, (int, float)) and expires < time.time()
        else:
            expired = age > LEASE
        if expired:
            log.warning("packio: %s: taking over the lock of %s: its lease of %.0f s ran out",
                        self.store.url_of(self.rel), who, LEASE)
        return expired

    def _age(self) -> float | None:
        """Seconds since the lock object was last written, both ends by the store's clock
        (the time of a probe object written now); None when the store gives no times."""
        probe = f"{self.rel}.clock-{uuid.uuid4().hex[:12]}"
        try:
            then = _modified(self.store, self.rel)
            self.store.put_bytes(b"", probe)
            try:
                now = _modified(self.store, probe)
            finally:
                _try_delete(self.store, probe)
        except RemoteNotFoundError:
            return float("inf")  # released meanwhile
        return None if then is None or now is None else now - then

    def _busy(self, held: dict[str, Any]) -> OutputBusyError:
        return OutputBusyError(f"{self.store.url_of(self.rel)}: another conversion is writing to this URL "
                               f"({_who(held)}); wait for it, or if none runs (it was killed on another host), "
                               f"delete this object or wait {LEASE:.0f} s for its lease to expire")

    def _renew(self) -> None:
        while not self._stop.wait(LEASE / 3):
            try:
                held = self.holder()
                if held is None or held.get("owner") != self.owner:
                    self.lost = True
                    log.warning("packio: %s: another conversion took this one's lock (%s); this one stops "
                                "before it replaces the dataset", self.store.url_of(self.rel), _who(held or {}))
                    return
                self.store.put_bytes(self._body(), self.rel)
            except RemoteError as exc:
                log.warning("packio: could not renew the lock %s (%s)", self.store.url_of(self.rel), exc)

    def check(self) -> None:
        """Still held by this conversion (before the switch to the new dataset)."""
        held = self.holder()
        if self.lost or held is None or held.get("owner") != self.owner:
            self.lost = True
            raise OutputBusyError(f"{self.store.url_of(self.rel)}: another conversion took this one's lock "
                                  f"({_who(held or {})}) while it ran; the dataset at this URL was left as it "
                                  f"was: run it again once the other is done")

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            held = self.holder()
        except RemoteError:
            held = None
        if held is not None and held.get("owner") == self.owner:  # never another conversion's lock
            _try_delete(self.store, self.rel)


def _who(held: dict[str, Any]) -> str:
    """The holder a lock names, for messages: pid, host, since when."""
    pid, host, since = held.get("pid"), held.get("host"), held.get("since")
    if not isinstance(pid, int) or not isinstance(host, str):
        return "an unknown holder: an older packio, or not packio's"
    where = "this host" if held.get("machine") == _machine() else f"host {host}"
    return f"pid {pid} on {where}" + (f", since {since}" if isinstance(since, str) else "")


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
                lock.check()
                store.put(local, name)  # one object: it appears whole or not at all
            else:
                _upload(store, local, lock.check)
    finally:
        lock.release()
    summary.output = store.url_of(name) if single else str(store)
    summary.seconds = time.perf_counter() - t0  # packing and uploading
    return summary


def _upload(store: Store, local: Path, still_held: Callable[[], None]) -> None:
    """Files under ``v-VERSION/``, then the manifest (the switch, once ``still_held()`` says
    the lock is still this conversion's), then the old objects go."""
    text = (local / MANIFEST_NAME).read_bytes()
    sub = f"v-{version(text)}"
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    rels = [r for r in files if r != MANIFEST_NAME] + [MANIFEST_NAME]
    try:
        with ThreadPoolExecutor(8, thread_name_prefix="packio-upload") as pool:
            list(pool.map(lambda r: store.put(local / r, f"{sub}/{r}"), rels[:-1]))
        store.put(local / MANIFEST_NAME, f"{sub}/{MANIFEST_NAME}")  # marks the upload complete
        old = set(store.listing(""))
        still_held()
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
