"""Output safety: a lock beside the output, SIGTERM / SIGHUP unwinding like Ctrl-C, the
output built under a temporary name and moved into place atomically (``renameat2``:
never over something that appeared meanwhile; ``overwrite`` swaps with the old dataset).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import signal
import stat
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

from packio.errors import FormatError, OutputBusyError, OutputExistsError, PackioError
from packio.formats import open_reader
from packio.formats.reader import Reader
from packio.manifest import MANIFEST_NAME, dataset_files, trust_manifest

__all__ = ["TMP_MARK", "check_output", "check_not_inside_dataset", "output_lock", "terminate_cleanly", "staged",
           "temp_name", "commit", "clean_stale", "stale", "is_dataset", "remove", "fsync_tree", "fsync_path"]

TMP_MARK = ".packio-tmp-"


@contextlib.contextmanager
def staged(dst: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary name beside ``dst`` to write the output to: when the block ends, the
    output is synced and committed to ``dst``; when it fails, the partial output goes
    (and a failed write, a full disk included, is a packio error)."""
    clean_stale(dst)
    tmp = temp_name(dst)
    try:
        yield tmp
        fsync_tree(tmp)
        commit(tmp, dst, overwrite)
    except OSError as exc:
        remove(tmp)
        raise PackioError(f"{dst}: writing failed ({exc.strerror or exc}); the partial output was removed"
                          + ("; free some disk space and run again" if exc.errno == errno.ENOSPC else "")) from None
    except BaseException:
        remove(tmp)
        raise


def temp_name(final: Path) -> Path:
    """A name beside ``final`` for this process to build it under (its pid marks it for :func:`clean_stale`)."""
    return final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove(path: Path) -> None:
    """Remove a file or folder (a symlink itself, never where it points)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def clean_stale(dst: Path) -> None:
    """Remove temporaries left by killed runs (their pid is gone)."""
    for p in dst.parent.glob(f".{dst.name}{TMP_MARK}*"):
        if stale(p):
            remove(p)


def stale(p: Path) -> bool:
    """Whether ``p`` is a temporary (:func:`temp_name`) of a process that is gone."""
    pid = p.name.rsplit(TMP_MARK, 1)[-1].split("-")[0]
    return pid.isdigit() and not Path(f"/proc/{pid}").exists()


def is_dataset(path: Path) -> bool:
    """A packio dataset: a folder whose manifest parses, or a file a format claims that
    carries packio's manifest (an HDF5 file written by packio; not foreign tar shards)."""
    try:
        if path.is_dir():
            Reader.read_manifest(path)
            return True
        return path.is_file() and not open_reader(path).manifest.source.get("foreign")
    except (FormatError, OSError):
        return False


def check_not_inside_dataset(dst: Path) -> None:
    """Refuse an output inside a packio folder dataset (symlinks resolved): a part of a
    grown dataset written on its own would no longer be the part its top manifest lists,
    and any other file there is not the dataset's."""
    near_first = sorted({*Path(os.path.abspath(dst)).parents, *Path(os.path.realpath(dst)).parents},
                        key=lambda p: -len(p.parts))
    for above in near_first:
        if not (above / MANIFEST_NAME).is_file():
            continue
        try:
            with trust_manifest():  # an edited manifest still marks a dataset's folder
                parts = Reader.read_manifest(above).extra.get("parts")
        except (FormatError, OSError):
            continue  # not a packio manifest: not a dataset's folder
        listed = [os.path.normpath(p["path"]) for p in parts if isinstance(p, dict) and isinstance(p.get("path"), str)
                  ] if isinstance(parts, list) else []
        rel = os.path.relpath(os.path.realpath(dst), os.path.realpath(above))
        if rel in listed:
            raise PackioError(f"{dst} is part {listed.index(rel) + 1} of the dataset {above}, which lists each "
                              f"part by id: converting into a part alone would change it under the dataset, which "
                              f"would then refuse to open. Append to the whole dataset (packio convert SRC {above} "
                              f"--append), or write elsewhere")
        raise PackioError(f"{dst} lies inside the packio dataset {above}, whose folder holds only its own files; "
                          f"write the output elsewhere")


def check_output(dst: Path, overwrite: bool) -> None:
    """Refuse an existing ``dst`` unless ``overwrite`` is given and it is a packio dataset."""
    if not os.path.lexists(dst):
        return
    if not overwrite:
        raise OutputExistsError(f"{dst} exists; pass --overwrite to replace it, or choose another name")
    if not is_dataset(dst):
        raise OutputExistsError(f"{dst} exists and is not a packio dataset; --overwrite replaces only a packio "
                                f"dataset (a folder with {MANIFEST_NAME}, or a packio HDF5 file): remove it "
                                f"yourself or choose another name")


@contextlib.contextmanager
def output_lock(dst: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``dst`` for the whole conversion (a lock file beside
    it): a second conversion to the same path fails at once instead of racing this one.
    The lock is the resolved path's: two appends through a symlink and the real name
    would otherwise both commit, the second dropping the first's part."""
    import fcntl

    real = Path(os.path.realpath(dst))
    path = real.with_name(f".{real.name}.packio-lock")
    while True:
        try:
            # never through a planted symlink (it would create a file where it points), never blocking
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise PackioError(f"{path}: cannot create the output's lock file ({exc.strerror}); if it is a "
                              f"symlink or not a regular file, remove it") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PackioError(f"{path}: the output's lock file is not a regular file; remove it")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException as exc:
            os.close(fd)
            if not isinstance(exc, BlockingIOError):
                raise
            raise OutputBusyError(f"{dst}: another packio conversion is writing it now (it holds {path}); "
                                  f"wait for it to finish, or choose another output") from None
        try:  # the file on disk, not one its last holder removed after we opened it
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still holding it: a waiter then sees a fresh file
        os.close(fd)


class _Terminated(BaseException):
    """SIGTERM / SIGHUP during a conversion: unwinds like Ctrl-C so the temporary output goes."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """While converting in the main thread, turn SIGTERM / SIGHUP (where they would kill
    the process outright) into an exception; after the clean-up, die of the signal."""
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def handler(signum: int, frame: Any) -> None:
            raise _Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                saved[sig] = signal.signal(sig, handler)
    try:
        yield
    except _Terminated as exc:
        for sig, old in saved.items():
            signal.signal(sig, old)
        saved.clear()
        os.kill(os.getpid(), exc.signum)
        raise
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def _rename2(src: Path, dst: Path, flag: int) -> bool:
    """Linux ``renameat2`` with RENAME_NOREPLACE or RENAME_EXCHANGE (atomic); False where
    the C library or the file system lacks it, and the caller falls back."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(-100, os.fsencode(src), -100, os.fsencode(dst), flag) == 0:  # -100: AT_FDCWD
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def commit(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Move the finished output into place: swapped atomically with an existing packio
    dataset (overwrite), else renamed, never over something that appeared meanwhile."""
    if overwrite and os.path.lexists(dst):
        check_output(dst, overwrite)  # still a packio dataset
        if _rename2(tmp, dst, _RENAME_EXCHANGE):
            remove(tmp)  # tmp now names the old dataset
            return
        old = dst.with_name(f".{dst.name}{TMP_MARK}{os.getpid()}-old")
        os.rename(dst, old)
        os.rename(tmp, dst)
        remove(old)
        return
    try:
        if _rename2(tmp, dst, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        pass
    else:
        if not os.path.lexists(dst):
            os.rename(tmp, dst)
            return
    raise OutputExistsError(f"{dst} appeared while converting (written by another program); it was left as it "
                            f"is and this output dropped: pass --overwrite to replace it, or choose another name")


def fsync_tree(root: Path) -> None:
    """Flush every file of the output to disk before it is renamed into place."""
    for p in dataset_files(root):
        fsync_path(p)


def fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    """Flush one file to disk (with ``os.O_DIRECTORY``: a folder's entries)."""
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
