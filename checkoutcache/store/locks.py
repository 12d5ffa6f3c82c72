"""File locks (flock(2), through fcntl): who may do what, and for how long.

fcntl.flock is the primitive portalocker calls on POSIX; calling it directly
saves portalocker's import (about 27 ms: it reads its package metadata) on
every slow-path call, and the store is Linux-only anyway (/proc, namespaces).

flock locks die with their process, so a SIGKILLed owner never leaves a lock
that blocks anyone (invariant 7). A lock held through an inherited descriptor
stays held until every process sharing it exits: the clone worker inherits its
clone lock from the process that started it, and git children inherit the
mirror lock, so even an orphaned git fetch still "holds the mirror".

Lock files may be deleted by gc while it holds them; every acquirer therefore
checks, once it holds the lock, that the path still names the inode it locked,
and retries if not. Every wait has a limit.

Which lock guards what, its mode, who takes it and the order of nesting: the
table in layout.py. The helpers at the end are named for those purposes; code
outside this module takes locks through them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Callable, Iterator

import fcntl

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.store.layout import RepoPaths, RootPaths
from checkoutcache.store import tree


_LOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class LockTimeout(Exception):
    pass


class Lock:
    """A held lock on a file; release() or leave the `with` block to drop it."""

    def __init__(self, path: str, handle):
        self.path = path
        self._handle = handle

    def fileno(self) -> int:
        return self._handle.fileno()

    @property
    def held(self) -> bool:
        return self._handle is not None

    def release(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.close()  # closing the descriptor drops the flock

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _open(path: str, create: bool):
    # Read-only: flock needs no write access, so a lock file a peer made 0644 (its
    # umask, or a chmod) still locks for every uid of the group.
    # Resolved beneath the root (store/tree.py): a lock file is never reached through a symlink.
    return os.fdopen(tree.open_file(path, os.O_RDONLY, create=create), "rb")


def _flock(handle, shared: bool, path: str) -> bool:
    try:
        flock(handle.fileno(), (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _LOCK_UNSUPPORTED:
            raise CheckoutCacheError("ROOT_UNUSABLE", root=os.path.dirname(path),
                                     why=f"file locks are not supported there ({exc.strerror})") from None
        raise


flock = fcntl.flock  # one name to replace in the test that makes locks unsupported


def try_lock(path: str, shared: bool = False, create: bool = True) -> Lock | None:
    """Take the lock now or return None; never waits. None also if the file is missing and create is False."""
    while True:
        try:
            handle = _open(path, create)
        except FileNotFoundError:
            return None
        if not _flock(handle, shared, path):
            handle.close()
            return None
        try:
            same = os.path.samestat(os.fstat(handle.fileno()), tree.lstat(path))
        except (FileNotFoundError, NotADirectoryError):
            same = False
        if same:
            return Lock(path, handle)
        handle.close()  # gc unlinked it between our open and our lock: take the new file
        if not create:
            return None


def lock(path: str, timeout: float, shared: bool = False) -> Lock:
    """Wait up to timeout seconds for the lock; LockTimeout after that."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    announced = False
    while True:
        held = try_lock(path, shared=shared)
        if held is not None:
            return held
        if not announced:
            import logging  # only when contended: never on the fast path

            logging.getLogger(__name__).debug("waiting for lock %s", path)
            announced = True
        if time.monotonic() >= deadline:
            raise LockTimeout(path)
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.1)


def is_locked(path: str) -> bool:
    """Whether some process holds the lock right now (a snapshot: it may change at once)."""
    probe = try_lock(path, shared=False, create=False)
    if probe is None:
        return tree.lexists(path)
    probe.release()
    return False


@contextlib.contextmanager
def rechecked(held: Lock | None, still_needed: Callable[[], bool]) -> Iterator[Lock | None]:
    """Look, lock, look again: the caller looked without the lock and tried it;
    this yields the lock only if still_needed() is still true under it (another
    process may have done the work meanwhile), else None. The lock is released
    on leaving the block either way."""
    if held is None:
        yield None
        return
    with held:
        yield held if still_needed() else None


# ------------------------------------------------------------------ by purpose

MIRROR_WAIT_FOR_GC = 5.0
SCRATCH_WAIT = 30.0


def gc_run(root_paths: RootPaths) -> Lock | None:
    """One gc at a time per root; a second one skips instead of waiting."""
    return try_lock(root_paths.gc_lock)


def clone_of(paths: RepoPaths, name: str) -> Lock | None:
    """The right to make (or to tidy after) this checkout's clone; never waits."""
    return try_lock(paths.clone_lock(name))


def existing_clone_of(paths: RepoPaths, name: str) -> Lock | None:
    """As clone_of, but only if the lock file exists (gc forgets finished checkouts)."""
    return try_lock(paths.clone_lock(name), create=False)


def clone_running(paths: RepoPaths, name: str) -> bool:
    return is_locked(paths.clone_lock(name))


def history_of(paths: RepoPaths) -> Lock | None:
    """The right to run the repository's background history (clone/history.py); never waits."""
    return try_lock(paths.history_lock)


def history_running(paths: RepoPaths) -> bool:
    return is_locked(paths.history_lock)


def base_search_of(paths: RepoPaths, name: str) -> Lock | None:
    """The right to search the merge base of a checkout's commit and a base; never waits."""
    return try_lock(paths.base_lock(name))


def base_search_running(paths: RepoPaths, name: str) -> bool:
    return is_locked(paths.base_lock(name))


def mirror_write(paths: RepoPaths, timeout: float) -> Lock:
    """Every write to mirror.git (fetch, keep-refs, repack, stale git locks)."""
    return lock(paths.mirror_lock, timeout=timeout)


def scratch_change(paths: RepoPaths, timeout: float = SCRATCH_WAIT) -> Lock:
    """Creating or reaping scratch directories."""
    return lock(paths.scratch_lock, timeout=timeout)


def checkout_exclusive(marker: str) -> Lock | None:
    """The marker's exclusive lock, to move a checkout away; never waits (a held
    checkout is kept, not waited for). None too if the marker is gone. Two locks
    (store/ready.py): flock's exclusive one, and the description's write lock, which
    only a writer's descriptor can take and a reader's read lock refuses."""
    from checkoutcache.store.ready import description_lock

    writable = True
    try:
        fd = tree.open_file(marker, os.O_RDWR)
    except FileNotFoundError:
        return None
    except PermissionError:  # a group peer's marker it made 0644: flock's lock alone, as before
        writable = False
        try:
            fd = tree.open_file(marker, os.O_RDONLY)
        except FileNotFoundError:
            return None
    handle = os.fdopen(fd, "rb")
    # The write lock refused (a reader's read lock) is a hold; none to take (no OFD locks
    # here, or no descriptor to take one with) leaves flock's alone, as before.
    if not _flock(handle, False, marker) or (writable and description_lock(fd, fcntl.F_WRLCK) is False):
        handle.close()
        return None
    try:
        same = os.path.samestat(os.fstat(fd), tree.lstat(marker))
    except (FileNotFoundError, NotADirectoryError):
        same = False
    if not same:
        handle.close()
        return None
    return Lock(marker, handle)


def checkout_held(marker: str) -> bool:
    """Whether a ready answer, an exec or a hold has the checkout right now (flock's shared
    lock, or the description's read lock of a ready answer that met a reader's exclusive one)."""
    from checkoutcache.store.ready import description_locked

    if not tree.lexists(marker):
        return False
    if is_locked(marker):
        return True
    try:
        fd = tree.open_file(marker, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return description_locked(fd)
    finally:
        os.close(fd)


def serve_journal_owned(path: str) -> Lock:
    """A serve's own journal, created and held for the serve's whole life (its name is
    fresh: nobody else can hold it). The proof gc reads that the serve still lives."""
    held = try_lock(path)
    if held is None:
        raise CheckoutCacheError("ROOT_UNUSABLE", root=os.path.dirname(path),
                                 why=f"a fresh journal {os.path.basename(path)} is locked by another process")
    return held


def abandoned_journal(path: str) -> Lock | None:
    """A journal's lock if its serve is gone (nobody holds it); never waits. The caller may
    remove the file while holding this: a serve re-checks the inode it locked."""
    return try_lock(path, create=False)
