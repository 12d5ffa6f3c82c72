"""Registered holds: the holds gc keeps whatever bounds it puts on readers' locks (DESIGN
invariant 4, "never one held by a running exec", beside invariant 18's bound on readers).

Any process that can read a checkout can lock its marker shared, so a bare shared lock is
bounded (upkeep/eviction.py: max-held, max-hold-age). A hold made by the store's writer
(an `exec` or a workspace copy of the writer's uid, and serve's own holds, those of
/v1/hold and those it makes for a read-only reader's exec) is also registered here:

    <root>/holds/<pid>-<nonce>.hold   {"key", "name", "pid", "at"}: the checkout held, and by whom

made under `.new-<pid>-<nonce>` (locked exclusive, written, then renamed into place: the
lock travels with the inode), held exclusive by the holder for the hold's whole life (the
command an exec runs inherits it, as it inherits the marker's lock) and removed at its
release. Only the writer may write <root>, so no reader can make one. A hold file whose
lock is free is a dead holder's: gc removes it (never waiting: its lock is only tried).
"""

from __future__ import annotations

import fcntl
import json
import os
import time

from checkoutcache.store import locks, records, tree
from checkoutcache.store.layout import RootPaths, entries

HOLD_SUFFIX = ".hold"
MAKING_PREFIX = ".new-"
HOLD = records.schema({"key": records.key, "name": records.text}, {"pid": records.count, "at": records.finite})


class Registration:
    """A registered hold of this process: its file, and the descriptor that locks it."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self.fd = fd

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            if os.path.samestat(os.fstat(self.fd), tree.lstat(self.path)):
                tree.unlink(self.path)  # ours: removed while our lock says so
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def register(root_paths: RootPaths, key: str, name: str) -> Registration:
    """Register a hold of checkout NAME of repository KEY (OSError where the root cannot be written)."""
    tree.make_private_dir(root_paths.holds_dir)
    nonce = os.urandom(8).hex()
    making = os.path.join(root_paths.holds_dir, f"{MAKING_PREFIX}{os.getpid()}-{nonce}")
    final = root_paths.hold_record(os.getpid(), nonce)
    fd = tree.open_file(making, os.O_RDWR | os.O_EXCL, create=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: nobody else holds it
        os.write(fd, json.dumps({"key": key, "name": name, "pid": os.getpid(), "at": time.time()}).encode())
        tree.rename(making, final)
    except BaseException:
        os.close(fd)
        tree.unlink(making)
        raise
    return Registration(final, fd)


def registered(root_paths: RootPaths, dry_run: bool = False) -> frozenset[tuple[str, str]]:
    """The (key, name) of every checkout a live registered hold holds; a dead holder's file goes
    (not in a dry run). A file that cannot be read, or is not a regular file, holds nothing."""
    found = set()
    try:
        names = entries(root_paths.holds_dir)
    except OSError:
        return frozenset()
    for name in names:
        path = os.path.join(root_paths.holds_dir, name)
        if not name.endswith(HOLD_SUFFIX) and not name.startswith(MAKING_PREFIX):
            continue
        try:
            free = locks.try_lock(path, create=False)
        except OSError:
            continue
        if free is not None:
            with free:
                if not dry_run and (name.endswith(HOLD_SUFFIX) or time.time() - tree.lstat(path).st_mtime > 3600):
                    tree.unlink(path)  # its holder is gone (a `.new-` one only once old: it may be in the making)
            continue
        if name.endswith(HOLD_SUFFIX):
            try:
                record = records.read_json(path, HOLD)
            except OSError:
                record = None
            if record is not None:
                found.add((record["key"], record["name"]))
    return frozenset(found)
