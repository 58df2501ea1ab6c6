"""Walk an image folder into a compact listing: keys in one buffer, a folder id per file."""

from __future__ import annotations

import itertools
import os
import stat
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from packio.errors import SourceError
from packio.sample import text_key
from packio.sources.strings import CHUNK, Strings, StringsBuilder

__all__ = ["Files", "walk", "walk_part", "PATH_MAX", "IMAGE_SUFFIXES"]

PATH_MAX = 4096  # bytes: longer paths cannot be opened by name on Linux
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".webp")
Skip = Callable[[str, str, str], None]  # (reason, where, detail)
Start = tuple[str, str, frozenset[tuple[int, int]]]  # (key prefix, folder, the folders above it)


@dataclass
class Files:
    """Every regular file found, sorted (files of a folder, then its sub-folders)."""

    keys: Strings  # path relative to the root, '/'-separated
    folder: np.ndarray  # int32 per file: index into ``folders``
    folders: list[str] = field(default_factory=list)  # each folder's own name ('' for the root)
    with_images: list[bool] = field(default_factory=list)  # per folder: holds a file named like an image


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a symlink loop
        return False


def _sorted_entries(folder: str) -> Iterator[tuple[str, bool, bool]]:
    """(name, is symlink, is dir) of a folder's entries in name order, held as one array
    of names while sorting (a flat folder of millions of files makes no tuple per file)."""
    names = StringsBuilder()
    flags = array("b")
    with os.scandir(folder) as it:
        for e in it:
            names.append(e.name)
            flags.append(e.is_symlink() + 2 * _is_dir(e))
    s = names.build()
    width = int(np.diff(s.offsets).max()) if len(s) else 1
    # names hold no NUL, so the fixed-width copy gives each back exactly; the buffer goes first
    fixed = np.fromiter((n.encode("utf-8", "surrogateescape") for n in s), f"S{width}", len(s))
    del s
    order = np.argsort(fixed, kind="stable")
    for k in range(0, len(order), CHUNK):
        for i in order[k:k + CHUNK].tolist():
            yield fixed[i].decode("utf-8", "surrogateescape"), bool(flags[i] & 1), bool(flags[i] & 2)


class _Walk:
    """One walk's state: what was found so far, and where skips are told."""

    def __init__(self, root: Path, skip: Skip, exclude: set[str], follow: bool) -> None:
        self.root, self.skip, self.exclude, self.follow = root, skip, exclude, follow
        self.top = os.path.realpath(root)
        self.keys, self.folder_of = StringsBuilder(), array("i")
        self.folders: list[str] = []
        self.with_images: list[bool] = []
        self.stored: dict[tuple[bool, str], str] = {}  # the folder being listed: its names that may escape alike

    def run(self, starts: list[Start] | None = None) -> Files:
        # (key prefix, folder, the folders above it): a followed link to one of those is a loop
        stack: list[Start] = list(reversed(starts or [("", str(self.root), frozenset())]))
        while stack:
            stack.extend(reversed(self.folder(*stack.pop())))
        return self.files()

    def files(self) -> Files:
        return Files(self.keys.build(), np.frombuffer(self.folder_of, np.int32).copy() if len(self.folder_of)
                     else np.zeros(0, np.int32), self.folders, self.with_images)

    def folder(self, prefix: str, folder: str,
               above: frozenset[tuple[int, int]]) -> list[tuple[str, str, frozenset[tuple[int, int]]]]:
        """List one folder; returns its sub-folders to walk."""
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in above:
                self.skip("symlink loop (a folder inside itself)", folder, "")
                return []
            entries = _sorted_entries(folder)
            first = next(entries, None)
        except OSError as exc:
            if folder == str(self.root):
                raise SourceError(f"{self.root}: cannot list the folder ({exc.strerror})") from None
            self.skip("unreadable folder", folder, exc.strerror or "")
            return []
        above = above | {(st.st_dev, st.st_ino)}
        fid = len(self.folders)
        self.stored.clear()
        self.folders.append(prefix.rstrip("/").rsplit("/", 1)[-1])
        self.with_images.append(False)
        subfolders = []
        for entry in itertools.chain([first] if first is not None else [], entries):
            sub = self.entry(prefix, folder, fid, *entry)
            if sub is not None:
                subfolders.append((sub[0], sub[1], above))
        return subfolders

    def stored_alike(self, folder: str, name: str, is_dir: bool) -> bool:
        """Whether ``name`` is stored as an earlier entry of its folder is: a name that is not
        UTF-8 is written with ``\\xNN`` escapes (:func:`packio.sample.text_key`), which a name
        holding a backslash may spell already. Such a file is skipped and counted (two samples
        under one key); such a folder refused (its images would share a class and keys)."""
        if name.isascii() and "\\" not in name:
            return False
        first = self.stored.setdefault((is_dir, text_key(name)), name)
        if first == name:
            return False
        if is_dir:
            raise SourceError(f"{os.path.join(folder, first)!r} and {os.path.join(folder, name)!r}: two folders "
                              f"whose names are stored alike, as {text_key(name)!r} (a name that is not UTF-8 is "
                              f"written with \\xNN escapes); rename one of them")
        self.skip("file name stored as another file's is (a name that is not UTF-8 is written with \\xNN escapes)",
                  os.path.join(folder, name), f"as {first!r}")
        return True

    def entry(self, prefix: str, folder: str, fid: int, name: str, link: bool,
              is_dir: bool) -> tuple[str, str] | None:
        """Take one entry: a file is listed, a folder returned, anything else skipped and counted."""
        if self.stored_alike(folder, name, is_dir):
            return None
        full = os.path.join(folder, name)
        if name.startswith("."):
            self.skip("hidden file or folder (name starts with '.')", full, "")
            return None
        if self.exclude and os.path.abspath(full) in self.exclude:
            return None
        rel = prefix + name  # a name that is not UTF-8 stays as found (its key is written with \xNN escapes)
        if len(os.fsencode(os.path.abspath(full))) >= PATH_MAX:
            for below in _files_below(folder, name) if is_dir and not link else [name]:
                self.skip(f"path longer than {PATH_MAX - 1} bytes", full[:200] + ".../" + below[-100:], "")
            return None
        if link and not self.link_ok(full, is_dir):
            return None
        if is_dir:
            return rel + "/", full
        try:
            regular = stat.S_ISREG(os.stat(full).st_mode)
        except OSError as exc:
            self.skip("unreadable file", full, exc.strerror or "")
            return None
        if not regular:  # a FIFO or device would block or never end
            self.skip("not a regular file", full, "")
            return None
        self.keys.append(rel)
        self.folder_of.append(fid)
        if name.lower().endswith(IMAGE_SUFFIXES):
            self.with_images[fid] = True
        return None

    def link_ok(self, full: str, is_dir: bool) -> bool:
        """Follow a symlink only inside the source (or with ``follow``), never into a folder
        already packed under its own path."""
        target = os.path.realpath(full)
        if not os.path.exists(full):
            self.skip("broken or looping symlink", full, "")
            return False
        if not self.follow and not (target == self.top or target.startswith(self.top.rstrip(os.sep) + os.sep)):
            self.skip("symlink to outside the source (--follow-symlinks packs it)", full, target)
            return False
        if is_dir and not self.follow:
            self.skip("symlinked folder inside the source (packed under its own path; "
                      "--follow-symlinks packs it twice)", full, target)
            return False
        return True


def walk(root: Path, skip: Skip, exclude: set[str], follow_symlinks: bool = False) -> Files:
    """Every regular file below ``root``. Symlinks are followed only where they resolve
    inside ``root``, unless ``follow_symlinks``; a symlinked folder is followed only with
    ``follow_symlinks`` (inside ``root`` its files are listed under their own path already).
    Every entry left out is told to ``skip``. Iterative: no depth limit."""
    return _Walk(root, skip, exclude, follow_symlinks).run()


def walk_part(root: Path, skip: Skip, exclude: set[str], follow_symlinks: bool, starts: list[Start],
              recursive: bool) -> tuple[Files, list[Start]]:
    """What :func:`walk` lists from ``starts`` (sibling folders, as the walk reaches them): their
    whole subtrees (``recursive``), or one folder's own files and its sub-folders to walk."""
    w = _Walk(root, skip, exclude, follow_symlinks)
    if recursive:
        return w.run(starts), []
    subfolders = w.folder(*starts[0])
    return w.files(), subfolders


def _files_below(folder: str, name: str) -> list[str]:
    """Files under ``folder/name`` (a folder whose path is too long to open by name), listed
    through descriptors relative to ``folder``: each is counted, none lost silently."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return [name]
    try:
        found = [os.path.join(d, f) for d, _, files, _ in os.fwalk(name, dir_fd=fd) for f in files]
    except OSError:
        found = []
    finally:
        os.close(fd)
    return found or [name]
