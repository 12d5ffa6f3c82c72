"""The one tree walker of the tests. It never follows symlinks (a symlink,
even to a directory, is a leaf), yields entries in sorted order, and can skip
names at the top (a checkout's .git). exchange(): what a review swapping two
names of its tree does (renameat2 RENAME_EXCHANGE: both names always exist)."""

from __future__ import annotations

import ctypes
import os
import stat
from typing import Iterator, NamedTuple


class Entry(NamedTuple):
    path: str  # full path
    rel: str  # relative to the walked top
    info: os.stat_result  # lstat

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.info.st_mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.info.st_mode)

    @property
    def is_link(self) -> bool:
        return stat.S_ISLNK(self.info.st_mode)


def walk(top: str, skip_top: tuple[str, ...] = ()) -> Iterator[Entry]:
    """Every file, directory and symlink under top (top itself excluded); nothing if top is missing."""
    def visit(directory: str, rel: str) -> Iterator[Entry]:
        try:
            names = sorted(os.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            if not rel and name in skip_top:
                continue
            full = os.path.join(directory, name)
            try:
                info = os.lstat(full)
            except FileNotFoundError:
                continue
            entry = Entry(full, os.path.join(rel, name) if rel else name, info)
            yield entry
            if entry.is_dir:
                yield from visit(full, entry.rel)

    yield from visit(top, "")


def files_under(path: str) -> list[str]:
    """Every entry's full path (files, directories, symlinks)."""
    return [entry.path for entry in walk(path)]


def grep_tree(path: str, needle: bytes) -> list[str]:
    """The regular files under path whose content holds needle."""
    hits = []
    for entry in walk(path):
        if entry.is_file:
            with open(entry.path, "rb") as handle:
                if needle in handle.read():
                    hits.append(entry.path)
    return hits


def content_snapshot(path: str, ignore: tuple[str, ...] = ()) -> dict[str, tuple[bytes, int]]:
    """Every regular file's content and mode, by relative path, names in ignore excepted."""
    found = {}
    for entry in walk(path):
        if entry.is_file and os.path.basename(entry.path) not in ignore:
            with open(entry.path, "rb") as handle:
                found[entry.rel] = (handle.read(), entry.info.st_mode)
    return found


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Swap two names atomically (renameat2 RENAME_EXCHANGE), as a review does in its own tree
    while a walker looks: at no instant is either name missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number), os.fspath(a))
