"""The ready answer's fast path: is this checkout published, and mark it used.

This runs on nearly every tool call of every review, so it imports only the
standard library: no git library. It uses fcntl.flock, the same primitive as
store/locks.py, so its shared lock and the evictor's exclusive lock exclude
each other.

Invariant 4, the ready side: we hold the marker's shared lock while we check
that the marker is still at its published path and set its mtime (the last
use). An evictor must hold the exclusive lock to re-check the last use and
rename the checkout away, so either our touch comes first (and the evictor
sees a fresh use and keeps it), or the rename comes first (and we see the
path gone and answer not-ready, so the caller re-clones).

The evictor's exclusive lock is two: flock's, and an open file description's
write lock (F_OFD_SETLK), which only a descriptor opened for writing can take,
so only a writer of the store. Any uid that reads the marker can take flock's
exclusive lock (flock ignores the open mode) and keep it: a review that did so
made every ready answer of that checkout wait, then start a clone. So a shared
lock refused is followed by the description's read lock: granted, no evictor
moves the checkout (it would hold the write lock), and the read lock keeps one
from doing so, as the shared lock would (checkout_exclusive takes both). The
fallback waits FALLBACK_AFTER first: an evictor's exclusive flock lasts a rename
(milliseconds), and an older version's evictor takes flock's alone, so a lock
held that briefly is waited out as before; only a lock held longer (a reader's)
is passed by. Where the kernel or file system has no OFD locks, both sides keep
to flock alone, as before.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import struct
import time

# The evictor holds the exclusive lock only to re-check and rename (milliseconds);
# waiting longer than this means something is wrong with it, and answering
# "not ready" (so a clone starts) is better than hanging a review.
SHARED_LOCK_WAIT = 2.0
# How long an exclusive flock is waited for before the description's read lock is tried.
FALLBACK_AFTER = 0.25


# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (and its padding).
_FLOCK = "hhqqi4x"


# No OFD locks here (an older kernel, a file system without them): flock alone, as before.
_UNSUPPORTED = {errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


def description_lock(fd: int, kind: int) -> bool | None:
    """The open file description's lock of the whole file (fcntl.F_RDLCK or F_WRLCK, never
    waiting): False when another description holds a conflicting one (or a write lock is asked
    of a read-only descriptor), None where there are no such locks."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, 0, 0, 0, 0))
        return True
    except OSError as exc:
        return None if exc.errno in _UNSUPPORTED else False


def description_locked(fd: int) -> bool:
    """Whether another description holds a lock of the file that an evictor's write lock meets."""
    try:
        found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, 0, 0, 0))
    except OSError:
        return False
    return struct.unpack(_FLOCK, found)[0] != fcntl.F_UNLCK


def open_marker_shared(marker: str, wait: float = SHARED_LOCK_WAIT) -> int | None:
    """A descriptor holding the marker's shared lock (or, where flock's is refused, its
    description's read lock: see the module's docstring) while the marker is in place, else None."""
    try:
        # O_NONBLOCK: a FIFO where the marker should be (a peer's, in the group mode) must not
        # hold the answer in open(2); it is no marker (S_ISREG below).
        fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        deadline = started = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                started = started or now
                if now - started >= FALLBACK_AFTER and description_lock(fd, fcntl.F_RDLCK):
                    break  # held past any eviction's rename, and no evictor's write lock: a reader's
                deadline = deadline or now + wait
                if now >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.001)
        try:
            info = os.fstat(fd)
            in_place = stat.S_ISREG(info.st_mode) and os.path.samestat(info, os.stat(marker)) \
                and _reached_directly(fd, marker)
        except (FileNotFoundError, NotADirectoryError):
            in_place = False
        if not in_place:
            os.close(fd)
            return None
        return fd
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def _reached_directly(fd: int, marker: str) -> bool:
    """Whether the marker was opened without passing a symlink: the kernel's name for the
    descriptor is the path asked for (the root is canonical: realpath'd by every caller), so
    a peer's symlink in place of checkouts/ or repos/<key> is never read or touched. One
    readlink: the ready path stays a few syscalls (store/tree.py does the rest of the store)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == marker
    except OSError:
        return True  # no /proc: the samestat check alone, as before


# The marker records up to this many of the checkout's top-level names; a
# checkout missing any of them was damaged (`rm -rf checkout/*`) and is not
# served. Extra names (build outputs of a review) are fine. A few lstat calls
# cost less than listing a top level of hundreds of entries on every answer.
TOP_NAMES = 8


def top_names(checkout_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(checkout_dir) if n != ".git")[:TOP_NAMES]


# The largest record of the store a reader takes (store/records.py reads every other
# record with it): the ready path and gc must agree on what a marker says, or a checkout
# one calls published and the other not is cloned again and again.
MAX_RECORD_BYTES = 1 << 20
_FIRST_READ = 1 << 16  # nearly every marker: one read, no fstat


def marker_record(marker_fd: int) -> dict:
    data = os.pread(marker_fd, _FIRST_READ, 0)
    if len(data) == _FIRST_READ:  # a large one (a cone of many directories): the rest of it
        size = os.fstat(marker_fd).st_size
        data = os.pread(marker_fd, MAX_RECORD_BYTES + 1, 0) if size <= MAX_RECORD_BYTES else b""
        if len(data) > MAX_RECORD_BYTES:
            data = b""
    try:
        value = json.loads(data or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def looks_intact(checkout_dir: str, record: dict) -> bool:
    """The cheap check every ready answer makes: the recorded top-level names exist."""
    names = record.get("top")
    if not isinstance(names, list):
        return False
    prefix = checkout_dir + "/"  # not os.path.join: this runs for every ready answer
    try:
        os.lstat(prefix + ".git")
        for name in names:
            os.lstat(prefix + name)
    except (FileNotFoundError, NotADirectoryError, TypeError):
        return False
    return True


def record_use(marker_fd: int) -> bool:
    """The marker's mtime becomes now: the last use. False when this process may not
    change the marker (a reader: another uid than the writer's, or a read-only mount):
    the caller then has the writer record it (handoff.py), still holding the lock."""
    try:
        os.utime(marker_fd)
        return True
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
            return False
        raise


def layout_version_of(repo_json: str) -> int | None:
    """The layout version a repository's store says it was written in (repo.json); None when
    there is no store yet or its record says none (stores before the field: version 1)."""
    try:
        fd = os.open(repo_json, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)  # never a FIFO's wait
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            record = json.loads(handle.read(1 << 16))
    except (OSError, ValueError):
        return None
    version = record.get("layout_version") if isinstance(record, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def ready_record(marker: str, wait: float = SHARED_LOCK_WAIT,
                 on_unrecorded: "Callable[[], object] | None" = None) -> dict | None:
    """The marker's record if the checkout is published (its last use is then now), else None.
    wait: how long to wait for the evictor's exclusive lock (0: not at all).
    on_unrecorded: called, with the shared lock still held, when this process may not record
    the use itself; so the writer's record of it comes before any eviction decision
    (invariant 4: the evictor cannot take the exclusive lock until we let go). It returns
    False when the writer answered that the checkout is not ready (it is moving away): the
    answer is then None."""
    fd = open_marker_shared(marker, wait)
    if fd is None:
        return None
    try:
        record = marker_record(fd)
        if not looks_intact(os.path.dirname(os.path.dirname(marker)), record):
            return None
        if not record_use(fd) and on_unrecorded is not None and on_unrecorded() is False:
            return None  # the writer, asked to record the use, says it is not ready: never answered so
        # Looked at once more after the use was recorded: past the bounds on readers' holds gc may
        # move a held checkout without the exclusive lock (store/checkouts.py
        # move_held_checkout_aside); a use recorded before this look makes it put the checkout
        # back, and a move before it is seen here.
        try:
            if not os.path.samestat(os.fstat(fd), os.stat(marker)):
                return None
        except (FileNotFoundError, NotADirectoryError):
            return None
        return record
    finally:
        os.close(fd)


def touch_if_ready(marker: str) -> bool:
    """True if the checkout is published; its last use is then now."""
    return ready_record(marker) is not None


def history_of(checkout_dir: str) -> str:
    """What a ready checkout's git sees of its history, in one stat: its .git/shallow is a link
    to the mirror's shallow file (git/shallow.py), there while the mirror's history has a
    boundary ("shallow"), gone once it is complete ("complete"); a checkout made before
    shallow mirrors has none (its mirror was complete)."""
    try:
        size = os.stat(checkout_dir + "/.git/shallow").st_size
    except (FileNotFoundError, NotADirectoryError):
        return "complete"
    except OSError:
        return "shallow"  # there, but not for us to read: never claim more history than there is
    return "shallow" if size else "complete"  # an empty one lists no boundary (libgit2 writes one)


def submodules_of(record: dict) -> str | None:
    """What a ready answer says of the commit's submodules (None: it has none)."""
    value = record.get("submodules")
    return value if value in ("included", "none") else None


def lfs_of(record: dict) -> str | None:
    """What a ready answer says of the checkout's Git LFS files (None: the commit has none,
    or the checkout was made before this was recorded)."""
    value = record.get("lfs")
    return value if value in ("content", "pointers", "off") else None
